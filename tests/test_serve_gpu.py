"""Continuous batching on the GPU (fusec.serve.batcher over a PlanEngine; skipped without a GPU):
requests that join mid-flight draw what the reference backend draws for each alone, per-row
sampling settings in one plan, and no host synchronization in decode steps of rows already
decoding (CUPTI counters, where present)."""

from __future__ import annotations

import threading
import time

import pytest

from fusec.generation import ReferenceEngine, generate
from fusec.genmodel import build_graphs, load_generation_model
from fusec.compiler import compile_generation
from fusec.sampling import Sampling
from fusec.serve.batcher import READBACK_EVERY, Batcher, Job

pytestmark = pytest.mark.gpu

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34], [41, 42], [51, 52, 53, 54, 55, 56], [61]]


def _run(engine, jobs, **kw):
    done = threading.Event()
    ended: set[int] = set()

    def sink(events):
        ended.update(id(j) for j, _, fin in events if fin)
        if all(id(j) in ended for j in jobs):
            done.set()

    b = Batcher(engine, sink, max_queue=64, **kw)
    b.start()
    try:
        for j in jobs:
            b.submit(j)
        assert done.wait(120), "jobs did not end"
    finally:
        b.shutdown(wait=30)
    return b


def _alone(gm, prompt, n, sampling=None, seed=0):
    e = ReferenceEngine(build_graphs(gm, 1, 48, 8, eos_ids=[]), optimize=True)
    return generate(e, [prompt], n, gm.config.vocab_size, seed=seed, sampling=sampling).new_ids[0]


@pytest.mark.parametrize("admit_batch,join,every", [(0, 0, 1), (1, 0, 1), (0, 1, 1), (0, 2, 1), (0, 2, 3)],
                         ids=["prefill", "admit-entry", "join-entry", "join-entry-2", "join-2-read-every-3"])
def test_requests_joining_mid_flight_draw_what_they_draw_alone(admit_batch, join, every):
    """Rows join through the whole-batch prefill, the admit entry (one prompt a run), or the join
    entry (one or two prompts riding in a decode step); tokens read back every step or every three."""
    from fusec.runtime.generation import PlanEngine

    gm = load_generation_model("qwen3-tiny")
    plan = compile_generation(gm, batch=3, max_seq_len=48, prefill_len=8, dtype="fp32", eos_ids=[],
                              admit_batch=admit_batch, join=join)
    cut = Sampling(0.9, 30, 0.9)
    jobs = [Job(p, 8 + 5 * i, cut if i % 2 else Sampling(), seed=100 + i) for i, p in enumerate(PROMPTS)]
    b = _run(PlanEngine(plan), jobs, lookahead=3, readback_every=every)
    for i, j in enumerate(jobs):
        assert j.finish == "length", (i, j.finish, j.error)
        assert j.tokens == _alone(gm, j.prompt_ids, j.max_tokens, j.sampling, j.seed), i
    assert b.counts["admissions"] + b.counts["joins"] >= 2  # later jobs came in mid-flight
    assert (b.counts["admit_runs"] > 0) == bool(admit_batch)
    assert (b.counts["joins"] > 0) == bool(join)


@pytest.mark.parametrize("every", [1, READBACK_EVERY])
def test_decode_steps_of_rows_already_decoding_do_not_synchronize(every: int):
    from fusec.runtime.generation import PlanEngine

    plan = compile_generation("llama-tiny", batch=4, max_seq_len=96, prefill_len=8, dtype="bf16", eos_ids=[])
    engine = PlanEngine(plan)
    if not engine.device.counters.available:
        pytest.skip(f"driver counters unavailable: {engine.device.counters.reason}")
    jobs = [Job([5, 6, 7], 60), Job([8, 9], 60), Job([1], 40), Job([2, 3, 4], 50)]
    t0 = time.perf_counter()
    b = _run(engine, jobs, counters=True, readback_every=every)
    assert all(j.finish == "length" for j in jobs), time.perf_counter() - t0
    st = b.stats()["decode_driver"]
    assert st["steps"] >= 40
    per = st["per_step"]
    assert per["syncs"] == 0 and per["allocations"] == 0 and per["h2d_bytes"] == 0, st
    assert per["graph_launches"] == 1 and per["kernel_launches"] == 0, st
    if every == 1:
        assert per["d2h_bytes"] == 4 * 8  # the drawn tokens, read back asynchronously
    else:  # the tokens state [4, 96] of int64, read back once every `every` steps
        assert 0 < per["d2h_bytes"] <= 4 * 96 * 8 / every, st
    assert b.counts["admissions"] >= 1 and b.counts["admit_syncs"] == 0  # admissions queue behind the steps
