"""The prefill's dequantizing kernel alone (``QDequantSpec``: a packed weight -> bf16 scratch, which cuBLAS then
reads) on Llama-1B's product shapes in the formats of a Q4_K_M and a Q8_0 file, the packed copies rotated past L2.

    python benchmarks/dequant_bench.py [--formats q4_k,q6_k,q8_0]

Prints a markdown table: us a launch, GB/s (packed bytes read + bf16 bytes written), % of the device's copy
bandwidth (bytes read + written by a 1 GB device copy), and the output's largest difference from the format's fp32
reference dequantization, relative to its largest value (bf16 rounding to nearest: at most 2^-8 of a value).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_kernels import copy_bw, graph_time  # noqa: E402
from quant_bench import _weight, packed_copies  # noqa: E402

from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen.specs_quant import QDequantSpec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402

SHAPES = [("qkv", 3072, 2048), ("gate/up half", 8192, 2048), ("down", 2048, 8192)]


def main() -> int:
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q4_k,q6_k,q8_0")
    args = ap.parse_args()
    copy = copy_bw()
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s\n")
    print("| shape | format | us | GB/s (% copy) | max difference from the reference / its largest |")
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    for name, n, k in SHAPES:
        for fmt in args.formats.split(","):
            qw = _weight(fmt, n, k, rng)
            sets = packed_copies(qw)
            ck = K.build(QDequantSpec(n, k, qw.format, qw.group, DType.BF16, qw.scale_dtype))
            out = cp.zeros((n, k), cp.uint16)
            K.launch(ck, [*sets[0], out])
            want = qw.dequantize().astype(np.float32)
            got = out.get().view(DType.BF16.np).astype(np.float32)
            err = float(np.abs(got - want).max() / np.abs(want).max())  # bf16 rounds to nearest: at most 2^-8 of a value
            us = graph_time([lambda s, p=p, o=out, ck=ck: K.launch(ck, [*p, o], stream=s) for p in sets])
            gb = (qw.nbytes + n * k * 2) / us * 1e-3
            print(f"| {name} {n}x{k} | {fmt} | {us:.2f} | {gb:.0f} ({100 * gb * 1e9 / copy:.0f}%) | {err:.1e} |", flush=True)
            del sets, out
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
