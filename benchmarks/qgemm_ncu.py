"""Launch the dequantize-in-tile GEMM (``QGemmSpec``) a few times on one shape, for a profiler (Nsight Compute:
benchmarks/gpu_session.sh qgncu). Random packed weights in a format, random bf16 x.

    python benchmarks/qgemm_ncu.py [--fmt q4_k] [--m 32] [--n 3072] [--k 2048] [--tile 4,1,4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_bench import _weight  # noqa: E402

from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen.specs_quant import QGemmSpec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmt", default="q4_k")
    ap.add_argument("--m", type=int, default=32)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--tile", default="4,1,4", help="mt,rw,kw[,ks]")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args()
    t = [int(v) for v in args.tile.split(",")]
    qw = _weight(args.fmt, args.n, args.k, np.random.default_rng(0))
    spec = QGemmSpec(args.m, args.n, args.k, qw.format, qw.group, DType.BF16, qw.scale_dtype, mt=t[0], rw=t[1], kw=t[2],
                     ks=t[3] if len(t) > 3 else 1)
    ck = K.build(spec)
    x = cp.asarray(np.random.default_rng(1).standard_normal((args.m, args.k)).astype(DType.BF16.np).view(np.uint16))
    out = cp.zeros((args.m, args.n), cp.uint16)
    arrays = [cp.asarray(a) for a in qw.arrays]
    for _ in range(args.launches):
        K.launch(ck, [x, *arrays, out])
    cp.cuda.runtime.deviceSynchronize()
    print(f"launched {ck.name} {args.launches}x: grid {ck.grid}, block {ck.block}, {ck.shared_mem} bytes of shared memory")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
