"""Continuous batching over a generation plan: one engine thread, rows as seats.

A generation plan has B rows. Each ``Job`` (one request's generation, in token ids) takes a free
row; jobs join at a step boundary: the engine thread writes the rows' sampling settings (whole [B]
arrays from its own copy of every row's settings) and runs one prefill with ``lengths[b]`` = the
prompt length of each admitted row and 0 elsewhere, which leaves every other row exactly as it was
(models/generate.py), so the other rows go on decoding from where they stood. One decode step
then serves every row. A row is freed when its job ends: an end-of-sequence token, ``max_tokens``
tokens, or a cancel (``cancel``: a stop string seen by the consumer, a client that went away).

A plan compiled with an admit batch A (``fusec serve --admit-batch A``) admits k rows
through its admit entry, A prompts a run, when ceil(k / A) runs compute fewer rows than one prefill
of the batch (``fusec.generation.admit_rows``); otherwise, and for a plan without one, the masked
prefill of the whole batch runs: the cache writes of a non-admitted row go to position T, which
``cache_write`` drops, and the row states keep their values through a ``where``. Measured on an
H100 with 32 clients (benchmarks/RESULTS.md): the whole-batch prefill at every admission cost
about 15% of the decode throughput.

A plan with a join entry of J prompts a step (``fusec serve --join J``, models/join.py) admits
while rows are decoding without stalling them for a prefill: up to J queued jobs take free rows
inside the next decode step; an idle batch still admits through the prefill (or the admit entry).

The plan runs on this one thread (a plan runs one call at a time); nothing else touches it. The
thread keeps up to ``lookahead`` decode steps queued on the GPU: after each step it queues an
asynchronous read-back of the drawn tokens (``engine.fetch("cur")``) and processes the read-backs
that have landed, polling their events, so a step of rows already decoding costs no host
synchronization. With ``readback_every`` K > 1 (``fusec serve --readback-every K``) one read-back
of the ``tokens`` state (row b's token n at position len(prompt) + n) covers K steps: the thread's
driver calls and Python work per token fall K-fold, tokens reach clients K at a time, and K - 1
more steps stay queued for the same slack. An admission queues behind the steps in flight too (the
sampling settings and the entry's inputs go through page-locked staging), and ``stats()`` counts
any host synchronization it makes (``admit_syncs``). With a GPU engine, ``stats()["gpu"]`` is the
engine's timeline: each kind of run's GPU time and the runs queued after the GPU had run dry (the
host, not the GPU, set the pace then). Since a prefill costs the same for one row or for all, a
request that finds fewer companions than free rows waits up to ``admit_wait`` seconds (other rows
decode meanwhile) for others to join the same prefill.

Events go to the consumer through ``on_events(list of (job, new token ids, finished))``, called on
the engine thread once per processed step (the server hands them to its event loop in one call).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusec.errors import InputError
from fusec.generation import admit_rows, join_feeds, sampling_states
from fusec.sampling import Sampling, check_seed


class QueueFull(Exception):
    """Every row is busy and the queue holds ``max_queue`` jobs (HTTP 503)."""


class ShuttingDown(Exception):
    """The batcher stopped (or its engine failed): no new jobs (HTTP 503)."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request's generation, in token ids. The engine thread owns every field but
    ``cancelled``; the consumer reads ``tokens``/``finish`` after the job's last event."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    seed: int = 0
    tag: Any = None  # the consumer's (e.g. its event queue)
    tokens: list[int] = dataclasses.field(default_factory=list)  # drawn, the end-of-sequence token included
    finish: str | None = None  # "stop" (end of sequence), "length", "cancelled", "error"
    error: str | None = None
    cancelled: bool = False
    row: int | None = None
    t_submit: float = 0.0
    t_admit: float | None = None
    t_first: float | None = None
    t_end: float | None = None


Events = list[tuple[Job, list[int], bool]]


# Read-backs every K decode steps by default: measured on an H200 at 32 clients (benchmarks/RESULTS.md,
# fifth session), K = 4 gave 0.87-0.88 of the plan's decode rate against 0.83 at K = 1 in the same call
# (the engine thread at 0.28 cores against 0.68; runs queued to an idle GPU 0.5% against 4-5%)
READBACK_EVERY = 4


class Batcher:
    def __init__(self, engine: Any, on_events: Callable[[Events], None], *, max_queue: int = 64,
                 eos_ids: Sequence[int] | None = None, lookahead: int = 3, counters: bool = False,
                 admit_wait: float = 0.002, readback_every: int = READBACK_EVERY):
        meta = engine.meta
        self.engine = engine
        self.batch, self.prefill_len = int(meta["batch"]), int(meta["prefill_len"])
        self.max_seq_len, self.vocab = int(meta["max_seq_len"]), int(meta["vocab_size"])
        self.eos_ids = frozenset(int(e) for e in (meta["eos_ids"] if eos_ids is None else eos_ids))
        self.on_events = on_events
        self.max_queue, self.lookahead, self.counters = max_queue, max(1, lookahead), counters
        self.admit_wait = admit_wait
        self.joins = int(meta.get("join") or 0)  # prompts a join step takes (models/join.py); 0: no join entry
        self.rows: list[Job | None] = [None] * self.batch
        self.queue: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        # read-backs queued: (fetch, the seats of each step it covers, the state read: "cur" holds
        # one step's tokens, "tokens" every position's)
        self.pending: collections.deque[tuple[Any, list[list[tuple[int, Job]]], str]] = collections.deque()
        self.readback_every = max(1, int(readback_every))
        self._unread: list[list[tuple[int, Job]]] = []  # seats of the steps since the last read-back
        self.settings = [Sampling()] * self.batch
        self.seeds = np.zeros(self.batch, np.int64)
        self.stopping: str | None = None
        self.thread: threading.Thread | None = None
        self.counts = {"submitted": 0, "admissions": 0, "admitted": 0, "decode_steps": 0, "finished": 0,
                       "cancelled": 0, "admit_syncs": 0, "admit_runs": 0, "tokens": 0,
                       "row_steps": 0, "admit_host_ms": 0.0, "joins": 0, "joined": 0, "readbacks": 0}
        self.driver: dict[str, float] = {}  # decode-only phases, measured (counters=True and CUPTI)
        self.driver_steps = 0
        self._measuring = False
        # the GPU engine's timeline: each kind of run's GPU time, measured by events (read on this
        # thread after each processed step; None for an engine without one)
        self._timeline = getattr(engine, "gpu_timeline", None)
        self.gpu: dict[str, Any] | None = None

    # ---- any thread ---------------------------------------------------------------------------

    def admission(self) -> str:
        """How this plan admits requests, in words (the server's start-up line)."""
        slots = int(self.engine.meta.get("admit_batch") or 0)
        idle = f"the admit entry ({slots} a run) or the prefill" if slots else "the prefill"
        return f"admits through {idle}" + (f"; while rows decode, through the join entry ({self.joins} a step)"
                                           if self.joins else "")

    def check(self, job: Job) -> None:
        """InputError for a job this plan cannot run (one line naming the field)."""
        n = len(job.prompt_ids)
        if n == 0:
            raise InputError("the prompt is empty")
        if n > self.prefill_len:
            raise InputError(f"the prompt has {n} tokens; this plan takes at most {self.prefill_len}")
        if isinstance(job.max_tokens, bool) or not isinstance(job.max_tokens, int) or job.max_tokens < 1:
            raise InputError(f"max_tokens must be a positive integer, got {job.max_tokens!r}")
        if n + job.max_tokens > self.max_seq_len:
            raise InputError(f"the prompt's {n} tokens + max_tokens {job.max_tokens} exceed the plan's "
                             f"{self.max_seq_len} positions")
        bad = next((t for t in job.prompt_ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.vocab})")
        check_seed(job.seed)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (checked first). QueueFull when the queue is full, ShuttingDown after
        ``shutdown`` or an engine failure."""
        self.check(job)
        with self.cond:
            if self.stopping is not None:
                raise ShuttingDown(self.stopping)
            if len(self.queue) >= self.max_queue:
                raise QueueFull(f"all {self.batch} rows are busy and {len(self.queue)} requests are waiting")
            job.t_submit = time.perf_counter()
            self.queue.append(job)
            self.counts["submitted"] += 1
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """End ``job`` at the next step boundary (its row is freed; no more events but its last)."""
        job.cancelled = True
        with self.cond:
            self.cond.notify()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._main, name="fusec-engine", daemon=True)
        self.thread.start()

    def shutdown(self, reason: str = "the server is shutting down", wait: float | None = None) -> None:
        """Stop: every queued and running job ends with ``error`` = ``reason`` (its last event)."""
        with self.cond:
            if self.stopping is None:
                self.stopping = reason
            self.cond.notify()
        if wait is not None and self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(wait)

    def occupancy(self) -> tuple[int, int]:
        """(rows in use, jobs waiting)."""
        return sum(r is not None for r in self.rows), len(self.queue)

    def stats(self) -> dict[str, Any]:
        used, waiting = self.occupancy()
        out: dict[str, Any] = {"batch": self.batch, "rows_in_use": used, "queued": waiting, **self.counts,
                               "lookahead": self.lookahead,
                               "admit_syncs_note": "host synchronizations made while admitting rows, counted by the "
                                                   "engine where it makes them; decode steps of rows already "
                                                   "decoding read their tokens back asynchronously"}
        if self.gpu is not None:
            out["gpu"] = self.gpu
        if self.counters:
            steps = max(self.driver_steps, 1)
            out["decode_driver"] = {"steps": self.driver_steps, "total": dict(self.driver),
                                    "per_step": {k: self.driver.get(k, 0) / steps for k in
                                                 ("syncs", "allocations", "h2d_bytes", "d2h_bytes",
                                                  "kernel_launches", "graph_launches")}}
        return out

    # ---- the engine thread ----------------------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._timeline is not None:
                self.gpu = self._timeline()  # turned on before the first run
            self._loop()
            reason = self.stopping or "the server is shutting down"
        except BaseException as e:  # noqa: BLE001 - every job must hear why it ended
            reason = f"the engine failed: {type(e).__name__}: {e}"
            with self.cond:
                self.stopping = reason
        self._measure(False)
        events: Events = []
        for job in [j for j in self.rows if j is not None] + list(self.queue):
            self._end(job, "error", events, error=reason)
        self.queue.clear()
        self.pending.clear()
        if events:
            self.on_events(events)

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.stopping is None and not self.queue and not self.pending and not self._busy():
                    self.cond.wait()
                if self.stopping is not None:
                    return
                drop = [j for j in self.queue if j.cancelled]
                for j in drop:
                    self.queue.remove(j)
                free = sum(r is None or r.cancelled for r in self.rows)
                want = bool(self.queue) and free > 0
                # rows decoding and a join entry: the next step takes up to J queued jobs along, at once
                join = want and self.joins > 0 and self._busy()
                young = want and not join and len(self.queue) < free \
                    and time.perf_counter() - self.queue[0].t_submit < self.admit_wait
                if young and not self._busy() and not self.pending and not drop:
                    # idle: a prefill costs the same for one row or all, so wait a moment for company
                    self.cond.wait(self.admit_wait)
                    continue
                want = want and not young  # rows decoding: admit at a later boundary, with whoever came
            events: Events = []
            for j in drop:
                self._end(j, "cancelled", events)
            for j in self.rows:  # cancelled while decoding: free the row now (queued read-backs skip it)
                if j is not None and j.cancelled:
                    self._end(j, "cancelled", events)
            if events:
                self.on_events(events)
            seated = self._seat(self.joins) if join else []  # the jobs riding in this step's join, if any
            feeds = join_feeds([(b, j.prompt_ids) for b, j in seated], self.prefill_len, self.joins) if seated else None
            if want and not join:
                self._admit()
            if self._busy():
                self._step(feeds)
            # a window of K steps is read once complete: keep K - 1 more in flight for the same slack
            self._drain(keep=self.lookahead + self.readback_every - 1 if self._busy() else 0)

    def _busy(self) -> bool:
        return any(j is not None for j in self.rows)

    def _step(self, feeds: dict[str, np.ndarray] | None) -> None:
        """One decode step of every row; with ``feeds``, through the join entry: the jobs seated by
        ``_seat`` ride in it (its host-to-device copies stay outside the measured decode-only
        phases: ``_seat`` stopped the measuring)."""
        if feeds is None:
            self.engine.decode()
            self.driver_steps += self._measuring
        else:
            t0, syncs = time.perf_counter(), self.engine.syncs
            self.engine.join(feeds)
            self.counts["joins"] += 1
            self.counts["joined"] += int(np.count_nonzero(feeds["lengths"]))
            self._admission_cost(t0, syncs)
            self._measure(True)
        self.counts["decode_steps"] += 1
        self.counts["row_steps"] += sum(j is not None for j in self.rows)
        seats = [(b, j) for b, j in enumerate(self.rows) if j]
        if self.readback_every == 1:
            self._queue_read("cur", [seats])
            return
        self._unread.append(seats)
        if len(self._unread) >= self.readback_every:
            self._read_back()

    def _queue_read(self, state: str, steps: list[list[tuple[int, Job]]]) -> None:
        """Queue a read-back of ``state`` covering ``steps`` (each step's seats): "cur" holds one
        step's tokens, "tokens" each row's token n at position len(prompt) + n."""
        self.pending.append((self.engine.fetch(state), steps, state))
        self.counts["readbacks"] += 1

    def _read_back(self) -> None:
        """One read-back of the tokens of every step since the last (``readback_every`` > 1)."""
        if self._unread:
            self._queue_read("tokens", self._unread)
            self._unread = []

    def _seat(self, n: int) -> list[tuple[int, Job]]:
        """Seat up to ``n`` queued jobs in free rows and write the rows' sampling states (queued,
        no wait; the driver counters stop first: the caller turns them on again once it has
        queued the seated jobs' prefill or join). Returns (row, job) of each seated job."""
        free = [b for b, j in enumerate(self.rows) if j is None]
        take: list[Job] = []
        with self.cond:
            while self.queue and len(take) < min(n, len(free)):
                j = self.queue.popleft()
                if not j.cancelled:
                    take.append(j)
                else:
                    self._end(j, "cancelled", [])
        if not take:
            return []
        self._measure(False)
        t0, syncs = time.perf_counter(), self.engine.syncs
        for job, b in zip(take, free):
            self.settings[b], self.seeds[b] = job.sampling, job.seed
            job.row, job.t_admit = b, t0
            self.rows[b] = job
        self.engine.write_states(sampling_states(self.settings, self.seeds))
        self.counts["admitted"] += len(take)
        self._admission_cost(t0, syncs)
        return list(zip(free, take))

    def _admission_cost(self, t0: float, syncs: int) -> None:
        self.counts["admit_host_ms"] += (time.perf_counter() - t0) * 1e3
        self.counts["admit_syncs"] += self.engine.syncs - syncs

    def _admit(self) -> None:
        """One step boundary: admit queued jobs into the rows free now, through the prefill (or
        the admit entry). The steps still queued keep running: the admission's copies and runs
        queue behind them on the engine's stream (rows whose end those steps reveal are admitted
        at a later boundary)."""
        seated = self._seat(self.batch)
        if seated:
            t0, syncs = time.perf_counter(), self.engine.syncs
            ids = np.zeros((self.batch, self.prefill_len), np.int64)
            lengths = np.zeros(self.batch, np.int64)
            for b, job in seated:
                ids[b, :len(job.prompt_ids)] = job.prompt_ids
                lengths[b] = len(job.prompt_ids)
            self._read_back()  # the steps before come first
            self.counts["admit_runs"] += admit_rows(self.engine, ids, lengths)
            self._queue_read("cur", [seated])
            self.counts["admissions"] += 1
            self._admission_cost(t0, syncs)
        self._measure(True)

    def _drain(self, keep: int) -> None:
        """Process the read-backs that have landed; wait (polling) while more than ``keep`` steps are
        in flight (read back or not)."""
        if keep == 0:
            self._read_back()  # nothing more will be stepped soon: read what is unread
        processed = False
        while self.pending and (self._in_flight() > keep or self.pending[0][0].ready()):
            processed = True
            fetch, steps, state = self.pending.popleft()
            got = fetch.get()
            events: Events = []
            fresh: dict[Job, list[int]] = {}  # tokens drawn in these steps by jobs still running
            for seats in steps:
                for b, job in seats:
                    if job.finish is not None:
                        continue  # ended after this step was queued: the row's later tokens are nobody's
                    if job.cancelled:
                        fresh.pop(job, None)
                        self._end(job, "cancelled", events)
                        continue
                    tok = int(got[b] if state == "cur" else got[b, len(job.prompt_ids) + len(job.tokens)])
                    job.tokens.append(tok)
                    self.counts["tokens"] += 1
                    if job.t_first is None:
                        job.t_first = time.perf_counter()
                    if tok in self.eos_ids:
                        self._end(job, "stop", events, new=fresh.pop(job, []))
                    elif len(job.tokens) >= job.max_tokens:
                        self._end(job, "length", events, new=fresh.pop(job, []) + [tok])
                    else:
                        fresh.setdefault(job, []).append(tok)
            events += [(job, toks, False) for job, toks in fresh.items()]
            if events:
                self.on_events(events)
        if processed and self._timeline is not None:  # runs completed meanwhile: their GPU time
            self.gpu = self._timeline()

    def _in_flight(self) -> int:
        """Steps queued whose tokens are not processed yet (read back or not)."""
        return sum(len(steps) for _, steps, _ in self.pending) + len(self._unread)

    def _end(self, job: Job, finish: str, events: Events, new: Sequence[int] = (), error: str | None = None) -> None:
        if job.finish is not None:
            return
        job.finish, job.error, job.t_end = finish, error, time.perf_counter()
        if job.row is not None and self.rows[job.row] is job:
            self.rows[job.row] = None
        self.counts["finished"] += 1
        self.counts["cancelled"] += finish == "cancelled"
        events.append((job, list(new), True))

    def _measure(self, on: bool) -> None:
        """Count what the driver does over decode-only phases (counters=True, CUPTI present)."""
        if not self.counters or on == self._measuring:
            return
        self._measuring = on
        self.engine.measure(on)
        if not on:
            total = self.engine.stats().get("decode", {}).get("total") or {}
            for k, v in total.items():
                self.driver[k] = self.driver.get(k, 0) + v
