"""The decode benchmark's results (benchmarks/decode.py describes the benchmark): the agreement
between engines (greedy tokens, first-step logits) and the table printed at the end."""

from __future__ import annotations

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


def agreement(ctx: Ctx, batch: int, context: int, prompt: np.ndarray, eng: dict[str, dict[str, Any]],
              same_prompt: bool) -> dict[str, Any]:
    torch = ctx.torch
    out: dict[str, Any] = {"new_tokens": ctx.new_tokens}
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
            import transformers as T

            # the saved checkpoint in fp32 (bf16 values upcast exactly); not a deepcopy of the model,
            # which by now may carry transformers' compiled __call__
            ref = T.Qwen3ForCausalLM.from_pretrained(ctx.ckpt).float().to(ctx.dev).eval()
            ids = torch.from_numpy(np.ascontiguousarray(prompt)).to(ctx.dev)
            with torch.no_grad():
                r = ref(input_ids=ids, logits_to_keep=1, use_cache=False).logits[:, -1].float().cpu()
            del ref
            top2 = r.topk(2, dim=-1).values
            out["logits_vs_hf_fp32"] = {"torch_bf16_norm_rel": float((la - r).norm() / r.norm()),
                                        "hf_bf16_norm_rel": float((lb - r).norm() / r.norm()),
                                        "fp32_top1_minus_top2": float((top2[:, 0] - top2[:, 1]).min()),
                                        "fp32_argmax": r.argmax(-1).tolist()}
            firsts = {k: [t[0] for t in eng[k]["tokens"]] for k in names}
            out["first_token"] = firsts
            out["first_token_equals_fp32_argmax"] = {k: v == r.argmax(-1).tolist() for k, v in firsts.items()}
    return out


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
        if a.get("error"):
            parts.append("ERROR " + a["error"][:100])
        if parts:
            print(f"  B={w['batch']} ctx={w['context']}: " + "; ".join(parts))
    if doc.get("error"):
        print("ERROR:", doc["error"][:300])
