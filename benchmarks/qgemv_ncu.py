"""One launch of each quantized-GEMV form on Llama-1B's gate/up shape (N 16384, K 2048, Q4_K;
M = 1 and 8; the FMA and tensor-core forms), for Nsight Compute to read the hardware counters of (a script, not a test):

    ncu --clock-control none -k regex:fc_qgemv --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis python3 benchmarks/qgemv_ncu.py

The launch order (kernel names are hashes) is printed first: M, format, form (FMA: rows, fold; tc: warps).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_bench import _bf16, _weight  # noqa: E402

from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen.specs_quant import QGemvSpec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402

FORMS = [(1, dict(rows=2, fold=True)), (8, dict(rows=2, fold=False)), (1, dict(tc=True, warps=4)),
         (8, dict(tc=True, warps=4))]


def main() -> None:
    import cupy as cp

    n, k = 16384, 2048
    rng = np.random.default_rng(0)
    for fmt in ("q4_k",):
        qw = _weight(fmt, n, k, rng)
        arrays = [cp.asarray(a) for a in qw.arrays]
        for m, form in FORMS:
            ck = K.build(QGemvSpec(m, n, k, qw.format, qw.group, DType.BF16, qw.scale_dtype, **form))
            x, out = _bf16((m, k)), cp.empty((m, n), cp.uint16)
            print(f"launch: {ck.name} M={m} {fmt} {form}", flush=True)
            K.launch(ck, [x, *arrays, out])
            cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
