"""Continuous batching on the reference backend (fusec.serve.batcher, no HTTP): requests join
between decode steps, a prefill that admits rows leaves the other rows exactly as they were, and a
request's tokens are the same whether it ran alone or beside others."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fusec.errors import InputError
from fusec.generation import ReferenceEngine, generate
from fusec.genmodel import build_graphs, load_generation_model
from fusec.sampling import Sampling
from fusec.serve.batcher import Batcher, Job, QueueFull, ShuttingDown

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34], [41, 42], [51, 52, 53, 54, 55, 56], [61]]


@pytest.fixture(scope="module")
def gm():
    return load_generation_model("qwen3-tiny")


def _engine(gm, batch: int = 3, t_max: int = 40, join: int = 0):
    e = ReferenceEngine(build_graphs(gm, batch, t_max, 8, eos_ids=[], join=join), optimize=True)
    e.meta = dict(e.meta, vocab_size=gm.config.vocab_size)
    return e


class _Sink:
    """Collects the batcher's events; ``wait`` until every job has ended (bounded)."""

    def __init__(self):
        self.events: list[tuple[Job, list[int], bool]] = []
        self.lock = threading.Lock()
        self.ended: set[int] = set()

    def __call__(self, events):
        with self.lock:
            self.events += events
            self.ended |= {id(j) for j, _, fin in events if fin}

    def wait(self, jobs, timeout: float = 30.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            with self.lock:
                if all(id(j) in self.ended for j in jobs):
                    return
            time.sleep(0.005)
        raise AssertionError("jobs did not end in time")

    def delivered(self, job) -> list[int]:
        with self.lock:
            return [t for j, toks, _ in self.events if j is job for t in toks]


def _alone(gm, prompt, n, sampling=None, seed=0):
    """What one request draws in a plan of its own (one row, row 0 keeps the seed)."""
    return generate(_engine(gm, 1), [prompt], n, gm.config.vocab_size, seed=seed, sampling=sampling).new_ids[0]


@pytest.mark.parametrize("join,every", [(0, 1), (1, 1), (2, 1), (0, 3), (2, 4)],
                         ids=["prefill", "join-entry", "join-entry-2", "prefill-read-every-3", "join-2-read-every-4"])
def test_greedy_requests_beside_others_equal_alone(gm, join, every):
    """Six requests with different lengths and max_tokens through three rows: they queue, join as
    rows free up (other rows keep decoding; with a join entry, inside a decode step), and each
    draws exactly what it draws alone; also when the tokens are read back every few steps."""
    sink = _Sink()
    b = Batcher(_engine(gm, join=join), sink, max_queue=16, lookahead=2, readback_every=every)
    b.start()
    try:
        jobs = [Job(p, 6 + 3 * i) for i, p in enumerate(PROMPTS)]
        for j in jobs:
            b.submit(j)
        sink.wait(jobs)
    finally:
        b.shutdown(wait=10)
    for j in jobs:
        assert j.finish == "length" and j.tokens == _alone(gm, j.prompt_ids, j.max_tokens)
        assert sink.delivered(j) == j.tokens  # every token was handed out once, in order
    assert b.counts["admitted"] == 6
    reads = b.counts["readbacks"] - b.counts["admissions"]  # those of decode and join steps
    if every == 1:
        assert reads == b.counts["decode_steps"]
    else:  # one per `every` steps, and a partial one before each admission or when the batch empties
        assert reads <= b.counts["decode_steps"] // every + 2 * b.counts["admissions"] + 2
        assert reads < b.counts["decode_steps"]
    if join:  # the first requests come in by the prefill (no row is decoding yet), later ones by joins
        assert b.counts["joined"] >= 3 and b.counts["admissions"] >= 1
        assert b.counts["joins"] <= b.counts["joined"]
    else:
        assert b.counts["admissions"] >= 2 and b.counts["joins"] == b.counts["joined"] == 0


@pytest.mark.parametrize("join,every", [(0, 1), (1, 1), (1, 3)], ids=["prefill", "join-entry", "join-read-every-3"])
def test_sampled_requests_are_reproducible_by_seed_in_any_row(gm, join, every):
    cut = Sampling(0.9, 20, 0.9)
    sink = _Sink()
    b = Batcher(_engine(gm, join=join), sink, max_queue=16, readback_every=every)
    b.start()
    try:
        jobs = [Job(PROMPTS[0], 8, cut, seed=5), Job(PROMPTS[1], 12), Job(PROMPTS[0], 8, cut, seed=5),
                Job(PROMPTS[0], 8, cut, seed=6)]
        for j in jobs:
            b.submit(j)
        sink.wait(jobs)
    finally:
        b.shutdown(wait=10)
    assert jobs[0].tokens == jobs[2].tokens == _alone(gm, PROMPTS[0], 8, cut, seed=5)
    assert jobs[3].tokens != jobs[0].tokens


def test_cancel_frees_the_row_for_the_next_request(gm):
    sink = _Sink()
    b = Batcher(_engine(gm, batch=1, t_max=128), sink, max_queue=4)
    b.start()
    try:  # a long request: it is still decoding when cancelled, however slow this thread is scheduled
        long = Job(PROMPTS[0], 120)
        b.submit(long)
        t_end = time.monotonic() + 20
        while not sink.delivered(long) and time.monotonic() < t_end:
            time.sleep(0.002)
        b.cancel(long)
        nxt = Job(PROMPTS[1], 4)
        b.submit(nxt)  # the only row is the cancelled one's
        sink.wait([long, nxt])
    finally:
        b.shutdown(wait=10)
    assert long.finish == "cancelled" and len(long.tokens) < 120
    assert nxt.finish == "length" and nxt.tokens == _alone(gm, PROMPTS[1], 4)
    assert b.counts["cancelled"] == 1


@pytest.mark.parametrize("every", [1, 4], ids=["read-every-step", "read-every-4"])
def test_end_of_sequence_ends_a_request_and_others_go_on(gm, every):
    first = _alone(gm, PROMPTS[0], 6)
    eos = first[2]  # the third token drawn ends the first request
    sink = _Sink()
    e = ReferenceEngine(build_graphs(gm, 2, 40, 8, eos_ids=[eos]), optimize=True)
    e.meta = dict(e.meta, vocab_size=gm.config.vocab_size)
    b = Batcher(e, sink, max_queue=4, readback_every=every)
    b.start()
    try:
        jobs = [Job(PROMPTS[0], 6), Job(PROMPTS[3], 5)]
        for j in jobs:
            b.submit(j)
        sink.wait(jobs)
    finally:
        b.shutdown(wait=10)
    assert jobs[0].finish == "stop" and jobs[0].tokens == first[:first.index(eos) + 1]
    assert eos not in sink.delivered(jobs[0])  # the end-of-sequence token is no text
    other = jobs[1].tokens
    assert len(other) == 5 or other[-1] == eos


def test_queue_limit_checks_and_shutdown(gm):
    sink = _Sink()
    b = Batcher(_engine(gm), sink, max_queue=2)  # not started: jobs stay queued
    for bad, msg in ((Job([], 3), "empty"), (Job(list(range(1, 10)), 3), "at most 8"), (Job([1], 0), "max_tokens"),
                     (Job([1, 2], 39), "exceed"), (Job([10**6], 2), "vocabulary"), (Job([1], 2, seed=-1), "seed")):
        with pytest.raises(InputError, match=msg):
            b.submit(bad)
    queued = [Job([1, 2], 3), Job([3], 3)]
    for j in queued:
        b.submit(j)
    with pytest.raises(QueueFull):
        b.submit(Job([4], 3))
    b.start()
    b.shutdown("stopping for the test", wait=10)
    with pytest.raises(ShuttingDown):
        b.submit(Job([5], 3))
    assert all(j.finish in ("error", "length") for j in queued)
    assert not b.thread.is_alive()


def test_admission_leaves_decoding_rows_untouched(gm):
    """The prefill with lengths 0 on a row keeps that row's caches and states bit for bit."""
    e = _engine(gm, batch=2)
    ids = np.zeros((2, 8), np.int64)
    ids[0, :3] = [5, 6, 7]
    e.prefill(ids, np.array([3, 0]))
    for _ in range(3):
        e.decode()
    before = {k: v.copy() for k, v in e.state.items()}
    ids[1, :2] = [8, 9]
    e.prefill(ids, np.array([0, 2]))
    for k, v in e.state.items():
        if k in ("temperature", "top_k", "top_p", "seed"):
            continue
        np.testing.assert_array_equal(v[0], before[k][0], err_msg=k)
    assert e.state["pos"][1] == 2 and not e.state["done"][1]


def test_a_batcher_says_how_it_admits(gm):
    plain = Batcher(_engine(gm), _Sink())
    joins = Batcher(_engine(gm, join=2), _Sink())
    assert plain.admission() == "admits through the prefill" and not plain.joins
    assert joins.admission() == "admits through the prefill; while rows decode, through the join entry (2 a step)"
