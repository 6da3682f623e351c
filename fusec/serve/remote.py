"""The engine in its own process: ``fusec serve``'s HTTP side and its engine do not share a lock.

With the event loop and the engine thread in one interpreter, the process could run only one of
them at a time. Measured on the H100 (benchmarks/RESULTS.md, issue 24) at 32 streaming clients:
the server process used one core in all; its event loop thread, writing one chunk per token,
held the lock for most of it, and the engine thread waited for the lock at every CUDA call, so a
decode step took 1.96-2.2 ms of wall time against the plan's 1.65 ms.

Here the engine and its ``Batcher`` run in a child process (``python -m fusec.serve.remote FD``)
and the HTTP process holds a ``RemoteBatcher``: the same face (``submit``, ``cancel``, ``stats``,
``shutdown``, ``on_events``, the plan's limits), with each ``Job`` mirrored by a key. Messages are
JSON over a socket pair, framed by ``multiprocessing.connection`` (nothing is pickled):

    parent -> child   {"options", "batcher"} first; then {"op": "submit" | "cancel" | "shutdown", ...}
    child -> parent   {"op": "ready", limits, tokenizer} or {"op": "failed", error} first; then
                      {"op": "events", events, stats?} per processed step; {"op": "ended", reason, stats}

The child ignores SIGINT (the parent shuts it down gracefully) and shuts down when the parent's
end of the socket closes. The parent notices a child that died (end of file) and ends every job
it was running with an error, as an engine failure in one process does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

from fusec.errors import FusecError, InputError, ModelError
from fusec.serve.batcher import Batcher, Job, QueueFull, ShuttingDown, check_job

_ERRORS: dict[str, type[FusecError]] = {"InputError": InputError, "ModelError": ModelError}
STATS_EVERY_S = 0.01  # the child sends its counters at most this often (and with every finished job)


def _encode(msg: Mapping[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":"), default=_plain).encode("utf-8")


def _plain(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy scalars in counters
        return x.item()
    return str(x)


class RemoteBatcher:
    """A ``Batcher`` in a child process (see the module docstring). Construction starts the child
    and waits until its engine is ready (a compile can take minutes; the child shows its progress
    on stderr); a child that cannot build it raises that error here, in one line."""

    def __init__(self, options: Mapping[str, Any], *, max_queue: int = 64, counters: bool = False,
                 admit_wait: float = 0.002):
        mine, theirs = socket.socketpair()
        self._conn = Connection(mine.detach())
        fd = theirs.detach()
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "fusec.serve.remote", str(fd)], pass_fds=(fd,),
                                          stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno())
        finally:
            os.close(fd)
        self._send_lock = threading.Lock()
        self._jobs: dict[int, Job] = {}
        self._next = 0
        self.max_queue = max_queue
        self.stopping: str | None = None
        self.on_events: Callable[[list[tuple[Job, list[int], bool]]], None] = lambda events: None
        self._stats: dict[str, Any] = {}
        self._reader: threading.Thread | None = None
        self._send({"options": dict(options), "batcher": {"max_queue": max_queue, "counters": counters,
                                                           "admit_wait": admit_wait}})
        hello = self._recv()
        if hello is None:
            code = self._proc.wait()
            raise FusecError(f"the engine process exited with code {code} before it was ready (its error is above)")
        if hello.get("op") == "failed":
            self._proc.wait()
            raise _ERRORS.get(hello.get("type", ""), FusecError)(hello.get("error", "the engine failed to start"))
        limits = hello["limits"]
        self.batch, self.prefill_len = int(limits["batch"]), int(limits["prefill_len"])
        self.max_seq_len, self.vocab = int(limits["max_seq_len"]), int(limits["vocab_size"])
        self.source, self.backend = str(hello["source"]), str(hello["backend"])
        self.tokenizer = _tokenizer(hello.get("tokenizer"))
        self._stats = dict(hello.get("stats") or {})

    # ---- the Batcher's face -------------------------------------------------------------------

    @property
    def counts(self) -> dict[str, Any]:
        return self._stats

    def check(self, job: Job) -> None:
        check_job(job, self.prefill_len, self.max_seq_len, self.vocab)

    def submit(self, job: Job) -> None:
        self.check(job)
        with self._send_lock:
            if self.stopping is not None:
                raise ShuttingDown(self.stopping)
            waiting = len(self._jobs) - self.batch
            if waiting >= self.max_queue:
                raise QueueFull(f"all {self.batch} rows are busy and {waiting} requests are waiting")
            key, self._next = self._next, self._next + 1
            job.key, job.t_submit = key, time.perf_counter()
            self._jobs[key] = job
            s = job.sampling
            self._send_unlocked({"op": "submit", "key": key, "prompt": [int(t) for t in job.prompt_ids],
                                 "max_tokens": job.max_tokens, "sampling": [s.temperature, s.top_k, s.top_p],
                                 "seed": int(job.seed)})

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        if job.key is not None and job.key in self._jobs:
            self._send({"op": "cancel", "key": job.key})

    def start(self) -> None:
        self._reader = threading.Thread(target=self._read, name="fusec-engine-events", daemon=True)
        self._reader.start()

    def shutdown(self, reason: str = "the server is shutting down", wait: float | None = None) -> None:
        with self._send_lock:
            first = self.stopping is None
            if first:
                self.stopping = reason
        if first:
            self._send({"op": "shutdown", "reason": reason})
        if wait is not None:
            if self._reader is not None and self._reader is not threading.current_thread():
                self._reader.join(wait)
            try:
                self._proc.wait(wait)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def occupancy(self) -> tuple[int, int]:
        return int(self._stats.get("rows_in_use", 0)), int(self._stats.get("queued", 0))

    def stats(self) -> dict[str, Any]:
        """The engine process's counters as of its last report (it reports at least every
        ``STATS_EVERY_S`` while working, and with every finished job)."""
        return dict(self._stats, engine_process=self._proc.pid)

    # ---- the reader thread ------------------------------------------------------------------------

    def _read(self) -> None:
        reason = None
        while True:
            msg = self._recv()
            if msg is None:
                code = self._proc.poll()
                reason = f"the engine process exited{'' if code is None else f' with code {code}'}"
                break
            if "stats" in msg:
                self._stats = msg["stats"]
            if msg["op"] == "ended":
                reason = msg.get("reason") or "the engine stopped"
                break
            self._deliver(msg["events"])
        with self._send_lock:
            if self.stopping is None:
                self.stopping = reason
        left = list(self._jobs.values())  # jobs the child never ended: it is gone
        self._deliver([[j.key, [], True, "error", reason] for j in left])

    def _deliver(self, raw: list[list[Any]]) -> None:
        now = time.perf_counter()
        events = []
        for key, toks, fin, finish, error in raw:
            job = self._jobs.get(key)
            if job is None:
                continue
            job.tokens.extend(toks)
            if toks and job.t_first is None:
                job.t_first = now
            if fin:
                job.finish, job.error, job.t_end = finish, error, now
                del self._jobs[key]
            events.append((job, toks, fin))
        if events:
            self.on_events(events)

    # ---- messages ------------------------------------------------------------------------------

    def _send(self, msg: Mapping[str, Any]) -> None:
        with self._send_lock:
            self._send_unlocked(msg)

    def _send_unlocked(self, msg: Mapping[str, Any]) -> None:
        try:
            self._conn.send_bytes(_encode(msg))
        except OSError:
            pass  # the child is gone: the reader thread ends its jobs

    def _recv(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            return None


def _tokenizer(info: Mapping[str, Any] | None) -> Any:
    if info is None:
        return None
    import tokenizers

    from fusec.text import Tokenizer

    return Tokenizer(tokenizers.Tokenizer.from_str(info["json"]), bos_id=info["bos_id"], eos_ids=info["eos_ids"],
                     add_bos=info["add_bos"], chat_template=info["chat_template"], vocab_size=info["vocab_size"])


def _tokenizer_info(tok: Any) -> dict[str, Any] | None:
    if tok is None:
        return None
    return {"json": tok.backend.to_str(), "bos_id": tok.bos_id, "eos_ids": list(tok.eos_ids), "add_bos": tok.add_bos,
            "chat_template": tok.chat_template, "vocab_size": tok.vocab_size}


# ---- the child --------------------------------------------------------------------------------------

def child_main(fd: int) -> int:
    """The engine process: build the engine from the options, then serve the parent's messages."""
    from fusec.sampling import Sampling
    from fusec.serve.engine import make_engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    conn = Connection(fd)
    lock = threading.Lock()

    def send(msg: Mapping[str, Any]) -> None:
        with lock:
            try:
                conn.send_bytes(_encode(msg))
            except OSError:
                pass  # the parent is gone: the loop below sees it too

    try:
        hello = json.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return 1
    try:
        engine, tok, source, backend = make_engine(types.SimpleNamespace(**hello["options"]),
                                                   lambda line: print(line, file=sys.stderr, flush=True))
    except FusecError as e:
        send({"op": "failed", "type": type(e).__name__ if type(e).__name__ in _ERRORS else "FusecError",
              "error": str(e)})
        return 1
    except Exception as e:  # noqa: BLE001 - the parent reports it in one line and exits
        send({"op": "failed", "type": "FusecError", "error": f"the engine failed to start: {type(e).__name__}: {e}"})
        return 1
    jobs: dict[int, Job] = {}
    last = [0.0]

    def on_events(events: list[tuple[Job, list[int], bool]]) -> None:  # the engine thread
        out = []
        done = False
        for job, toks, fin in events:
            out.append([job.tag, [int(t) for t in toks], bool(fin), job.finish if fin else None,
                        job.error if fin else None])
            if fin:
                jobs.pop(job.tag, None)
                done = True
        msg: dict[str, Any] = {"op": "events", "events": out}
        now = time.perf_counter()
        if done or now - last[0] >= STATS_EVERY_S:
            msg["stats"], last[0] = batcher.stats(), now
        send(msg)

    opts = hello["batcher"]
    batcher = Batcher(engine, on_events, max_queue=int(opts["max_queue"]), counters=bool(opts["counters"]),
                      admit_wait=float(opts["admit_wait"]))
    meta = engine.meta
    send({"op": "ready", "source": str(source), "backend": backend, "tokenizer": _tokenizer_info(tok),
          "limits": {k: int(meta[k]) for k in ("batch", "prefill_len", "max_seq_len", "vocab_size")},
          "stats": batcher.stats()})
    batcher.start()
    reason = None
    while reason is None:
        if batcher.thread is not None and not batcher.thread.is_alive():
            reason = batcher.stopping or "the engine stopped"
            break
        try:
            if not conn.poll(0.2):
                continue
            msg = json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            reason = "the server process went away"
            batcher.shutdown(reason)
            break
        op = msg.get("op")
        if op == "submit":
            key = int(msg["key"])
            job = Job(msg["prompt"], int(msg["max_tokens"]), Sampling(*msg["sampling"]), int(msg["seed"]), tag=key)
            jobs[key] = job
            try:
                batcher.submit(job)
            except (QueueFull, ShuttingDown, InputError) as e:  # the parent checked first: a race at most
                jobs.pop(key, None)
                send({"op": "events", "events": [[key, [], True, "error", str(e)]]})
        elif op == "cancel":
            job = jobs.get(int(msg["key"]))
            if job is not None:
                batcher.cancel(job)
        elif op == "shutdown":
            reason = str(msg.get("reason") or "the server is shutting down")
            batcher.shutdown(reason)
    if batcher.thread is not None:
        batcher.thread.join(30)
    send({"op": "ended", "reason": reason, "stats": batcher.stats()})
    return 0


if __name__ == "__main__":
    sys.exit(child_main(int(sys.argv[1])))
