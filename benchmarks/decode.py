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
  upcast); fusec exposes tokens only, so its first token is compared with the fp32 argmax.

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
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

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
    del src, dst
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
    del a, b
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


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# fusec plans compiled ahead in a helper process


def compile_worker(spec_path: str) -> int:
    """The helper process: compile every plan of the spec in order, each to PATH (.fplan), then
    PATH.json ({"compile_s", "save_s"} or {"error"}), written atomically after the plan."""
    os.environ["FUSEC_CUPTI"] = "0"
    with open(spec_path) as f:
        spec = json.load(f)
    from fusec.genmodel import compile_generation, load_generation_model

    t0 = time.perf_counter()
    gm = load_generation_model(spec["model"], weights_dir=spec["ckpt"])
    print(f"helper: checkpoint loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    for job in spec["plans"]:
        info: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            plan = compile_generation(gm, batch=job["batch"], max_seq_len=job["max_seq_len"],
                                      prefill_len=job["prefill_len"], dtype="bf16", arch=spec["arch"], eos_ids=())
            info["compile_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            plan.save(job["path"])
            info["save_s"] = time.perf_counter() - t1
            del plan
        except Exception as e:  # noqa: BLE001 -- reported to the main process through the .json
            traceback.print_exc()
            info["error"] = f"{type(e).__name__}: {e}"[:2000]
        write_json(job["path"] + ".json", info)
        print(f"helper: {job} {info}", flush=True)
    return 0


class PlanWorker:
    """Starts the helper process on every plan the run will need, in workload order."""

    def __init__(self, ctx: Ctx, jobs: list[tuple[int, int, int]], tmpdir: str, arch: str, model: str):
        import subprocess

        self.dir = os.path.join(tmpdir, "plans")
        os.makedirs(self.dir, exist_ok=True)
        self.paths = {j: os.path.join(self.dir, f"plan-b{j[0]}-t{j[1]}-p{j[2]}.fplan") for j in jobs}
        spec = {"ckpt": ctx.ckpt, "model": model, "arch": arch,
                "plans": [{"batch": b, "max_seq_len": t, "prefill_len": p, "path": self.paths[(b, t, p)]}
                          for b, t, p in jobs]}
        spec_path = os.path.join(self.dir, "spec.json")
        write_json(spec_path, spec)
        self.log_path = os.path.join(self.dir, "helper.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, FUSEC_CUPTI="0")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--compile-worker", spec_path],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path) as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def get(self, batch: int, max_seq_len: int, prefill_len: int, timeout: float) -> tuple[Any, dict[str, Any]]:
        import fusec

        path = self.paths[(batch, max_seq_len, prefill_len)]
        t0 = time.perf_counter()
        while not os.path.exists(path + ".json"):
            if self.proc.poll() is not None and not os.path.exists(path + ".json"):
                raise RuntimeError(f"the compile helper exited with {self.proc.returncode} before this plan; "
                                   f"its log ends: {self.log_tail(1500)}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"no plan from the compile helper after {timeout:.0f} s")
            time.sleep(0.1)
        with open(path + ".json") as f:
            info = json.load(f)
        if "error" in info:
            raise RuntimeError(f"compile helper: {info['error']}")
        info["wait_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        plan = fusec.load(path, cuda_graph=True)
        info["load_s"] = time.perf_counter() - t1
        return plan, info

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self._log.close()


# ---------------------------------------------------------------------------------------------
# engines


def run_fusec(ctx: Ctx, batch: int, context: int, prompt: np.ndarray, out: dict[str, Any]) -> None:
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, compile_generation
    from fusec.models.generate import Sampling

    n, p = ctx.new_tokens, min(context, ctx.max_prefill)
    t_max, fill = context + n, context - p
    rows = prompt[:, :p].tolist()
    ids = np.ascontiguousarray(prompt[:, :p], dtype=np.int64)
    t0 = time.perf_counter()
    if ctx.cuda and ctx.worker is not None:  # compiled ahead by the helper process
        plan, info = ctx.worker.get(batch, t_max, p, timeout=max(ctx.left(), 0) + 300)
        out["compile_s"] = info["compile_s"]
        out["compiled_in"] = "helper process"
        out["plan_wait_s"] = info["wait_s"]
        out["plan_load_s"] = info["load_s"]
    elif ctx.cuda:
        plan = compile_generation(ctx.gm, batch=batch, max_seq_len=t_max, prefill_len=p, dtype="bf16", eos_ids=())
        out["compile_s"] = time.perf_counter() - t0
        out["compiled_in"] = "this process"
    else:  # the numpy reference backend runs the same graphs
        engine = ReferenceEngine(build_graphs(ctx.gm, batch, t_max, p, Sampling(), eos_ids=()))
        out["compile_s"] = time.perf_counter() - t0
        out["compiled_in"] = "graphs only (reference backend)"
    log(f"  fusec: plan compiled in {out['compile_s']:.1f} s ({out['compiled_in']}; prefill_len {p}, "
        f"max_seq_len {t_max}); ready after {time.perf_counter() - t0:.1f} s here")
    try:
        if ctx.cuda:
            out["plan"] = {k: plan.manifest["memory"].get(k) for k in ("weights_bytes", "state_bytes", "arena_bytes")}
            out["plan"]["launches"] = {e: len(v.get("launches", ())) for e, v in plan.manifest.get("entries", {}).items()}
        t0 = time.perf_counter()
        if ctx.cuda:
            gen = plan.generate(rows, max_new_tokens=n, seed=0)
            engine = plan._engine
        else:
            gen = generate(engine, rows, n, ctx.dcfg.vocab_size, seed=0)
        out["first_generate_s"] = time.perf_counter() - t0  # device setup, graph capture, N tokens
        out["generate"] = {"prefill_ms": gen.prefill_ms, "decode_tok_s": gen.decode_tok_s,
                           "decode_steps": gen.decode_steps, "decode_ms": gen.decode_ms,
                           "note": "plan.generate as it reports: prefill_ms by CUDA events, decode_tok_s by the "
                                   "host clock over all N-1 steps (from context P)"}
        out["stats"] = gen.stats
        out["tokens"] = [list(map(int, r)) for r in gen.new_ids]

        if ctx.cuda:
            import cupy

            ev = (cupy.cuda.Event(), cupy.cuda.Event())

            def window(steps: int) -> float:
                ev[0].record(engine.stream)
                for _ in range(steps):
                    engine.decode()
                ev[1].record(engine.stream)
                ev[1].synchronize()
                return float(cupy.cuda.get_elapsed_time(ev[0], ev[1]))

            def settle() -> None:  # set_state copies on the null stream; the engine runs on its own
                cupy.cuda.Device().synchronize()
        else:
            def window(steps: int) -> float:
                t = time.perf_counter()
                for _ in range(steps):
                    engine.decode()
                return (time.perf_counter() - t) * 1e3

            def settle() -> None:
                pass

        def start(length: int) -> None:
            engine.set_state("pos", np.full(batch, length, np.int64))
            engine.set_state("done", np.zeros(batch, bool))
            engine.set_state("seed", np.array([0], np.int64))
            settle()

        pre = []
        for _ in range(ctx.args.prefill_reps):
            start(p)
            if ctx.cuda:
                engine.prefill(ids)
                pre.append(engine.last_prefill_ms)
            else:
                pre.append(ctx.timed(lambda: engine.prefill(ids))[0])
        out["prefill_ms"] = med(pre)
        out["prefill_ms_all"] = pre

        start(p)
        engine.prefill(ids)
        t0 = time.perf_counter()
        if fill:
            window(fill)
        out["fill_steps"] = fill
        out["fill_s"] = time.perf_counter() - t0
        wins = []
        for w in range(ctx.args.decode_reps):
            if w:
                engine.set_state("pos", np.full(batch, context, np.int64))
                settle()
            wins.append(window(n - 1))
            if w == 0 and fill:
                # the context fusec built (prompt + its own continuation) and the window's N tokens:
                # the peers prefill exactly this context, and their tokens are compared with these
                toks = engine.read_state("tokens")
                out["_context_ids"] = np.concatenate([ids, toks[:, p:context]], axis=1).astype(np.int64)
                out["tokens"] = toks[:, context:context + n].tolist()
        pos = engine.read_state("pos")
        if not np.all(pos == context + n - 1):
            raise RuntimeError(f"fusec: after a window pos is {pos.tolist()}, expected {context + n - 1}")
        out["decode_window_ms"] = wins
        out["decode_steps"] = n - 1
        out["decode_tok_s"] = batch * (n - 1) / (med(wins) / 1e3)
        if ctx.cuda and context <= ctx.max_prefill:
            ctx.kept_plans[batch] = (plan.manifest, plan._blobs)
    finally:
        if ctx.cuda:
            plan._engine = None
            del plan
        engine = None


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
        del dec


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
            gen = plan.generate(rows, max_new_tokens=ctx.new_tokens, seed=0)
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

        v["fusec_git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return v


def write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


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
    ap.add_argument("--no-fp32-check", action="store_true", help="skip the fp32 logits reference")
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
