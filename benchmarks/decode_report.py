"""The decode benchmark's results (benchmarks/decode.py describes the benchmark): the agreement
between engines (greedy tokens, first-step logits) and the table printed at the end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from decode_common import Ctx


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


MAX_DIVERGENT_ROWS = 8  # rows a pair of engines diverged on whose first differing step is examined


def bf16_spacing(x: float) -> float:
    """The distance between adjacent bf16 values at |x| (8 significant bits)."""
    return float(2.0 ** (np.floor(np.log2(max(abs(x), 2.0 ** -126))) - 7))


def first_divergences(prompt: np.ndarray, a: list[list[int]], b: list[list[int]],
                      logits_at: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]) -> list[dict[str, Any]]:
    """For each row where two engines' greedy tokens ``a`` and ``b`` differ (at most ``MAX_DIVERGENT_ROWS``), the
    first differing step k: ``logits_at(ids)`` gives the fp32 reference's and a bf16 model's logits [V] after the row's
    prompt and the k tokens both engines chose. Whether the two choices are a near-tie within bf16 rounding: the fp32
    gap between them is at most what bf16 already errs by at that position (the bf16 model's largest logit error over
    the vocabulary), and the two tokens are the fp32 reference's top two."""
    out: list[dict[str, Any]] = []
    for row, (ta, tb) in enumerate(zip(a, b)):
        k = common_prefix(ta, tb)
        if k >= min(len(ta), len(tb)):
            continue
        ids = np.concatenate([np.asarray(prompt[row], dtype=np.int64), np.asarray(ta[:k], dtype=np.int64)])
        l32, l16 = (np.asarray(x, dtype=np.float64) for x in logits_at(ids))
        x, y = int(ta[k]), int(tb[k])
        gap = float(l32[x] - l32[y])
        err = float(np.abs(l16 - l32).max())
        ranks = [int((l32 > l32[t]).sum()) for t in (x, y)]
        out.append({"row": row, "step": k, "tokens": [x, y], "fp32_logits": [float(l32[x]), float(l32[y])],
                    "fp32_gap": gap, "fp32_ranks": ranks, "bf16_max_abs_error": err,
                    "bf16_spacing": bf16_spacing(max(abs(l32[x]), abs(l32[y]))),
                    "within_bf16_rounding": abs(gap) <= err and sorted(ranks) == [0, 1]})
        if len(out) == MAX_DIVERGENT_ROWS:
            break
    return out


def agreement(ctx: Ctx, batch: int, context: int, prompt: np.ndarray, eng: dict[str, dict[str, Any]],
              same_prompt: bool) -> dict[str, Any]:
    torch = ctx.torch
    out: dict[str, Any] = {"new_tokens": ctx.new_tokens}
    fp32: list[Any] = []

    def reference() -> Any:
        """The saved checkpoint in fp32 (bf16 values upcast exactly), loaded once for this workload's checks; not a
        deepcopy of the model, which by now may carry transformers' compiled __call__."""
        if not fp32:
            import transformers as T

            fp32.append(T.Qwen3ForCausalLM.from_pretrained(ctx.ckpt).float().to(ctx.dev).eval())
        return fp32[0]

    la, lb = eng.get("torch", {}).pop("_first_logits", None), eng.get("hf", {}).pop("_first_logits", None)
    names = [k for k in ("fusec", "torch", "hf") if isinstance(eng.get(k, {}).get("tokens"), list)]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if a == "fusec" and not same_prompt:  # torch and HF always get the same prompt
                continue
            pre = [common_prefix(x, y) for x, y in zip(eng[a]["tokens"], eng[b]["tokens"])]
            out[f"{a}~{b}"] = {"common_prefix_min": min(pre), "common_prefix_mean": float(np.mean(pre)),
                               "rows_equal_first16": int(sum(q >= min(16, ctx.new_tokens) for q in pre)),
                               "rows": len(pre)}
    if la is not None and lb is not None:
        d = (la - lb).abs()
        out["logits_torch_vs_hf"] = {"max_abs": float(d.max()), "max_abs_hf": float(lb.abs().max()),
                                     "max_rel": float(d.max() / lb.abs().max()),
                                     "norm_rel": float((la - lb).norm() / lb.norm()),
                                     "argmax_equal_rows": int((la.argmax(-1) == lb.argmax(-1)).sum())}
        if batch == 1 and context <= ctx.max_prefill and not ctx.args.no_fp32_check:
            ids = torch.from_numpy(np.ascontiguousarray(prompt)).to(ctx.dev)
            with torch.no_grad():
                r = reference()(input_ids=ids, logits_to_keep=1, use_cache=False).logits[:, -1].float().cpu()
            top2 = r.topk(2, dim=-1).values
            out["logits_vs_hf_fp32"] = {"torch_bf16_norm_rel": float((la - r).norm() / r.norm()),
                                        "hf_bf16_norm_rel": float((lb - r).norm() / r.norm()),
                                        "fp32_top1_minus_top2": float((top2[:, 0] - top2[:, 1]).min()),
                                        "fp32_argmax": r.argmax(-1).tolist()}
            firsts = {k: [t[0] for t in eng[k]["tokens"]] for k in names}
            out["first_token"] = firsts
            out["first_token_equals_fp32_argmax"] = {k: v == r.argmax(-1).tolist() for k, v in firsts.items()}
    pair = out.get("fusec~torch")
    if pair and pair["common_prefix_min"] < ctx.new_tokens and same_prompt and not ctx.args.no_fp32_check:
        pair["first_divergence"] = _divergences(ctx, reference(), prompt, eng["fusec"]["tokens"], eng["torch"]["tokens"])
    return out  # the fp32 model goes with this frame


def _divergences(ctx: Ctx, ref: Any, prompt: np.ndarray, a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """``first_divergences`` with ``ref`` (the checkpoint in fp32) as the reference and the bf16 HF model beside it."""
    torch = ctx.torch

    def logits_at(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = torch.from_numpy(ids[None]).to(ctx.dev)
        with torch.no_grad():
            return tuple(m(input_ids=x, logits_to_keep=1, use_cache=False).logits[0, -1].float().cpu().numpy()
                         for m in (ref, ctx.hf))

    rows = first_divergences(prompt, a, b, logits_at)
    return {"rows": rows, "within_bf16_rounding": sum(r["within_bf16_rounding"] for r in rows)}


def fmt(x: Any, spec: str) -> str:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, spec)
    width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
    return "-".rjust(int(width) if width else 1)


def print_table(doc: dict[str, Any]) -> None:
    bw = doc.get("copy_bandwidth", {}).get("tb_per_s")
    gemm = doc.get("gemm", {}).get("tflop_per_s")
    print()
    print(f"device: {doc.get('device')}   copy bandwidth {fmt(bw, '.2f')} TB/s (read + write)   "
          f"GEMM {fmt(gemm, '.0f')} TFLOP/s   elapsed {doc.get('elapsed_s', 0):.0f} s")
    print("decode tok/s (all rows; CUDA events over the timed window); roofline = B / ((weights + KV bytes "
          "per step) / copy bw)")
    print(f"{'B':>3} {'ctx':>5}  {'engine':<7}{'tok/s':>10}{'roof tok/s':>12}{'% roof':>8}{'x torch':>9}"
          f"{'compile s':>11}  note")
    names = {"fusec": "fusec", "torch": "torch", "hf": "HF"}
    for w in doc["workloads"]:
        roof = w.get("roofline", {}).get("decode_roofline_tok_s")
        engines = w.get("engines", {})
        if w.get("error") or w.get("skipped"):
            print(f"{w['batch']:>3} {w['context']:>5}  {str(w.get('error') or w.get('skipped'))[:100]}")
        for k in [k for k in names if k in engines]:
            e = engines[k]
            note = e.get("error") or e.get("skipped") or ""
            if k == "fusec":
                comp = e.get("compile_s")
                g = e.get("generate", {}).get("decode_tok_s")
                note = note or (f"generate() says {g:.0f} tok/s (host clock, from ctx {w['prefill_len']})"
                                if isinstance(g, float) else "")
            elif k == "torch":
                comp = e.get("decode_compile_s")
                note = note or (f"cdt {'on' if e.get('coordinate_descent_tuning') else 'off'}; cudagraph skips "
                                f"{e.get('cudagraph_skips')}; prefill compile {fmt(e.get('prefill_compile_s'), '.0f')} s")
            else:
                comp = e.get("first_call_s")
                note = note or ("compiled by transformers (compile s = first generate call)" if e.get("compiled")
                                else "eager" + (" (compile failed: see JSON)" if e.get("compile_error") else ""))
            tok = e.get("decode_tok_s")
            print(f"{w['batch']:>3} {w['context']:>5}  {names[k]:<7}{fmt(tok, '10.0f')}{fmt(roof, '12.0f')}"
                  f"{fmt(e.get('fraction_of_roofline', None) and 100 * e['fraction_of_roofline'], '8.1f')}"
                  f"{fmt(e.get('ratio_to_compiled_peer'), '9.2f')}{fmt(comp, '11.1f')}  {str(note)[:90]}")
    print("prefill ms (one prefill of P tokens per row, CUDA events, median); floor = max(FLOPs / GEMM rate, "
          "weight bytes / copy bw)")
    print(f"{'B':>3} {'P':>5}  {'fusec':>8}{'torch eager':>13}{'torch comp.':>13}{'HF eager':>10}{'floor':>8}"
          f"{'fusec/comp.':>13}{'fusec/eager':>13}")
    for w in doc["workloads"]:
        e = w.get("engines", {})
        f = e.get("fusec", {}).get("prefill_ms")
        te, tc = e.get("torch", {}).get("prefill_eager_ms"), e.get("torch", {}).get("prefill_compiled_ms")
        he = e.get("hf", {}).get("prefill_eager_ms")
        fl = w.get("roofline", {}).get("prefill_floor_ms")
        print(f"{w['batch']:>3} {w['prefill_len']:>5}  {fmt(f, '8.3f')}{fmt(te, '13.3f')}{fmt(tc, '13.3f')}"
              f"{fmt(he, '10.3f')}{fmt(fl, '8.3f')}{fmt(f / tc if f and tc else None, '13.2f')}"
              f"{fmt(f / te if f and te else None, '13.2f')}")
    print("agreement (greedy tokens from the same prompt; common prefix of N new tokens, min over rows)")
    for w in doc["workloads"]:
        a = w.get("agreement", {})
        parts = [f"{k} {v['common_prefix_min']}/{a.get('new_tokens')}" for k, v in a.items()
                 if isinstance(v, dict) and "common_prefix_min" in v]
        lg = a.get("logits_torch_vs_hf")
        if lg:
            parts.append(f"logits torch vs HF max abs {lg['max_abs']:.3g} (rel {lg['max_rel']:.2g}, "
                         f"norm rel {lg['norm_rel']:.2g})")
        f32 = a.get("logits_vs_hf_fp32")
        if f32:
            parts.append(f"vs fp32: torch {f32['torch_bf16_norm_rel']:.2g}, HF {f32['hf_bf16_norm_rel']:.2g}, "
                         f"fp32 top1-top2 {f32['fp32_top1_minus_top2']:.3g}")
        if a.get("first_token_equals_fp32_argmax"):
            parts.append("first token = fp32 argmax: " + ", ".join(
                f"{k} {v}" for k, v in a["first_token_equals_fp32_argmax"].items()))
        fd = a.get("fusec~torch", {}).get("first_divergence")
        if fd and fd["rows"]:
            parts.append(f"fusec~torch first differing tokens within bf16 rounding (fp32 top two, fp32 gap <= the bf16 "
                         f"model's logit error there): {fd['within_bf16_rounding']} of {len(fd['rows'])} rows; gaps "
                         + ", ".join(f"{r['fp32_gap']:.3g}/{r['bf16_max_abs_error']:.3g}" for r in fd["rows"]))
        if a.get("error"):
            parts.append("ERROR " + a["error"][:100])
        if parts:
            print(f"  B={w['batch']} ctx={w['context']}: " + "; ".join(parts))
    if doc.get("error"):
        print("ERROR:", doc["error"][:300])
