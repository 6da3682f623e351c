"""The decode benchmark's fusec engine (benchmarks/decode.py describes the benchmark): the helper
process that compiles the run's plans ahead (``compile_worker``, launched as ``decode.py
--compile-worker SPEC``), ``PlanWorker`` that starts and reads it, and ``run_fusec``."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np
from decode_common import Ctx, log, med, write_json
from fusec.runtime.generation import generate_with_plan

# ---------------------------------------------------------------------------------------------
# fusec plans compiled ahead in a helper process


def compile_worker(spec_path: str) -> int:
    """The helper process: compile every plan of the spec in order, each to PATH (.fplan), then
    PATH.json ({"compile_s", "save_s"} or {"error"}), written atomically after the plan."""
    os.environ["FUSEC_CUPTI"] = "0"
    with open(spec_path) as f:
        spec = json.load(f)
    from fusec.genmodel import load_generation_model
    from fusec.compiler import compile_generation

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
        decode_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.py")  # its main() runs the helper
        self.proc = subprocess.Popen([sys.executable, decode_py, "--compile-worker", spec_path],
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
    from fusec.generation import ReferenceEngine, generate, write_sampling
    from fusec.genmodel import build_graphs
    from fusec.compiler import compile_generation
    from fusec.sampling import Sampling

    n, p = ctx.new_tokens, min(context, ctx.max_prefill)
    t_max, fill = context + n, context - p
    rows = prompt[:, :p].tolist()
    ids = np.ascontiguousarray(prompt[:, :p], dtype=np.int64)
    lengths = np.full(batch, p, np.int64)
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
        engine = ReferenceEngine(build_graphs(ctx.gm, batch, t_max, p, eos_ids=()))
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
            gen = generate_with_plan(plan, rows, max_new_tokens=n, seed=0)
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

        def start(length: int) -> None:  # greedy rows; the prefill sets pos and done
            write_sampling(engine, [Sampling()] * batch, np.zeros(batch, np.int64))
            settle()

        pre = []
        for _ in range(ctx.args.prefill_reps):
            start(p)
            if ctx.cuda:
                engine.prefill(ids, lengths)
                pre.append(engine.last_prefill_ms)
            else:
                pre.append(ctx.timed(lambda: engine.prefill(ids, lengths))[0])
        out["prefill_ms"] = med(pre)
        out["prefill_ms_all"] = pre

        start(p)
        engine.prefill(ids, lengths)
        t0 = time.perf_counter()
        if fill:
            window(fill)
        out["fill_steps"] = fill
        out["fill_s"] = time.perf_counter() - t0
        wins = []
        for w in range(ctx.args.decode_reps):
            if w:  # back to the window's start (the last step marked the rows done: their cache is full)
                engine.set_state("pos", np.full(batch, context, np.int64))
                engine.set_state("done", np.zeros(batch, bool))
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
