"""Shared by the decode benchmark's modules (benchmarks/decode.py describes the benchmark): the
clock and log, the run's context (``Ctx``), the ceilings (copy bandwidth, GEMM rate), the model
and its checkpoint, the rooflines, and the JSON writer."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from decode_fusec import PlanWorker

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def med(xs: list[float]) -> float | None:
    return float(statistics.median(xs)) if xs else None


class Ctx:
    """Everything one run shares: options, device, model, checkpoint, ceilings."""

    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.torch = torch
        self.cuda = not args.cpu_check
        self.dev = "cuda" if self.cuda else "cpu"
        self.tdtype = torch.bfloat16 if self.cuda else torch.float32
        self.new_tokens = args.new_tokens
        self.max_prefill = args.max_prefill
        self.budget = args.budget_s
        self.hf: Any = None
        self.gm: Any = None
        self.dcfg: Any = None
        self.ckpt: str | None = None
        self.bw: float | None = None  # bytes/s, read + written
        self.gemm: float | None = None  # FLOP/s
        self.kept_plans: dict[int, Any] = {}  # batch -> (manifest, blobs) of context-128 plans (counters pass)
        self.worker: PlanWorker | None = None
        self.model_name = ""

    def left(self) -> float:
        return self.budget - (time.perf_counter() - T0)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """(ms, fn()) with CUDA events on the current torch stream (host clock on the CPU)."""
        torch = self.torch
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            r = fn()
            e.record()
            e.synchronize()
            return float(s.elapsed_time(e)), r
        t = time.perf_counter()
        r = fn()
        return (time.perf_counter() - t) * 1e3, r


# ---------------------------------------------------------------------------------------------
# ceilings


def measure_copy_bw(ctx: Ctx) -> dict[str, Any]:
    torch = ctx.torch
    n = (1 << 30) // 4 if ctx.cuda else (1 << 24) // 4
    src = torch.randn(n, device=ctx.dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ctx.sync()
    ms = [ctx.timed(lambda: dst.copy_(src))[0] for _ in range(20)]
    t = med(ms) / 1e3
    bw = 2 * src.numel() * src.element_size() / t
    src = dst = None  # free the buffers (the closure above reads them)
    return {"bytes_copied": n * 4, "median_ms": t * 1e3, "bytes_per_s": bw, "tb_per_s": bw / 1e12}


def measure_gemm(ctx: Ctx) -> dict[str, Any]:
    torch = ctx.torch
    n = 8192 if ctx.cuda else 512
    a = torch.randn(n, n, device=ctx.dev, dtype=ctx.tdtype)
    b = torch.randn(n, n, device=ctx.dev, dtype=ctx.tdtype)
    for _ in range(3):
        a @ b
    ctx.sync()
    ms = [ctx.timed(lambda: a @ b)[0] for _ in range(10)]
    t = med(ms) / 1e3
    a = b = None  # free the buffers (the closure above reads them)
    return {"n": n, "dtype": str(ctx.tdtype), "median_ms": t * 1e3, "flop_per_s": 2 * n ** 3 / t,
            "tflop_per_s": 2 * n ** 3 / t / 1e12}


# ---------------------------------------------------------------------------------------------
# the model and its checkpoint


def build_hf(ctx: Ctx, tmpdir: str) -> None:
    torch = ctx.torch
    import transformers as T

    from fusec.genmodel import load_generation_model
    from fusec.models import get_config
    from torch_decoder import DecoderConfig

    name = "qwen3-tiny" if ctx.args.cpu_check else "qwen3-0.6b"
    c = get_config(name)
    cfg = T.Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                        intermediate_size=c.intermediate_size, tie_word_embeddings=True, rope_theta=c.rope_theta,
                        rms_norm_eps=c.norm_eps, max_position_embeddings=max(c.max_positions, 8192),
                        hidden_act="silu", attention_bias=False, use_sliding_window=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(ctx.dev):
        model = T.Qwen3ForCausalLM(cfg)
    model = model.to(ctx.tdtype).eval().requires_grad_(False)
    gen = model.generation_config
    gen.eos_token_id = None  # random weights: run every row to max_new_tokens, as fusec (eos_ids=()) does
    gen.bos_token_id = None
    gen.pad_token_id = 0
    model.save_pretrained(tmpdir)
    log(f"HF model {name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {ctx.tdtype}) "
        f"built and saved in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    ctx.gm = load_generation_model(name, weights_dir=tmpdir)
    ctx.hf, ctx.ckpt, ctx.model_name = model, tmpdir, name
    ctx.dcfg = DecoderConfig.from_hf(model.config)
    log(f"fusec loaded the checkpoint in {time.perf_counter() - t0:.1f} s")


def flops_prefill(c: Any, batch: int, s: int) -> float:
    d, hd, h, kv, ff = c.dim, c.head_dim, c.n_head, c.n_kv_head, c.intermediate_size
    mm = d * (h + 2 * kv) * hd + h * hd * d + 3 * d * ff
    attn = 2 * 2 * batch * h * hd * s * (s + 1) / 2
    return c.n_layer * (2 * batch * s * mm + attn) + 2 * batch * d * c.vocab_size


def rooflines(ctx: Ctx, batch: int, context: int) -> dict[str, Any]:
    from torch_decoder import kv_bytes_per_step, weight_bytes_per_step

    n = ctx.new_tokens
    keys = context + n / 2  # steps feeding positions C .. C+N-2 attend C+1 .. C+N-1 keys
    wb = weight_bytes_per_step(ctx.dcfg, batch)
    kvb = kv_bytes_per_step(ctx.dcfg, batch, keys)
    out: dict[str, Any] = {"mean_keys": keys, "weight_bytes_per_step": wb, "kv_bytes_per_step": kvb,
                           "bytes_per_step": wb + kvb}
    if ctx.bw:
        out["step_floor_ms"] = (wb + kvb) / ctx.bw * 1e3
        out["decode_roofline_tok_s"] = batch / ((wb + kvb) / ctx.bw)
    p = min(context, ctx.max_prefill)
    fl = flops_prefill(ctx.dcfg, batch, p)
    out["prefill_len"] = p
    out["prefill_flops"] = fl
    if ctx.bw and ctx.gemm:
        out["prefill_floor_ms"] = max(fl / ctx.gemm, weight_bytes_per_step(ctx.dcfg, batch * p) / ctx.bw) * 1e3
    return out


def write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)
