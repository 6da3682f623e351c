"""One launch of each form of the bf16 skinny product (GemvSpec) and of cuBLAS on the Llama-1B LM
head's shape (N 128256, K 2048, M 1), for Nsight Compute to read the hardware counters of (a script,
not a test):

    ncu --clock-control none -k regex:"fc_gemv|gemv|gemm" --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \\
        python3 benchmarks/gemv_ncu.py

The launch order (kernel names are hashes) is printed first: the register form, then the
shared-memory ring forms (stages x tiles per block), then cuBLAS.
"""

from __future__ import annotations

import sys

import numpy as np

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.dtypes import DType

FORMS = [(0, 1), (2, 1), (3, 4), (4, 4)]


def main() -> None:
    import cupy as cp

    from fusec.runtime import cublas

    n, k, m = 128256, 2048, 1
    rng = np.random.default_rng(0)
    w = cp.asarray(rng.uniform(-0.05, 0.05, (n, k)).astype(np.float32)).astype(cp.float32)
    w = (w.view(cp.uint32) >> 16).astype(cp.uint16)  # bf16 bits
    x = (cp.asarray(rng.uniform(-1, 1, (m, k)).astype(np.float32)).view(cp.uint32) >> 16).astype(cp.uint16)
    out = cp.empty((m, n), cp.uint16)
    for st, tpb in FORMS:
        ck = K.build(S.GemvSpec(m, n, k, DType.BF16, stages=st, tiles_per_block=tpb))
        print(f"launch: {ck.name} stages={st} tiles_per_block={tpb} grid={ck.grid} block={ck.block} "
              f"smem={ck.shared_mem} registers={ck.binary.registers}", flush=True)
        K.launch(ck, [x, w, out])
        cp.cuda.runtime.deviceSynchronize()
    handle = cublas.Handle()
    g = cublas.GemmCall(m=m, n=n, k=k, batch=1, a=x.data.ptr, b=w.data.ptr, c=out.data.ptr, lda=k, ldb=k, ldc=n,
                        stride_a=0, stride_b=0, stride_c=m * n, trans_a=False, trans_b=True, dtype="bf16", compute="f32")
    print("launch: cuBLAS [N,K]", flush=True)
    g(handle, cp.cuda.get_current_stream().ptr)
    cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    sys.exit(main())
