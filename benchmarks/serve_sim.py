"""``fusec serve``'s host side under load, on any machine: the real server (Starlette on uvicorn,
the batcher) over a simulated GPU, so that the Python work per token can be measured and profiled
where there is no GPU.

    python benchmarks/serve_sim.py OUT_DIR [--clients 32] [--duration 8] [--step-ms 1.65]

The simulated engine keeps a device timeline: each decode step, prefill and admit run is queued
behind the work before it and takes the time measured on the H100 (benchmarks/RESULTS.md, issue 24:
Qwen3-0.6B shape, batch 32: a step 1.65 ms, the whole-batch prefill 10.5 ms, an admit run of 8
prompts 4.6 ms; a join step of 2 prompts 2.88 ms on the H200); a read-back is ready when the timeline passes its step. Every call that would
enter the CUDA driver gives up the interpreter lock once, as CuPy's calls do. The ratio reported is
the clients' token rate over the timeline's own (batch / step time), as benchmarks/serve.py
reports it against the plan's generate rate. Run the server under a sampling profiler with
``--server-only`` (it prints its port) to see where the event loop's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
from fusec.serve.batcher import READBACK_EVERY

sys.path.insert(0, os.path.dirname(__file__))


class _Ready:
    def __init__(self, at: float, value: np.ndarray):
        self._at, self._value = at, value

    def ready(self) -> bool:
        return time.perf_counter() >= self._at

    def get(self) -> np.ndarray:
        while not self.ready():
            time.sleep(50e-6)
        return self._value


class SimEngine:
    """``fusec.generation.Engine`` over a simulated device timeline (random tokens, no EOS)."""

    syncs = 0

    def __init__(self, batch: int, prefill_len: int, max_seq_len: int, vocab: int, admit_batch: int,
                 step_ms: float, prefill_ms: float, admit_ms: float, join: int = 0, join_ms: float = 0.0):
        self.meta = {"batch": batch, "prefill_len": prefill_len, "max_seq_len": max_seq_len, "vocab_size": vocab,
                     "eos_ids": [], "admit_batch": admit_batch, "join": join}
        self._cost = {"decode": step_ms / 1e3, "prefill": prefill_ms / 1e3, "admit": admit_ms / 1e3,
                      "join": join_ms / 1e3}
        self._free = time.perf_counter()  # when the timeline's queued work ends
        self._rng = np.random.default_rng(0)
        self._vocab, self._batch = vocab, batch
        self._runs: dict[str, int] = {}
        self._starved = 0

    def _queue(self, what: str) -> None:
        time.sleep(0)  # a driver call: the lock is released and taken back
        now = time.perf_counter()
        self._starved += self._free < now  # the timeline had run dry: the GPU waited for the host
        self._free = max(self._free, now) + self._cost[what]
        self._runs[what] = self._runs.get(what, 0) + 1

    def gpu_timeline(self) -> dict[str, Any]:
        """As ``PlanEngine.gpu_timeline``: runs per kind and those queued to an idle timeline."""
        return {"runs": dict(self._runs), "starved_runs": self._starved}

    def write_states(self, values: dict[str, np.ndarray]) -> None:
        time.sleep(0)

    def prefill(self, input_ids: np.ndarray, lengths: np.ndarray, timed: bool = True, measure: bool = False) -> None:
        self._queue("prefill")

    def admit(self, feeds: Any) -> None:
        self._queue("admit")

    def decode(self) -> None:
        self._queue("decode")

    def join(self, feeds: Any) -> None:
        self._queue("join")

    def fetch(self, name: str) -> _Ready:
        time.sleep(0)
        shape = (self._batch, self.meta["max_seq_len"]) if name == "tokens" else (self._batch,)
        return _Ready(self._free, self._rng.integers(1, self._vocab, shape))

    def sync(self) -> None:
        time.sleep(max(0.0, self._free - time.perf_counter()))

    def measure(self, on: bool) -> None:
        pass

    def finished(self) -> bool | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"backend": "simulated"}


def serve(args: argparse.Namespace) -> None:
    from fusec.serve import app as serve_app
    from fusec.serve.batcher import Batcher

    engine = SimEngine(args.clients, args.prompt_len, args.prompt_len + args.max_tokens, args.vocab,
                       args.clients // args.admit_div if args.admit_div else 0, args.step_ms, args.prefill_ms,
                       args.admit_ms, args.join, args.join_ms)
    batcher = Batcher(engine, lambda events: None, max_queue=4 * args.clients + 8, lookahead=args.lookahead,
                      readback_every=args.readback_every)
    server = serve_app.Server(batcher, None, "bench", log=lambda line: None)
    sys.setswitchinterval(args.switch_us / 1e6)
    serve_app.run(server, "127.0.0.1", 0, on_ready=lambda port: print(f"port {port}", flush=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--step-ms", type=float, default=1.65)
    ap.add_argument("--prefill-ms", type=float, default=10.5)
    ap.add_argument("--admit-ms", type=float, default=4.6)
    ap.add_argument("--admit-div", type=int, default=4)
    ap.add_argument("--join", type=int, default=0, metavar="J", help="a join entry of J prompts a step (0: none)")
    ap.add_argument("--join-ms", type=float, default=2.88, help="a join step's time (H200, J=2: 2.88 ms)")
    ap.add_argument("--switch-us", type=int, default=500)
    ap.add_argument("--lookahead", type=int, default=3, help="read-backs the engine keeps queued (Batcher)")
    ap.add_argument("--readback-every", type=int, default=READBACK_EVERY, metavar="K", help="decode steps per read-back (Batcher)")
    ap.add_argument("--client-procs", type=int, default=0, metavar="P", help="processes the clients are spread over")
    ap.add_argument("--server-only", action="store_true", help="run the server in this process until killed")
    args = ap.parse_args()
    if args.server_only:
        serve(args)
        return 0
    if not args.out_dir:
        ap.error("OUT_DIR is required (unless --server-only)")
    from serve import cpu_use, health, load, one_request, thread_cpu

    os.makedirs(args.out_dir, exist_ok=True)
    cmd = [sys.executable, __file__, "--server-only"] + [a for a in sys.argv[1:] if a != args.out_dir]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("port "):
            raise RuntimeError(f"the simulated server did not start: {line!r}")
        port = int(line.split()[1])
        one_request(port, [1] * args.prompt_len, 4)
        cpu0, t0 = thread_cpu(proc.pid), time.perf_counter()
        s = load(port, args.clients, args, args.vocab)
        s["server_cpu"] = cpu_use(cpu0, thread_cpu(proc.pid), time.perf_counter() - t0)
        s["server"] = health(port)
    finally:
        proc.terminate()
        proc.wait(30)
    rate = args.clients / (args.step_ms / 1e3)
    s["timeline_tok_s"], s["ratio"] = rate, s["tok_s"] / rate
    with open(os.path.join(args.out_dir, "serve_sim.json"), "w") as f:
        json.dump({"args": vars(args), "result": s}, f, indent=1, default=str)
    h = s["server"]
    print(f"clients {args.clients}: {s['tok_s']:.0f} tok/s = {s['ratio']:.2f} x the timeline's {rate:.0f} "
          f"(steady {s['steady_tok_s'] / rate:.2f}); "
          f"TTFT p50/p99 {s['ttft_ms_p50']:.1f}/{s['ttft_ms_p99']:.1f} ms; rows in use per step "
          f"{h['row_steps'] / max(h['decode_steps'], 1):.2f}; admissions {h['admissions']}; runs queued to an "
          f"idle GPU {h.get('gpu', {}).get('starved_runs')} of {sum(h.get('gpu', {}).get('runs', {}).values())}; "
          f"server CPU {s['server_cpu']['cores']:.2f} cores {s['server_cpu']['top_threads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
