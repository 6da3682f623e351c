"""Generation on the GPU: a ``fusec.generation.Engine`` over a generation plan's two entry points.

The decode entry is captured once as a CUDA graph (the plan is compiled with ``cuda_graph``) and
each step is one ``cudaGraphLaunch`` on the engine's stream: the positions, the cache and the
drawn tokens all live in the plan's state region, so nothing is re-captured and nothing crosses
between host and device until the tokens are read back. The decode loop is one measured region:
``stats()["decode"]`` reports what the driver did over all steps (CUPTI) and per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusec.errors import InputError


class PlanEngine:
    def __init__(self, plan: Any):
        import cupy

        if "generation" not in plan.manifest or set(plan.entries) != {"prefill", "decode"}:
            raise InputError("this plan cannot generate: compile it with `fusec compile MODEL --generate`")
        self.plan = plan
        self.meta = plan.manifest["generation"]
        self._prefill = plan._exec("prefill")
        self._decode = plan._exec("decode")
        self.device = self._decode.device
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._events = (cupy.cuda.Event(), cupy.cuda.Event())
        self._steps = 0
        self._prefill_stats: dict[str, Any] = {}
        self._decode_counts: dict[str, Any] = {}
        self.last_prefill_ms: float | None = None

    def set_state(self, name: str, value: np.ndarray) -> None:
        self.stream.synchronize()
        self.device.set_state(name, value)

    def read_state(self, name: str) -> np.ndarray:
        self.stream.synchronize()
        return self.device.read_state(name)

    def prefill(self, input_ids: np.ndarray) -> None:
        a, b = self._events
        a.record(self.stream)
        self._prefill.run({"input_ids": input_ids}, stream=self.stream)
        b.record(self.stream)
        b.synchronize()
        import cupy

        self.last_prefill_ms = float(cupy.cuda.get_elapsed_time(a, b))
        self._prefill_stats = self._prefill.stats()
        self._steps = 0

    def decode(self) -> None:
        if self._decode._graph is not None:
            self._decode.replay(self.stream)
        else:
            self._decode.run({}, stream=self.stream, measure=False)
        self._steps += 1

    def sync(self) -> None:
        self.stream.synchronize()

    def finished(self) -> bool | None:
        return None  # asking would be a device-to-host copy per step: never

    def measure(self, on: bool) -> None:
        c = self.device.counters
        if not c.available:
            return
        if on:
            self._steps = 0
            c.start()
        else:
            c.stop()
            self._decode_counts = c.result()  # waits for the steps to finish (outside the region)

    def stats(self) -> dict[str, Any]:
        from fusec.runtime.executor import measured

        launches = len(self._decode.entry["launches"])
        layers = int(self.meta.get("num_layers", 0)) or 1
        decode: dict[str, Any] = {"steps": self._steps, "launches_per_step": launches,
                                  "kernels_per_layer": round(launches / layers, 2),
                                  "cuda_graph": self._decode._graph is not None}
        c = self.device.counters
        if not c.available:
            decode["counters"] = f"unavailable: {c.reason}"
        elif self._decode_counts:
            decode["counters"] = "cupti"
            counts = {k: v for k, v in self._decode_counts.items() if isinstance(v, (int, float)) and k != "region_ms"}
            decode["total"] = counts
            steps = max(self._steps, 1)
            decode["per_step"] = {k: counts.get(k, 0) / steps for k in
                                  ("syncs", "allocations", "h2d_bytes", "d2h_bytes", "kernel_launches", "graph_launches")}
        prefill = dict(self._prefill_stats) or measured(None)
        return {"backend": "cuda", "prefill": prefill, "decode": decode}


def generate_with_plan(plan: Any, prompts: Sequence[Any], max_new_tokens: int, seed: int = 0, stream_every: int = 0,
                       on_tokens: Callable[[list[list[int]]], None] | None = None, chat: bool = False) -> Any:
    from fusec.genmodel import encode_prompts, plan_tokenizer
    from fusec.textgen import run

    engine = getattr(plan, "_engine", None)
    if engine is None:
        engine = plan._engine = PlanEngine(plan)
    tok = plan_tokenizer(plan)
    ids = encode_prompts(tok, prompts, chat)
    res = run(engine, ids, tok, int(engine.meta["vocab_size"]), max_new_tokens=max_new_tokens, seed=seed,
              stream_every=stream_every, on_tokens=on_tokens)
    res.backend = "cuda"
    return res
