"""The fp16/bf16 attention kernel alone at prefill shapes: each block shape (query warps x key splits), with and
without a mask a row a query (the generation prefill's) or a row a batch broadcast over the queries (an encoder's key
padding mask, BERT's), causal or not. Times a CUDA graph of 100 launches (bench_decode_kernels.graph_time, per
launch: the kernel and the graph's launch gap); with --ncu, launches each variant once for Nsight Compute instead.

    python benchmarks/attn_bench.py [--shape qwen3|qwen3-2k|llama|gpt2|bert] [--forms rows,keys,causal,none] [--ncu]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_kernels import graph_time  # noqa: E402  (the benchmarks' CUDA-graph timing)

N = 100  # launches a CUDA graph (one launch at a time from Python measured the host, not the kernel)
SHAPES = {"qwen3": (1, 16, 8, 128, 128), "llama": (1, 32, 8, 32, 64), "gpt2": (8, 12, 12, 128, 64),
          "bert": (32, 12, 12, 128, 64), "qwen3-2k": (1, 16, 8, 2048, 128)}  # qwen3-2k: a long prompt's prefill


def main() -> int:
    import cupy as cp

    from fusec.codegen import kernels as K
    from fusec.codegen import specs as S
    from fusec.dtypes import DType

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3", choices=sorted(SHAPES))
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--forms", default="rows,causal,none", help="which of rows, keys, causal, none")
    ap.add_argument("--qwarps", default="1,2,4")
    ap.add_argument("--stages", default="0", help="K/V stages to try (0: the rule)")
    ap.add_argument("--bn", default="0", help="keys a K/V tile to try (0: the rule, 64; 32)")
    args = ap.parse_args()
    B, H, Hkv, S_, D = SHAPES[args.shape]
    rng = np.random.default_rng(0)
    q = cp.asarray(rng.standard_normal((B, H, S_, D)).astype(np.float32)).astype(cp.float16).view(cp.uint16)
    k = cp.asarray(rng.standard_normal((B, Hkv, S_, D)).astype(np.float32)).astype(cp.float16).view(cp.uint16)
    v = cp.asarray(rng.standard_normal((B, Hkv, S_, D)).astype(np.float32)).astype(cp.float16).view(cp.uint16)
    keep = np.arange(S_)[None, :] <= np.arange(S_)[:, None]
    mask = cp.asarray(np.where(np.broadcast_to(keep, (B, 1, S_, S_)), 0.0, -65504.0).astype(np.float16)).view(cp.uint16)
    pad = np.arange(S_)[None, :] < rng.integers(S_ // 2, S_ + 1, (B, 1))  # each row's keys past its length masked
    kmask = cp.asarray(np.where(pad, 0.0, -65504.0).astype(np.float16)).view(cp.uint16)
    out = cp.zeros((B, H, S_, D), cp.uint16)
    print(f"| shape {args.shape} B{B} H{H}/{Hkv} S{S_} D{D} | qwarps, stages, bn | grid | smem | us a launch |")
    print("|---|---|---|---|---|")
    shapes = [(int(qw), int(st), int(bn)) for qw in args.qwarps.split(",") for st in args.stages.split(",")
              for bn in args.bn.split(",") if not int(bn) or int(bn) * int(qw) // 4 % 16 == 0]
    for form in args.forms.split(","):
        for qw, st, bn in shapes:
            kw: dict = {}  # the masks as the lowering gives them: the generation prefill's, BERT's
            if form in ("rows", "keys"):
                kw = dict(mask="additive", mask_dtype=DType.F16, mask_vec=True,
                          mask_strides=(S_ * S_, 0, S_, 1) if form == "rows" else (S_, 0, 0, 1))
            spec = S.AttentionSpec(B, H, Hkv, S_, S_, D, DType.F16, 1 / np.sqrt(D), causal=form == "causal",
                                   qwarps=qw, stages=st, bn=bn, **kw)
            ck = K.build(spec)
            a = [q, k, v] + ([mask] if form == "rows" else [kmask] if form == "keys" else []) + [out]
            if args.ncu:
                K.launch(ck, a)
                cp.cuda.runtime.deviceSynchronize()
                continue
            us = graph_time([lambda s, ck=ck, a=a: K.launch(ck, a, s)], min_iters=N)
            print(f"| {form} | {qw} {st} {bn} | {ck.grid} | {ck.shared_mem} | {us:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
