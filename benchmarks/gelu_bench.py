"""BERT-base's FFN bias + erf-GELU kernel alone ([4096, 3072] halfs + a [3072] bias, the plan's elementwise kernel):
the GELU as built (a half result: fc_gelu_erf16, common.cuh's polynomial erfc) against the same source with erff
(fc_gelu_erf), beside a negation of the same bytes (a copy) (the memory floor) and the GELU without the bias. Each kernel
rotates over 4 input/output pairs (400 MB, past L2) in a CUDA graph (bench_decode_kernels.graph_time).

    python benchmarks/gelu_bench.py [--rows 4096] [--cols 3072]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_kernels import graph_time  # noqa: E402  (the benchmarks' CUDA-graph timing)

COPIES = 4


def main() -> int:
    import cupy as cp

    from fusec import ops as O
    from fusec.codegen import kernels as K
    from fusec.codegen import specs as S
    from fusec.codegen.compile import compile_cuda
    from fusec.codegen.elementwise import Apply, In
    from fusec.dtypes import DType

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=3072)
    args = ap.parse_args()
    m, n = args.rows, args.cols
    f16 = DType.F16
    gelu = O.GeluAttrs()
    exprs = {"bias + gelu": (Apply(O.Op.GELU, (Apply(O.Op.ADD, (In(0), In(1))),), gelu), [(m, n), (n,)]),
             "gelu": (Apply(O.Op.GELU, (In(0),), gelu), [(m, n)]),
             "negate (a copy)": (Apply(O.Op.NEG, (In(0),)), [(m, n)])}
    rng = np.random.default_rng(0)
    xs = [cp.asarray(rng.standard_normal((m, n)).astype(np.float16)) for _ in range(COPIES)]
    outs = [cp.empty((m, n), cp.float16) for _ in range(COPIES)]
    bias = cp.asarray(rng.standard_normal(n).astype(np.float16))
    gb = 2 * m * n * 2 / 1e9
    print(f"| kernel ({m} x {n} halfs) | erf | us a launch | GB/s (in + out) |")
    print("|---|---|---|---|")
    for label, (expr, shapes) in exprs.items():
        spec = S.elementwise_spec(expr, shapes, [f16] * len(shapes), (m, n))
        ck = K.build(spec)
        forms = [("as built", ck)]
        head, mark, body = ck.source.partition("// ---- end common.cuh ----")
        if "fc_gelu_erf16(" in body:
            src = head + mark + body.replace("fc_gelu_erf16(", "fc_gelu_erf(")
            forms.append(("erff", dataclasses.replace(ck, source=src, binary=compile_cuda(src, ck.name))))
        for form, k in forms:
            extra = [bias] if len(shapes) > 1 else []
            fns = [lambda s, k=k, i=i, extra=extra: K.launch(k, [xs[i], *extra, outs[i]], s) for i in range(COPIES)]
            us = graph_time(fns, min_iters=40)
            print(f"| {label} | {form if 'gelu' in label else '-'} | {us:.2f} | {gb / us * 1e6:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
