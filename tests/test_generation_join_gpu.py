"""The join entry on the GPU (models/join.py; skipped without a GPU): an fp32 plan's join step and
the decode steps after it draw exactly the reference backend's tokens, and leave its positions."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.compiler import compile_generation
from fusec.generation import ReferenceEngine, join_feeds, sampling_states
from fusec.genmodel import build_graphs, load_generation_model
from fusec.sampling import Sampling

pytestmark = pytest.mark.gpu

B, T, S = 4, 48, 8


@pytest.mark.parametrize("model,slots", [("qwen3-tiny", 1), ("llama-tiny", 1), ("qwen3-tiny", 3)],
                         ids=["qwen3-J1", "llama-J1", "qwen3-J3"])
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, 20, 0.9)], ids=["greedy", "sampled"])
def test_join_steps_draw_the_reference_tokens(model, slots, sampling):
    from fusec.runtime.generation import PlanEngine

    gm = load_generation_model(model)
    plan = PlanEngine(compile_generation(gm, batch=B, max_seq_len=T, prefill_len=S, dtype="fp32", eos_ids=[],
                                         join=slots))
    ref = ReferenceEngine(build_graphs(gm, B, T, S, eos_ids=[], join=slots))
    rng = np.random.default_rng(3)
    ids = rng.integers(1, gm.config.vocab_size, (B, S))
    states = sampling_states([sampling] * B, np.arange(B, dtype=np.int64) * 5 + 1)
    for e in (plan, ref):
        e.write_states(states)
        e.prefill(ids, np.array([5, 8, 3, 6]), timed=False)
        for _ in range(3):
            e.decode()
        e.join(join_feeds([(2, [9, 8, 7, 6, 5])], S, slots))  # row 2 takes a new prompt mid-flight
        e.decode()
        e.join(join_feeds([(0, [4]), (3, [1, 2, 3, 4, 5, 6, 7, 8])][:slots], S, slots))
        for _ in range(3):
            e.decode()
    for name in ("tokens", "pos", "done"):
        np.testing.assert_array_equal(plan.read_state(name), ref.read_state(name), err_msg=name)
