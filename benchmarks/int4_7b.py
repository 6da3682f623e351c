"""Issue 22's 7B int4 target on the GPU: a 7B-class Llama shape (32 layers, d 4096, ffn 11008, 32 heads, vocab
32,000; random weights) with fusec's own ``--quantize int4`` (round-to-nearest, group 128, the LM head packed too,
as gpt-fast quantizes every linear layer), decoding at batch 1, against its packed-weight roofline and against a
PyTorch int4 peer in the same process: benchmarks/torch_decoder.py's decoder with every linear layer in gpt-fast's
int4 form (``torch.ops.aten._weight_int4pack_mm``), its decode step compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)``.

    python benchmarks/int4_7b.py OUT_DIR [--layers 32] [--group 128] [--prompt 32] [--new 128] [--rounds 3]
                                         [--ab KNOB=VALUE[+KNOB=VALUE]]...

fusec's plan compiles in a helper process while the peer is built and compiled here. The two then decode in turns
(``--rounds``), each round 128 new tokens after the same-length prompt; the medians are reported. The roofline of each
is its own weight bytes a step (fusec: the plan's weights less the embedding table, of which a step reads one row;
the peer: its packed linear layers) at the copy bandwidth measured here. Writes OUT_DIR/int4_7b.json and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _config(layers: int) -> Any:
    from fusec.models.registry import get_config

    return dataclasses.replace(get_config("llama-tiny"), name="llama-7b-int4", num_layers=layers, hidden_size=4096,
                               intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
                               vocab_size=32000, tie_word_embeddings=False, max_positions=4096)


def compile_fusec(job: dict) -> dict:
    """In a helper process: the 7B int4 generation plan, saved to job["path"] (or the error)."""
    os.environ["FUSEC_CUPTI"] = "0"
    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    os.environ.update(job["env"])  # a variant's knobs (--ab), read as the plan compiles
    cfg = _config(job["layers"])
    t0 = time.perf_counter()
    try:
        plan = compile_generation(GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name), batch=1,
                                  max_seq_len=job["prompt"] + job["new"] + 16, prefill_len=job["prompt"],
                                  dtype="bf16", eos_ids=[], quantize="int4", quantize_group=job["group"],
                                  quantize_head=True)
        plan.save(job["path"])
        rep = plan.manifest["reports"]["decode"]
        return {"compile_s": time.perf_counter() - t0, "weights_bytes": plan.manifest["memory"]["weights_bytes"],
                "quantized": rep.get("quantized"), "launches": len(plan.manifest["entries"]["decode"]["launches"])}
    except Exception as e:  # noqa: BLE001 -- reported in the results
        return {"error": f"{type(e).__name__}: {e}"[:1000]}


def torch_peer(layers: int, group: int, prompt: int, new: int) -> tuple[Any, Any, dict]:
    """(decoder, step(n) -> ms of n greedy decode steps after the prompt, info) of the int4 peer."""
    import torch
    import torch_decoder as td

    f = _config(layers)  # the same shape as fusec's plan
    c = td.DecoderConfig(vocab_size=f.vocab_size, dim=f.hidden_size, n_layer=layers, n_head=f.num_heads,
                         n_kv_head=f.num_kv_heads, head_dim=f.head_dim, intermediate_size=f.intermediate_size,
                         norm_eps=f.norm_eps, rope_theta=f.rope_theta, tie_word_embeddings=f.tie_word_embeddings,
                         qk_norm=f.qk_norm)
    torch.manual_seed(0)
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            dec = td.Transformer(c)
        finally:
            torch.set_default_dtype(torch.float32)
    for p in dec.parameters():
        p.requires_grad_(False)
    # the int4 kernel's result against the same codes dequantized, on one weight (a wrong packing is O(1))
    w = dec.layers[0].feed_forward.w1.weight.detach()
    lin = td.Int4Linear(w, group)
    x = torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    info["int4_rel_err_vs_bf16"] = float((lin(x).float() - ref).abs().max() / ref.abs().max())
    td.quantize_int4(dec, group)
    dec = dec.eval()
    torch.cuda.empty_cache()
    info["weight_bytes"] = td.int4_weight_bytes(dec) + c.dim * 2 * (2 * layers + 1)  # + the norms (bf16)
    info["build_s"] = time.perf_counter() - t0
    dec.setup_caches(1, prompt + new + 16)
    for blk in dec.layers:
        torch._dynamo.mark_static_address(blk.attention.kv_cache.k_cache)
        torch._dynamo.mark_static_address(blk.attention.kv_cache.v_cache)
    ids = torch.randint(0, c.vocab_size, (1, prompt), device="cuda")
    pos = torch.arange(prompt, device="cuda")
    step = torch.compile(td.decode_one_token, mode="reduce-overhead", fullgraph=True, dynamic=False)
    input_pos = torch.tensor([prompt], device="cuda", dtype=torch.int64)

    def run(n: int) -> float:
        with torch.no_grad():
            first, _ = td.prefill_tokens(dec, ids, pos)
            input_pos.fill_(prompt)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cur = first
            s.record()
            for _ in range(n):
                cur = step(dec, cur, input_pos).clone()  # a CUDA-graph output is overwritten by the next replay
                input_pos.add_(1)
            e.record()
            e.synchronize()
            return s.elapsed_time(e)

    t0 = time.perf_counter()
    run(3)  # compile, warm up, record the graph
    info["decode_compile_s"] = time.perf_counter() - t0
    return dec, run, info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab", action="append", default=[], metavar="KNOB=VALUE[+KNOB=VALUE]",
                    help="also a plan compiled with these knobs (e.g. FUSEC_QGEMV_DP4A_CLUSTER=1), timed in turns with the "
                         "default and checked token for token; repeatable")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench_decode_kernels import copy_bw

    import fusec
    from fusec.runtime.generation import generate_with_plan

    res: dict[str, Any] = {"layers": args.layers, "group": args.group, "prompt": args.prompt, "new": args.new}
    variants = {"fusec": {}}
    for ab in args.ab:
        pairs = [kv.partition("=") for kv in ab.split("+")]
        if any(not k or not eq for k, eq, _ in pairs):
            ap.error(f"--ab {ab!r}: expected KNOB=VALUE[+KNOB=VALUE]")
        variants[f"fusec {ab}"] = {k: v for k, _, v in pairs}
    names = list(variants)
    jobs = {name: {"layers": args.layers, "group": args.group, "prompt": args.prompt, "new": args.new,
                   "path": str(out / f"7b-int4-{i}.fplan"), "env": variants[name]} for i, name in enumerate(names)}
    with ProcessPoolExecutor(max_workers=len(jobs), mp_context=multiprocessing.get_context("spawn")) as ex:
        futs = {name: ex.submit(compile_fusec, job) for name, job in jobs.items()}
        try:
            _, peer_run, res["torch"] = torch_peer(args.layers, args.group, args.prompt, args.new)
        except Exception as e:  # noqa: BLE001 -- the peer may not run on this torch/GPU: say so
            peer_run, res["torch"] = None, {"error": f"{type(e).__name__}: {e}"[:1000]}
        print("torch:", json.dumps(res["torch"]), flush=True)
        for name, fut in futs.items():
            res[name] = fut.result()
            print(f"{name}:", json.dumps(res[name]), flush=True)
    copy = copy_bw()
    res["copy_Bps"] = copy
    plans: dict[str, Any] = {}
    prompt = [list(range(1, args.prompt + 1))]
    for name in names:
        if "error" not in res[name]:
            plans[name] = fusec.load(jobs[name]["path"])
            cfg = _config(args.layers)  # less the embedding table (bf16), of which a step reads one row
            res[name]["step_bytes"] = res[name]["weights_bytes"] - (cfg.vocab_size - 1) * cfg.hidden_size * 2
            generate_with_plan(plans[name], prompt, max_new_tokens=8)  # upload, capture
    times: dict[str, list[float]] = {name: [] for name in names + ["torch"]}
    tokens: dict[str, list[int]] = {}
    for _ in range(args.rounds):  # in turns
        for name, plan in plans.items():
            gen = generate_with_plan(plan, prompt, max_new_tokens=args.new)
            times[name].append(gen.decode_ms / gen.decode_steps)
            tokens[name] = list(gen.new_ids[0])
        if peer_run is not None:
            times["torch"].append(peer_run(args.new - 1) / (args.new - 1))
    for name in names[1:]:
        if name in tokens and "fusec" in tokens:
            res[name]["same_tokens"] = tokens[name] == tokens["fusec"]
    for name, ms in times.items():
        if ms:
            m = statistics.median(ms)
            r = res[name]
            key = "weight_bytes" if name == "torch" else "step_bytes"
            r.update(step_ms=ms, step_ms_median=m, tok_s=1e3 / m, pct_roofline=100 * r[key] / copy / (m * 1e-3))
    if times["fusec"] and times["torch"]:
        res["fusec_over_torch_tok_s"] = statistics.median(times["torch"]) / statistics.median(times["fusec"])
    plans.clear()
    from decode_step import profile_mode

    for name in names:  # each plan's per-kernel profile (CUPTI) last: attached counters slow every later launch
        if "error" not in res[name]:
            try:
                res[name]["profile"], _ = profile_mode(jobs[name]["path"], True, 1)
            except Exception as e:  # noqa: BLE001 -- reported
                res[name]["profile"] = f"{type(e).__name__}: {e}"[:500]
    for job in jobs.values():
        if os.path.exists(job["path"]):
            os.unlink(job["path"])
    (out / "int4_7b.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
