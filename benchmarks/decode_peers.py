"""The decode benchmark's PyTorch peers (benchmarks/decode.py describes the benchmark): the torch
peer (``run_torch``, benchmarks/torch_decoder.py compiled gpt-fast style) and transformers'
``generate`` (``run_hf``), with ``policy`` for the extras that run at batch 1 only by default."""

from __future__ import annotations

import time
import traceback
from typing import Any

import numpy as np
from decode_common import Ctx, log, med


def policy(which: str, batch: int) -> bool:
    """An extra that runs at every batch ("all"), at batch 1 only ("b1") or never ("none")."""
    return which == "all" or (which == "b1" and batch == 1)


def run_torch(ctx: Ctx, batch: int, context: int, prompt: np.ndarray, out: dict[str, Any]) -> None:
    torch = ctx.torch
    import torch_decoder as td

    n, p = ctx.new_tokens, min(context, ctx.max_prefill)
    t_max = context + n
    dec = td.from_hf(ctx.hf, ctx.tdtype, ctx.dev)
    dec.setup_caches(batch, t_max)
    for blk in dec.layers:
        torch._dynamo.mark_static_address(blk.attention.kv_cache.k_cache)
        torch._dynamo.mark_static_address(blk.attention.kv_cache.v_cache)
    ids_p = torch.from_numpy(np.ascontiguousarray(prompt[:, :p])).to(ctx.dev)
    ids_c = torch.from_numpy(np.ascontiguousarray(prompt)).to(ctx.dev)
    pos_p = torch.arange(p, device=ctx.dev)
    pos_c = torch.arange(context, device=ctx.dev)
    compile_on = not ctx.args.peer_eager
    skips_before = _cudagraph_skips()
    try:
        with torch.no_grad():
            # prefill, eager
            for _ in range(2):
                td.prefill_tokens(dec, ids_p, pos_p)
            ctx.sync()
            ms = [ctx.timed(lambda: td.prefill_tokens(dec, ids_p, pos_p))[0] for _ in range(ctx.args.prefill_reps)]
            out["prefill_eager_ms"] = med(ms)
            # prefill, compiled (reduce-overhead, static shapes)
            want_pf = compile_on and policy(ctx.args.compiled_prefill, batch)
            if want_pf and ctx.left() > 0:
                pf = torch.compile(td.prefill_tokens, mode="reduce-overhead", fullgraph=True, dynamic=False)
                t0 = time.perf_counter()
                for _ in range(3):  # compile, warm-up, record the CUDA graph
                    pf(dec, ids_p, pos_p)
                ctx.sync()
                out["prefill_compile_s"] = time.perf_counter() - t0
                ms = [ctx.timed(lambda: pf(dec, ids_p, pos_p))[0] for _ in range(ctx.args.prefill_reps)]
                out["prefill_compiled_ms"] = med(ms)
                log(f"  torch: compiled prefill in {out['prefill_compile_s']:.1f} s")
                del pf
            elif want_pf:
                out["prefill_compiled_skipped"] = "time budget"
            else:
                out["prefill_compiled_skipped"] = f"--compiled-prefill {ctx.args.compiled_prefill}"

            # the context: one prefill of the C-token prompt (first new token; first-step logits)
            first, logits = td.prefill_tokens(dec, ids_c, pos_c)
            if context <= ctx.max_prefill:
                out["_first_logits"] = logits.float().cpu()

            step = td.decode_one_token
            if compile_on:
                step = torch.compile(td.decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)
            input_pos = torch.tensor([context], device=ctx.dev, dtype=torch.int64)

            def window(steps: int) -> tuple[float, list[Any]]:
                toks: list[Any] = []

                def run() -> None:
                    cur = first
                    for _ in range(steps):
                        nxt = step(dec, cur, input_pos)
                        input_pos.add_(1)
                        toks.append(nxt.clone())  # a CUDA-graph output is overwritten by the next replay
                        cur = toks[-1]

                input_pos.fill_(context)
                ms, _ = ctx.timed(run)
                return ms, toks

            t0 = time.perf_counter()
            cdt = bool(compile_on and policy(ctx.args.cdt, batch))
            if compile_on:
                import torch._inductor.config as icfg

                with icfg.patch(coordinate_descent_tuning=cdt):
                    window(3)  # compile, warm-up, record
            else:
                window(3)
            ctx.sync()
            out["decode_compile_s"] = time.perf_counter() - t0
            out["coordinate_descent_tuning"] = cdt
            log(f"  torch: decode step compiled in {out['decode_compile_s']:.1f} s (cdt={cdt})")
            # the cache still holds the C-token prompt (the warm-up wrote positions C .. C+2 only)
            wins = []
            tokens = None
            for w in range(ctx.args.decode_reps):
                ms, toks = window(n - 1)
                wins.append(ms)
                if w == 0:
                    tokens = torch.cat([first] + toks, dim=1).cpu().tolist()
            out["decode_window_ms"] = wins
            out["decode_steps"] = n - 1
            out["decode_tok_s"] = batch * (n - 1) / (med(wins) / 1e3)
            out["tokens"] = tokens
            out["cudagraph_skips"] = _cudagraph_skips() - skips_before
            out["cache_keys_read_per_step"] = t_max  # gpt-fast style: the whole static cache, masked
    finally:
        dec = None  # free the peer (the closures above read it)


def _cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skip" in k))
    except Exception:  # noqa: BLE001
        return -1


def run_hf(ctx: Ctx, batch: int, context: int, prompt: np.ndarray, out: dict[str, Any]) -> None:
    torch = ctx.torch
    from transformers import LogitsProcessor, LogitsProcessorList

    hf = ctx.hf
    n, p = ctx.new_tokens, min(context, ctx.max_prefill)
    for attr in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length", "_cache"):
        if attr in hf.__dict__:
            try:
                delattr(hf, attr)
            except AttributeError:
                pass

    cuda = ctx.cuda

    class StepEvents(LogitsProcessor):
        """Records when each step's logits are ready (called once per new token)."""

        def __init__(self) -> None:
            self.marks: list[Any] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.marks.append(e)
            else:
                self.marks.append(time.perf_counter())
            return scores

    ids_p = torch.from_numpy(np.ascontiguousarray(prompt[:, :p])).to(ctx.dev)
    ids_c = torch.from_numpy(np.ascontiguousarray(prompt)).to(ctx.dev)
    mask_c = torch.ones_like(ids_c)
    with torch.no_grad():
        for _ in range(2):
            hf(input_ids=ids_p, logits_to_keep=1, use_cache=False)
        ctx.sync()
        ms = [ctx.timed(lambda: hf(input_ids=ids_p, logits_to_keep=1, use_cache=False))[0]
              for _ in range(ctx.args.prefill_reps)]
        out["prefill_eager_ms"] = med(ms)
        if context <= ctx.max_prefill:
            logits = hf(input_ids=ids_c, logits_to_keep=1, use_cache=False).logits[:, -1]
            out["_first_logits"] = logits.float().cpu()

        kwargs: dict[str, Any] = dict(attention_mask=mask_c, max_new_tokens=n, do_sample=False,
                                      cache_implementation="static", pad_token_id=0)
        if ctx.args.hf_eager:
            kwargs["disable_compile"] = True

        def gen() -> tuple[Any, StepEvents]:
            marks = StepEvents()
            o = hf.generate(ids_c, logits_processor=LogitsProcessorList([marks]), **kwargs)
            ctx.sync()
            return o, marks

        t0 = time.perf_counter()
        try:
            o, _ = gen()
        except Exception as e:  # noqa: BLE001 -- transformers' own compile failed: fall back to eager
            if ctx.args.hf_eager:
                raise
            traceback.print_exc()
            out["compile_error"] = f"{type(e).__name__}: {e}"[:1000]
            log(f"  hf: generate with transformers' compile failed ({out['compile_error'][:120]}); eager instead")
            kwargs["disable_compile"] = True
            torch._dynamo.reset()
            t0 = time.perf_counter()
            o, _ = gen()
        out["first_call_s"] = time.perf_counter() - t0  # prefill + (auto-)compile + N tokens
        out["compiled"] = bool(getattr(hf, "_compiled_call", None) is not None and "compile_error" not in out)
        log(f"  hf: first generate (compile={out['compiled']}) in {out['first_call_s']:.1f} s")
        out["tokens"] = o[:, context:].cpu().tolist()
        wins = []
        for _ in range(ctx.args.hf_reps):
            o, marks = gen()
            m = marks.marks  # one per new token: after the prefill, then after each decode step
            if len(m) < 3:
                raise RuntimeError(f"hf: {len(m)} logits-processor calls for {n} new tokens")
            wins.append(m[1].elapsed_time(m[-1]) if cuda else (m[-1] - m[1]) * 1e3)
        out["logits_processor_calls"] = len(m)
        out["decode_window_ms"] = wins
        out["decode_steps"] = len(m) - 2
        out["decode_tok_s"] = batch * (len(m) - 2) / (med(wins) / 1e3)
        out["cache_implementation"] = "static"
