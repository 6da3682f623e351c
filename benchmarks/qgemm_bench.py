"""A prefill's product over a packed weight, alone, both ways: dequantized in the tile of fusec's tensor-core GEMM
(``QGemmSpec``, templates/qgemm_tc.cu.jinja) against the scratch path (``QDequantSpec`` into bf16 scratch, then a
cuBLAS bf16 GEMM through torch, as a plan's prefill runs it), on Llama-1B's product shapes in the formats of a Q4_K_M
and a Q8_0 file, packed copies rotated past L2.

    python benchmarks/qgemm_bench.py [--rows 32,128,512] [--formats q4_k,q6_k,q8_0] [--tilings 4,1,4,2,4;8,2,2]

Prints a markdown table: us a product for the rule's tiling (and each --tilings one, mt,rw,kw[,ks[,blocks[,depth]]]), the scratch path's
dequantize and GEMM and their sum, and the tile product's largest difference from the scratch path's output relative
to the output's largest value (the same bf16 weights; only the order of the fp32 sums differs). Each kernel is timed
alone in a CUDA graph (the median of 15 replays; fusec's kernels cycle through the packed copies, cuBLAS through
torch's graph); the scratch path is the sum of its two kernels' times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_kernels import graph_time  # noqa: E402
from quant_bench import _weight, packed_copies  # noqa: E402

from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen.specs_quant import QDequantSpec, QGemmSpec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402
from fusec.lower.quant import qgemm_tiling  # noqa: E402

SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate/up", 16384, 2048), ("down", 2048, 8192)]


def _torch_graph_us(fn, n: int = 20, reps: int = 15) -> float:  # noqa: ANN001
    """Median us a call of ``fn`` (torch work) in a CUDA graph of ``n`` calls, over ``reps`` replays."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / n)
    return statistics.median(ts)


def main() -> int:
    import cupy as cp
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="32,128,512")
    ap.add_argument("--formats", default="q4_k,q6_k,q8_0")
    ap.add_argument("--tilings", default="", help="more tilings to time, mt,rw,kw[,ks[,blocks[,depth]]] separated by ';'")
    args = ap.parse_args()
    extra = [tuple(int(v) for v in t.split(",")) for t in args.tilings.split(";") if t]
    print("| shape | format | rows | tile (rule, sm_90: mt,rw,kw,ks,blocks) | " + "".join(f"tile {t} | " for t in extra)
          + "dequantize | cuBLAS | scratch path | tile / scratch | max difference / largest |")
    print("|---|---|---|---|" + "---|" * len(extra) + "---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        for fmt in args.formats.split(","):
            qw = _weight(fmt, n, k, rng)
            sets = packed_copies(qw)
            dq = K.build(QDequantSpec(n, k, qw.format, qw.group, DType.BF16, qw.scale_dtype))
            scratch = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn((m, k), device="cuda").to(torch.bfloat16)
                out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                ref = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
                xp, op, sp = (cp.asarray(t.view(torch.int16)) for t in (x, out, scratch))
                rule = qgemm_tiling(m, n, k, clusters=True)
                times = []
                for t in [rule, *extra]:
                    if not isinstance(t, dict):  # mt,rw,kw[,ks[,blocks[,depth]]]
                        t = {"mt": t[0], "rw": t[1], "kw": t[2], "ks": t[3] if len(t) > 3 else 1,
                             "blocks": t[4] if len(t) > 4 else max(1, 8 // (t[1] * t[2])),
                             "depth": t[5] if len(t) > 5 else 2}
                    spec = QGemmSpec(m, n, k, qw.format, qw.group, DType.BF16, qw.scale_dtype, **t)
                    ck = K.build(spec)
                    times.append(graph_time([lambda st, ck=ck, xp=xp, op=op, p=p: K.launch(ck, [xp, *p, op], stream=st)
                                             for p in sets]))
                    if len(times) == 1:
                        got = out.float()
                t_dq = graph_time([lambda st, p=p, sp=sp, dq=dq: K.launch(dq, [*p, sp], stream=st) for p in sets])
                t_mm = _torch_graph_us(lambda x=x, scratch=scratch, ref=ref: torch.matmul(x, scratch.t(), out=ref))
                t_both = t_dq + t_mm
                want = ref.float()
                diff = float((got - want).abs().max() / want.abs().max())
                print(f"| {name} {n}x{k} | {fmt} | {m} | {times[0]:.2f} ({','.join(map(str, rule.values()))}) | "
                      + "".join(f"{t:.2f} | " for t in times[1:])
                      + f"{t_dq:.2f} | {t_mm:.2f} | {t_both:.2f} | {times[0] / t_both:.2f} | {diff:.1e} |",
                      flush=True)
            del sets, scratch
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
