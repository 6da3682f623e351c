"""fusec generation vs PyTorch peers: Qwen3-0.6B-shaped decode and prefill, one process, same weights.

    python benchmarks/decode.py OUT.json            # batch 1, 8, 32 x context 128, 4096
    python benchmarks/decode.py OUT.json --quick    # batch 1, context 128, fewer repeats
    python benchmarks/decode.py OUT.json --contexts 4096 --batches 8,32 --full   # a part, every extra
    python benchmarks/decode.py OUT.json --cpu-check   # tiny model on the CPU: checks the plumbing

Setup. A ``transformers`` Qwen3ForCausalLM with fusec's ``qwen3-0.6b`` dims (tied embeddings,
random weights after ``torch.manual_seed(0)``) is cast to bf16 and saved with ``save_pretrained``
(bf16 safetensors) in a temporary directory; fusec compiles its plans from that checkpoint and
the torch peer copies the HF model's state_dict, so every engine runs bit-identical bf16 weights.
The copy bandwidth (a 1 GiB device-to-device torch copy, bytes read + written) and a bf16
8192^3 GEMM rate are measured first, in the same run: the ceilings of the rooflines.

Engines, per workload (batch B, context C; N = 128 new tokens; T = C + N cache positions):

* **fusec**: ``compile_generation(model, batch=B, max_seq_len=C+N, prefill_len=P, dtype="bf16",
  eos_ids=())`` with P = min(C, 1024). By default a helper process (CPU only) compiles every
  plan of the run ahead, in workload order, and saves it as an .fplan; this process loads it
  (``fusec.load``) when the workload starts (``--compile-inline``: compile here instead).
  ``compile_s`` is the helper's compile time. One ``plan.generate`` of N tokens is recorded as it
  reports itself (``generate``: prefill_ms, decode_tok_s, stats), then the timings below run on
  the plan's ``PlanEngine`` (prefill entry; decode = one CUDA-graph replay per step).
* **torch** (the compiled peer): benchmarks/torch_decoder.py, gpt-fast style with a static
  [B, Hkv, T, D] cache; the decode step compiled with ``torch.compile(mode="reduce-overhead",
  fullgraph=True, dynamic=False)`` (CUDA graphs), inductor coordinate-descent tuning as gpt-fast
  sets it (``--cdt``: at batch 1 only by default, for compile time); prefill eager, and at batch 1
  (``--compiled-prefill``) also compiled the same way.
* **HF** (``--hf``: batch 1 only by default): ``model.generate(..., do_sample=False,
  cache_implementation="static")`` as transformers does it on CUDA: it compiles the decode
  forward itself (mode "reduce-overhead") when the cache is static; ``--hf-eager`` passes
  ``disable_compile=True``.

Numbers:

* **decode tok/s** = B x timed steps / CUDA-event time of those steps (median over windows).
  A window is N - 1 = 127 consecutive greedy decode steps that start with C tokens in the cache:
  the step feeding position p attends over p + 1 keys (C+1 .. C+N-1; mean C + N/2). fusec and
  torch put two events around the window; HF records an event at each logits-processor call of
  one ``generate(max_new_tokens=N)`` and times steps 2 .. N-1 (N - 2 steps; left out: the first
  decode step of a call, where a compiled static-cache call may re-record its CUDA graph for the
  call's new cache). Reaching context C: fusec prefills P tokens, then runs C - P untimed decode
  steps (context 4096: a 1024-token prompt + 3072 steps); torch and HF prefill a C-token prompt,
  which for C > 1024 is fusec's context itself (its prompt + its own greedy continuation), so
  their tokens can be compared with fusec's. Later windows reset the position to C and decode
  the same positions again (same bytes read; only the cache contents differ).
* **prefill ms** = CUDA-event time of one prefill of P tokens per row from an empty cache (P = 128
  for context 128, 1024 for context 4096), median of repeats. fusec: the prefill entry
  (``PlanEngine.last_prefill_ms``, including the H2D copy of the B x P ids); torch: prefill
  (causal SDPA over the prompt, cache write, last-position logits, argmax), eager / compiled;
  HF: ``model(input_ids, logits_to_keep=1, use_cache=False)``, eager.
* **roofline tok/s** = B / ((weight bytes + KV bytes) per step / copy bandwidth). Weight bytes:
  every parameter once in bf16 (the tied LM head reads the embedding table once; the embedding
  lookup reads only B rows): 1.19 GB. KV bytes: 28 layers x (K and V) x B x 8 kv heads x 128 x
  2 bytes x mean keys attended (C + N/2). ``% roof`` = tok/s / roofline; ``x torch`` = tok/s /
  the torch peer's tok/s (same workload). The torch peer reads the whole T-key cache each step
  (masked, as gpt-fast does); the roofline counts only the keys attended.
* **prefill floor** = max(FLOPs / measured GEMM rate, weight bytes / copy bandwidth); FLOPs =
  2 x B x P x layer matmul parameters + causal attention (2 x 2 x B x 16 x 128 x P(P+1)/2 per
  layer) + the LM head at one position per row.
* **agreement**: greedy tokens of each pair of engines from the same context, as the common
  prefix length out of N (min and mean over rows; bf16 on random weights can diverge after a
  few tokens where two logits nearly tie). Batch-1 context 128 also compares the first step's
  logits (last prompt position): torch vs HF in bf16, and both vs HF in fp32 (the checkpoint
  upcast); fusec exposes tokens only, so its first token is compared with the fp32 argmax. Where
  fusec's and torch's rows part (up to 8 rows), the first differing step of each: the fp32
  reference's and the bf16 HF model's logits after the prompt and the tokens both chose, and
  whether the two choices are the fp32 top two with a gap no larger than bf16's own logit error
  there (a near-tie within bf16 rounding; ``decode_report.first_divergences``).

fusec's driver counters (CUPTI) attach to the whole process and make every CUDA API call a
little slower, peers included; so they are off (FUSEC_CUPTI=0) while anything is timed, and a
last pass loads the context-128 plans again with the counters on and records one ``generate``
each (``counters``: syncs, allocations, copies and launches per decode step).

Robustness: each stage runs in try/except (the error is recorded, the run goes on); GPU memory
is freed after each stage and workload (torch and CuPy pools, dynamo reset). ``--budget-s``
(default 480) starts no stage after that many seconds: a default run may not fit in one call
of 10 minutes; what was skipped says so, and the rest can be run with ``--batches`` /
``--contexts``. The JSON is rewritten after every workload; the table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_common import T0, Ctx, build_hf, log, measure_copy_bw, measure_gemm, rooflines, write_json  # noqa: E402
from decode_fusec import PlanWorker, compile_worker, run_fusec  # noqa: E402
from decode_peers import policy, run_hf, run_torch  # noqa: E402
from decode_report import agreement, print_table  # noqa: E402
from fusec.runtime.generation import generate_with_plan  # noqa: E402

# ---------------------------------------------------------------------------------------------


def cleanup(ctx: Ctx) -> None:
    torch = ctx.torch
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()
    if ctx.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        except Exception:  # noqa: BLE001
            pass


def run_workload(ctx: Ctx, batch: int, context: int) -> dict[str, Any]:
    res: dict[str, Any] = {"batch": batch, "context": context, "new_tokens": ctx.new_tokens,
                           "prefill_len": min(context, ctx.max_prefill), "max_seq_len": context + ctx.new_tokens}
    res["roofline"] = rooflines(ctx, batch, context)
    rng = np.random.default_rng([batch, context])
    prompt = rng.integers(0, ctx.dcfg.vocab_size, size=(batch, context), dtype=np.int64)
    eng: dict[str, dict[str, Any]] = {}
    res["engines"] = eng
    # the fusec stage first when the peers continue fusec's context (context > longest prefill);
    # else the torch peer first, while the helper process may still be compiling this plan
    stages = [("fusec", run_fusec), ("torch", run_torch)]
    if context <= ctx.max_prefill:
        stages.reverse()
    if policy(ctx.args.hf, batch):
        stages.append(("hf", run_hf))
    same_prompt = context <= ctx.max_prefill  # else the peers use fusec's context when it has one
    for name, fn in stages:
        if name != "fusec" and "_context_ids" in eng.get("fusec", {}):
            prompt = eng["fusec"].pop("_context_ids")
            same_prompt = True
            res["peer_prompt"] = "fusec's context: its prompt + its own greedy continuation"
        if ctx.left() <= 0:
            eng[name] = {"skipped": f"time budget ({ctx.budget:.0f} s) spent"}
            log(f"  {name}: skipped (time budget)")
            continue
        eng[name] = {}
        t0 = time.perf_counter()
        try:
            fn(ctx, batch, context, prompt, eng[name])
        except Exception as e:  # noqa: BLE001 -- record and go on
            traceback.print_exc()
            eng[name]["error"] = f"{type(e).__name__}: {e}"[:2000]
            log(f"  {name}: ERROR {eng[name]['error'][:200]}")
        eng[name]["stage_s"] = time.perf_counter() - t0
        if "decode_tok_s" in eng[name]:
            log(f"  {name}: decode {eng[name]['decode_tok_s']:.0f} tok/s, stage {eng[name]['stage_s']:.1f} s")
        if ctx.cuda:  # free what the stage left in the allocators' pools before the next one
            gc.collect()
            ctx.torch.cuda.empty_cache()
            try:
                import cupy

                cupy.get_default_memory_pool().free_all_blocks()
            except Exception:  # noqa: BLE001
                pass
    eng.get("fusec", {}).pop("_context_ids", None)
    try:
        res["agreement"] = agreement(ctx, batch, context, prompt, eng, same_prompt)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["agreement"] = {"error": f"{type(e).__name__}: {e}"}
    a = res["agreement"]
    log("  agreement: " + ", ".join(f"{k} {v['common_prefix_min']}/{ctx.new_tokens}" for k, v in a.items()
                                   if isinstance(v, dict) and "common_prefix_min" in v)
        + (f"; logits torch vs HF norm rel {a['logits_torch_vs_hf']['norm_rel']:.2g}" if "logits_torch_vs_hf" in a
           else ""))
    roof = res["roofline"].get("decode_roofline_tok_s")
    peer = eng.get("torch", {}).get("decode_tok_s")
    for e in eng.values():
        tok = e.get("decode_tok_s")
        if tok and roof:
            e["fraction_of_roofline"] = tok / roof
        if tok and peer:
            e["ratio_to_compiled_peer"] = tok / peer
    return res


def counters_pass(ctx: Ctx) -> dict[str, Any]:
    """Driver counters of one generate per kept context-128 plan, CUPTI attached only now."""
    if not ctx.kept_plans:
        return {"skipped": "no context-128 plan"}
    os.environ["FUSEC_CUPTI"] = "1"
    from fusec.plan import Plan
    from fusec.runtime import counters as C

    C._reset_for_tests()  # the timed part ran with the counters off (FUSEC_CUPTI=0); attach them now
    out: dict[str, Any] = {}
    kept = sorted(ctx.kept_plans.items())
    if ctx.left() <= 0:
        kept = kept[:1]
        out["note"] = "time budget spent: the smallest batch only"
    for batch, (manifest, blobs) in kept:
        try:
            plan = Plan(manifest, blobs, cuda_graph=True)
            rng = np.random.default_rng([batch, 7])
            p = int(manifest["generation"]["prefill_len"])
            rows = rng.integers(0, ctx.dcfg.vocab_size, size=(batch, p)).tolist()
            gen = generate_with_plan(plan, rows, max_new_tokens=ctx.new_tokens, seed=0)
            out[str(batch)] = {"decode": gen.stats.get("decode"), "prefill": gen.stats.get("prefill"),
                               "decode_tok_s_with_cupti": gen.decode_tok_s}
            plan._engine = None
            del plan
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[str(batch)] = {"error": f"{type(e).__name__}: {e}"}
        cleanup(ctx)
    return out


def versions(ctx: Ctx) -> dict[str, Any]:
    v: dict[str, Any] = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "cupy", "numpy", "triton", "fusec", "safetensors"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"unavailable ({type(e).__name__})"
    torch = ctx.torch
    v["torch_cuda"] = torch.version.cuda
    if ctx.cuda:
        try:
            import cupy

            v["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
            v["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        except Exception:  # noqa: BLE001
            pass
    try:
        import subprocess

        # "-dirty" when the tree differs from that commit (a device's copy of a working tree carries an
        # older checkout's history: its HEAD alone would name the wrong code)
        v["fusec_git"] = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                                        text=True, cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return v


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where to write the JSON results")
    ap.add_argument("--quick", action="store_true", help="batch 1, context 128 only, fewer repeats")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    ap.add_argument("--contexts", default=None, help="comma-separated contexts (default 128,4096)")
    ap.add_argument("--new-tokens", type=int, default=128, help="N: new tokens per window (default 128)")
    ap.add_argument("--max-prefill", type=int, default=1024, help="longest fusec prefill (default 1024)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no stage after this many seconds (480)")
    lvl = ("b1", "all", "none")
    ap.add_argument("--hf", choices=lvl, default="b1",
                    help="run transformers' generate at batch 1 only (default), at every batch, or never")
    ap.add_argument("--hf-eager", action="store_true", help="generate(disable_compile=True)")
    ap.add_argument("--cdt", choices=lvl, default="b1",
                    help="torch peer decode: inductor coordinate-descent tuning (gpt-fast sets it) at batch 1 "
                         "only (default: it costs compile time), every batch, or never")
    ap.add_argument("--compiled-prefill", choices=lvl, default="b1",
                    help="torch peer: also time a compiled prefill at batch 1 only (default), every batch, or never")
    ap.add_argument("--full", action="store_true", help="--hf all --cdt all --compiled-prefill all")
    ap.add_argument("--peer-eager", action="store_true", help="torch peer: no torch.compile at all")
    ap.add_argument("--compile-inline", action="store_true",
                    help="compile fusec plans in this process, each when its workload starts (default: a helper "
                         "process compiles them all ahead, in workload order, while this one works)")
    ap.add_argument("--compile-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 logits reference (batch 1: the "
                    "first token against its argmax; rows where fusec and torch diverge: whether their first "
                    "differing tokens are a near-tie within bf16 rounding)")
    ap.add_argument("--no-counters", action="store_true", help="skip the CUPTI counters pass")
    ap.add_argument("--cpu-check", action="store_true",
                    help="tiny Qwen3 on the CPU in fp32, fusec's numpy reference backend: checks the plumbing")
    a = ap.parse_args(argv)
    if a.full:
        a.hf = a.cdt = a.compiled_prefill = "all"
    if a.cpu_check:
        a.batches = a.batches or "1,2"
        a.contexts = a.contexts or "8,24"
        a.new_tokens = min(a.new_tokens, 8)
        a.max_prefill = min(a.max_prefill, 16)
    elif a.quick:
        a.batches = a.batches or "1"
        a.contexts = a.contexts or "128"
    a.batches = [int(x) for x in (a.batches or "1,8,32").split(",")]
    a.contexts = [int(x) for x in (a.contexts or "128,4096").split(",")]
    a.prefill_reps = 5 if (a.quick or a.cpu_check) else 10
    a.decode_reps = 3 if (a.quick or a.cpu_check) else 5
    a.hf_reps = 2 if (a.quick or a.cpu_check) else 3
    if a.budget_s is None:
        a.budget_s = 480.0
    if a.new_tokens < 3:
        ap.error("--new-tokens must be at least 3")
    return a


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compile-worker"]:
        return compile_worker(argv[1])
    args = parse_args(argv)
    # fusec's CUPTI counters slow every CUDA API call of the process: off while timing (see above)
    os.environ["FUSEC_CUPTI"] = "0"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    doc: dict[str, Any] = {"command": " ".join(["python", "benchmarks/decode.py"] + argv), "workloads": [],
                           "options": {k: v for k, v in vars(args).items() if k != "out"}}
    if not args.cpu_check and not torch.cuda.is_available():
        print("decode.py: no CUDA GPU here (torch.cuda.is_available() is False); "
              "use --cpu-check to check the plumbing on the CPU", file=sys.stderr)
        return 1
    ctx = Ctx(args)
    torch.set_grad_enabled(False)
    if args.cpu_check:
        torch.set_num_threads(1)  # small matrices: more threads only contend
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    doc["device"] = torch.cuda.get_device_name() if ctx.cuda else f"cpu ({platform.processor() or platform.machine()})"
    doc["versions"] = versions(ctx)
    log(f"device {doc['device']}; versions {doc['versions']}")
    doc["copy_bandwidth"] = measure_copy_bw(ctx)
    ctx.bw = doc["copy_bandwidth"]["bytes_per_s"]
    doc["gemm"] = measure_gemm(ctx)
    ctx.gemm = doc["gemm"]["flop_per_s"]
    log(f"copy {doc['copy_bandwidth']['tb_per_s']:.2f} TB/s, GEMM {doc['gemm']['tflop_per_s']:.0f} TFLOP/s")
    with tempfile.TemporaryDirectory(prefix="fusec-decode-") as tmp:
        try:
            build_hf(ctx, tmp)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            doc["error"] = f"building the model: {type(e).__name__}: {e}"
            write_json(args.out, doc)
            print_table(doc)
            return 1
        doc["model"] = {"config": ctx.dcfg.__dict__, "params": ctx.dcfg.num_params(),
                        "params_hf": sum(p.numel() for p in ctx.hf.parameters()),
                        "dtype": str(ctx.tdtype)}
        order = [(b, c) for c in args.contexts for b in args.batches]
        try:
            if ctx.cuda and not args.compile_inline:
                from fusec.device import gpu_arch

                jobs = [(b, c + args.new_tokens, min(c, args.max_prefill)) for b, c in order]
                ctx.worker = PlanWorker(ctx, jobs, tmp, gpu_arch() or "sm_90", ctx.model_name)
                log(f"compile helper started (pid {ctx.worker.proc.pid}) on {len(jobs)} plans")
            for b, c in order:
                if ctx.left() <= 0:
                    doc["workloads"].append({"batch": b, "context": c, "prefill_len": min(c, args.max_prefill),
                                             "engines": {}, "skipped": f"time budget ({args.budget_s:.0f} s) spent"})
                    log(f"workload B={b} ctx={c}: skipped (time budget)")
                    continue
                log(f"workload B={b} ctx={c}")
                try:
                    w = run_workload(ctx, b, c)
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    w = {"batch": b, "context": c, "prefill_len": min(c, args.max_prefill), "engines": {},
                         "error": f"{type(e).__name__}: {e}"}
                doc["workloads"].append(w)
                cleanup(ctx)
                if ctx.cuda:
                    doc.setdefault("memory_after_workload_gib", []).append(
                        [b, c, torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30])
                doc["elapsed_s"] = time.perf_counter() - T0
                write_json(args.out, doc)
        finally:
            if ctx.worker is not None:
                ctx.worker.close()
                doc["compile_helper_log_tail"] = ctx.worker.log_tail()
                ctx.worker = None
        if ctx.cuda and not args.no_counters:
            log("counters pass (CUPTI attached now)")
            try:
                doc["counters"] = counters_pass(ctx)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                doc["counters"] = {"error": f"{type(e).__name__}: {e}"}
    doc["elapsed_s"] = time.perf_counter() - T0
    write_json(args.out, doc)
    print_table(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
