"""Per-row generation state on the CPU (reference backend): every row samples with its own
settings and seed, read from the plan's state (nothing about sampling is compiled in), and a
row's tokens depend on nothing but its own prompt, settings and seed."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.errors import InputError
from fusec.generation import ReferenceEngine, generate
from fusec.genmodel import build_graphs, load_generation_model
from fusec.compiler import compile_generation
from fusec.sampling import Sampling, row_seeds, sample

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23], [31, 32, 33, 34]]
CUT = Sampling(0.8, 20, 0.9)


@pytest.fixture(scope="module")
def gm():
    return load_generation_model("qwen3-tiny")


def test_each_row_draws_with_its_own_settings():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((5, 700)).astype(np.float32) * 2
    temps = np.array([0.0, 0.8, 0.7, 1.0, 0.0], np.float32)
    ks = np.array([0, 0, 30, 0, 9], np.int64)
    ps = np.array([1.0, 1.0, 0.9, 0.5, 0.3], np.float32)
    seeds, ctr = rng.integers(0, 2**62, 5), rng.integers(0, 1000, 5)
    got = sample(logits, seeds, ctr, temps, ks, ps)
    for b in range(5):  # each row alone, and in another row of another batch: the same token
        alone = sample(logits[b:b + 1], seeds[b:b + 1], ctr[b:b + 1], temps[b], ks[b], ps[b])
        assert alone[0] == got[b]
        moved = sample(logits[[b, b]][::-1], seeds[[b, b]], ctr[[b, b]], temps[[b, b]], ks[[b, b]], ps[[b, b]])
        assert (moved == got[b]).all()
    greedy = temps == 0
    assert (got[greedy] == logits[greedy].argmax(1)).all()  # greedy: exactly argmax, whatever top_k/top_p say
    assert (sample(logits, seeds + 1, ctr, temps, ks, ps)[~greedy] != got[~greedy]).any()


def test_row_seeds_keep_row_zero():
    s = row_seeds(7, 4)
    assert s.dtype == np.int64 and s[0] == 7 and len(set(s.tolist())) == 4
    assert (row_seeds(2**63 - 1, 3)[1:] != row_seeds(2**63 - 2, 3)[1:]).all()


def test_mixed_batch_rows_generate_as_alone(gm):
    """One batch, rows with different settings: the greedy rows generate exactly what an all-greedy
    batch does; the sampled row is reproducible by seed."""
    vocab = gm.config.vocab_size
    three = ReferenceEngine(build_graphs(gm, 3, 24, 8, eos_ids=[]))
    mixed = generate(three, PROMPTS, 10, vocab, seed=9, sampling=[Sampling(), CUT, Sampling()]).new_ids
    greedy = generate(three, PROMPTS, 10, vocab).new_ids
    assert mixed[0] == greedy[0] and mixed[2] == greedy[2]
    assert mixed[1] != greedy[1]
    again = generate(three, PROMPTS, 10, vocab, seed=9, sampling=[Sampling(), CUT, Sampling()]).new_ids
    assert again == mixed
    assert generate(three, PROMPTS, 10, vocab, seed=10, sampling=[Sampling(), CUT, Sampling()]).new_ids[1] != mixed[1]


def test_row_zero_draws_what_its_seed_draws_alone(gm):
    vocab = gm.config.vocab_size
    three = ReferenceEngine(build_graphs(gm, 3, 24, 8, eos_ids=[]))
    one = ReferenceEngine(build_graphs(gm, 1, 24, 8, eos_ids=[]))
    batch = generate(three, PROMPTS, 8, vocab, seed=41, sampling=CUT).new_ids
    assert generate(one, PROMPTS[:1], 8, vocab, seed=41, sampling=CUT).new_ids[0] == batch[0]


def test_sampling_settings_are_checked():
    for bad in ({"temperature": -0.5}, {"temperature": float("nan")}, {"temperature": 1e-40},
                {"top_k": -1}, {"top_k": 1.5}, {"top_p": 0.0}, {"top_p": 1.01}, {"temperature": True}):
        with pytest.raises(InputError, match="sampling"):
            Sampling(**bad)
    gm = load_generation_model("llama-tiny")
    engine = ReferenceEngine(build_graphs(gm, 2, 16, 4, eos_ids=[]))
    with pytest.raises(InputError, match="one per prompt"):
        generate(engine, [[1], [2]], 2, gm.config.vocab_size, sampling=[Sampling()])


def test_a_half_precision_plan_keeps_the_settings_exact():
    """bf16 storage: the temperature and top-p states stay fp32 (0.7 would be 0.69921875 in bf16),
    the settings are states (not compiled in), and the prefill takes the row lengths."""
    plan = compile_generation("llama-tiny", batch=2, max_seq_len=16, prefill_len=4, dtype="bf16", arch="sm_90")
    m = plan.manifest
    state = {r["name"]: r for r in m["state"]}
    assert state["temperature"]["dtype"] == state["top_p"]["dtype"] == "f32" and state["k.0"]["dtype"] == "bf16"
    assert state["seed"]["shape"] == state["top_k"]["shape"] == [2]
    assert "sampling" not in m["generation"]
    assert [i["name"] for i in m["entries"]["prefill"]["inputs"]] == ["input_ids", "lengths"]
