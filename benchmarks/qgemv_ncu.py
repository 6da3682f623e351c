"""One launch of each quantized-GEMV form on Llama-1B's gate/up shape (N 16384, K 2048, Q4_K;
M = 1 and 8; the FMA and tensor-core forms), for Nsight Compute to read the hardware counters of (a script, not a test):

    ncu --clock-control none -k regex:fc_qgemv --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section MemoryWorkloadAnalysis python3 benchmarks/qgemv_ncu.py

The launch order (kernel names are hashes) is printed first: M, format, form (FMA: rows, fold; tc: warps).
``--rule FMT:M:NxK[:norm][:glu]`` (repeatable) launches the lowering's form (fusec.lower.qgemv_form.gemv_form) of that
product instead, with its RMSNorm prologue and gated epilogue where named.
"""

from __future__ import annotations

import argparse
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


def _rule(arg: str) -> tuple[str, int, int, int, bool, bool]:
    parts = arg.split(":")
    n, k = (int(v) for v in parts[2].split("x"))
    return parts[0], int(parts[1]), n, k, "norm" in parts[3:], "glu" in parts[3:]


def main() -> None:
    import cupy as cp

    from fusec.codegen.specs import Epilogue
    from fusec.lower.qgemv_form import gemv_form

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rule", action="append", type=_rule, default=[], metavar="FMT:M:NxK[:norm][:glu]")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    weights: dict[tuple[str, int, int], tuple] = {}  # one random weight per (format, N, K), on the host and device

    def weight(fmt: str, n: int, k: int) -> tuple:
        if (fmt, n, k) not in weights:
            qw = _weight(fmt, n, k, rng)
            weights[fmt, n, k] = qw, [cp.asarray(a) for a in qw.arrays]
        return weights[fmt, n, k]

    runs = [("q4_k", m, 16384, 2048, False, False, form) for m, form in FORMS] if not args.rule else []
    for fmt, m, n, k, norm, glu in args.rule:
        qw = weight(fmt, n, k)[0]
        runs.append((fmt, m, n, k, norm, glu, gemv_form(m, n, k, qw.format, qw.group, DType.BF16, norm, glu)))
    for fmt, m, n, k, norm, glu, form in runs:
        qw, arrays = weight(fmt, n, k)
        extra = [_bf16((k,))] if norm else []
        spec = QGemvSpec(m, n, k, qw.format, qw.group, DType.BF16, qw.scale_dtype, Epilogue(), norm=norm,
                         glu="silu" if glu else "", eps=1e-5, **form)
        ck = K.build(spec)
        x, out = _bf16((m, k)), cp.empty((m, n // 2 if glu else n), cp.uint16)
        print(f"launch: {ck.name} M={m} {fmt} {n}x{k} norm={norm} glu={glu} {form}", flush=True)
        K.launch(ck, [x, *arrays, *extra, out])
        cp.cuda.runtime.deviceSynchronize()


if __name__ == "__main__":
    main()
