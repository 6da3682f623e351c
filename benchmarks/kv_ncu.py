"""One launch each of the decode attention at Qwen3-0.6B's heads (16 q / 8 kv heads, D 128, cache T 271,
200 keys visible) for batch 1 and 8, in the plan's form (cluster merge, older rows before the wait), for
Nsight Compute to read (a script, not a test):

    ncu --clock-control none -k regex:fc_kvattn --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section LaunchStats python3 benchmarks/kv_ncu.py

The launch order (kernel names are hashes) is printed first."""

from __future__ import annotations

import numpy as np

from fusec.codegen import kernels as K
from fusec.codegen.build_decode import kv_attention_spec
from fusec.dtypes import DType


def main() -> None:
    import cupy as cp

    rng = np.random.default_rng(0)
    for b in (1, 8):
        spec = kv_attention_spec(b, 16, 8, 1, 271, 128, DType.BF16, 0.088, prefetch=True, cluster=True)
        ck = K.build(spec)
        q = cp.asarray(rng.standard_normal((b, 16, 1, 128)).astype(np.float32)).astype(cp.float16).view(cp.uint16)
        k = cp.asarray(rng.standard_normal((b, 8, 271, 128)).astype(np.float32)).astype(cp.float16).view(cp.uint16)
        v = cp.asarray(rng.standard_normal((b, 8, 271, 128)).astype(np.float32)).astype(cp.float16).view(cp.uint16)
        pos = cp.full(b, 200, dtype=cp.int64)
        out = cp.empty((b, 16, 1, 128), cp.uint16)
        print(f"launch: {ck.name} B={b} splits={spec.splits} cluster={spec.cluster} grid={ck.grid}", flush=True)
        for _ in range(2):
            K.launch(ck, [q, k, v, pos, out])
        cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
