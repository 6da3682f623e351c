"""PyTorch's kernels at the shapes where fusec's plans spend their time (GPU only): what cuBLAS
reaches for Qwen3-0.6B's M = 128 products (and with K split into batched halves/quarters), and what
torch's scaled_dot_product_attention reaches at the four workloads' attention shapes.

    python benchmarks/peer_kernels.py [OUT.json]

Each op is captured 20 times into one torch CUDA graph and the graph replayed 20 times between
CUDA events: the median per op, as in a plan's graph (no host launch latency). Compare with the
per-kernel times of `fusec bench MODEL --cuda-graph --per-kernel` for the same shapes.
"""

from __future__ import annotations

import json
import statistics
import sys


def graph_us(fn, reps: int = 20) -> float:  # noqa: ANN001
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        t.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(t)


def main(argv: list[str]) -> int:
    import torch
    import torch.nn.functional as F

    dev = "cuda"
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": {}, "sdpa": {}}
    bf = torch.bfloat16
    for name, (m, k, n) in {"qkv": (128, 1024, 4096), "o_proj": (128, 2048, 1024), "gate_up": (128, 1024, 6144),
                            "down": (128, 3072, 1024), "lm_head": (128, 1024, 151936)}.items():
        x = torch.randn(m, k, device=dev, dtype=bf)
        w = torch.randn(n, k, device=dev, dtype=bf) * 0.02
        r = torch.randn(m, n, device=dev, dtype=bf)
        row = {"linear": graph_us(lambda: F.linear(x, w)),
               "linear+residual (addmm)": graph_us(lambda: torch.addmm(r, x, w.t()))}
        if n < 100000:  # weights cold: 20 copies (>= 100 MB, twice L2) read in turn, as a plan streams its layers
            ws = [w.clone() for _ in range(max(20, int(100e6 // (k * n * 2))))][:20]
            it = iter(range(1 << 30))
            row["linear, weights from DRAM"] = graph_us(lambda: F.linear(x, ws[next(it) % len(ws)]), reps=len(ws))
        for s in (2, 4):
            if k % s:
                continue
            xs = x.view(m, s, k // s).transpose(0, 1)  # [s, m, k/s]
            ws = w.view(n, s, k // s).permute(1, 2, 0)  # [s, k/s, n]
            row[f"split-K {s} (bmm, then sum)"] = graph_us(lambda: torch.bmm(xs, ws).sum(0))
            row[f"split-K {s} (bmm only)"] = graph_us(lambda: torch.bmm(xs, ws))
        mb = (k * n * 2 + m * k * 2 + m * n * 2) / 1e6
        row["min_MB"] = mb
        res["gemm"][name] = row
        print(f"gemm {name} {m}x{k}x{n} ({mb:.1f} MB): " + "  ".join(f"{a} {b:.2f}" for a, b in row.items() if a != "min_MB")
              + " us", flush=True)
    for name, (b, hq, hkv, s, d, dt, causal, padded) in {
            "qwen3-0.6b 1x128": (1, 16, 8, 128, 128, bf, True, False),
            "gpt2-small 8x128": (8, 12, 12, 128, 64, torch.float16, True, False),
            "bert-base 32x128": (32, 12, 12, 128, 64, torch.float16, False, True),
            "minilm 32x128": (32, 12, 12, 128, 32, torch.float16, False, True)}.items():
        q = torch.randn(b, hq, s, d, device=dev, dtype=dt)
        kk = torch.randn(b, hkv, s, d, device=dev, dtype=dt).repeat_interleave(hq // hkv, 1)
        v = torch.randn(b, hkv, s, d, device=dev, dtype=dt).repeat_interleave(hq // hkv, 1)
        mask = None
        if padded:
            mask = torch.zeros(b, 1, 1, s, device=dev, dtype=dt)
            mask[b // 2:, ..., s * 3 // 4:] = -1e4
        row = {"sdpa": graph_us(lambda: F.scaled_dot_product_attention(q, kk, v, attn_mask=mask, is_causal=causal))}
        res["sdpa"][name] = row
        print(f"sdpa {name}: {row['sdpa']:.2f} us", flush=True)
    if argv:
        with open(argv[0], "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
