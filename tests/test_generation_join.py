"""The join entry (models/join.py): one decode step of every row that also prefills a new prompt
into a free row leaves the states a decode step followed by that row's prefill leaves (reference
backend, CPU; the caches to fp32 rounding, every token exactly): the other rows advance one token, the new row starts as the prefill starts it."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.errors import InputError
from fusec.generation import ReferenceEngine, join_feeds, sampling_states
from fusec.genmodel import build_graphs, load_generation_model
from fusec.sampling import Sampling

B, T, S = 5, 24, 8


@pytest.fixture(scope="module", params=[("qwen3-tiny", 1), ("llama-tiny", 1), ("qwen3-tiny", 3)],
                ids=["qwen3-J1", "llama-J1", "qwen3-J3"])
def graphs(request):
    name, slots = request.param
    return build_graphs(load_generation_model(name), B, T, S, eos_ids=(), join=slots)


def _busy_engine(graphs, sampling: Sampling) -> ReferenceEngine:
    """Every row prefilled and three decode steps in: the state a server admits into."""
    e = ReferenceEngine(graphs)
    e.write_states(sampling_states([sampling] * B, np.arange(B, dtype=np.int64) * 7 + 3))
    rng = np.random.default_rng(0)
    e.prefill(rng.integers(1, 1000, (B, S)), np.array([5, 8, 3, 6, 2]))
    for _ in range(3):
        e.decode()
    return e


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, 20, 0.9)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("joining", [[(1, [11, 12, 13, 14])], [(4, list(range(21, 29)))], [(0, [7])],
                                     [(3, [5, 6, 7]), (1, list(range(30, 38)))],
                                     [(2, [9]), (0, [40, 41]), (4, [50, 51, 52, 53, 54])]],
                         ids=["short", "full-length", "one-token", "two", "three"])
def test_a_join_is_a_decode_step_and_the_new_rows_prefill(graphs, sampling, joining):
    slots = graphs["join"].meta["generation"]["join"]
    if len(joining) > slots:
        with pytest.raises(InputError, match="prompts for a join entry"):
            join_feeds(joining, S, slots)
        return
    by_steps, by_join = _busy_engine(graphs, sampling), _busy_engine(graphs, sampling)
    old = {row: int(by_steps.state["pos"][row]) for row, _ in joining}
    by_steps.decode()
    lengths = np.zeros(B, np.int64)
    ids = np.zeros((B, S), np.int64)
    for row, prompt in joining:
        lengths[row] = len(prompt)
        ids[row, :len(prompt)] = prompt
    by_steps.prefill(ids, lengths)
    by_join.join(join_feeds(joining, S, slots))
    # what differs is the old request's throw-away step in a joined row: the token it drew at
    # old + 1 (the join records none) and, past the prompt, the keys/values it wrote at old (the
    # join's attention for it already sees the prompt's); no step reads either before rewriting it
    for row, prompt in joining:
        if old[row] + 1 != len(prompt):
            by_steps.state["tokens"][row, old[row] + 1] = by_join.state["tokens"][row, old[row] + 1]
        if old[row] >= S:
            for name in by_steps.state:
                if name[:2] in ("k.", "v."):
                    by_steps.state[name][row, :, old[row]] = by_join.state[name][row, :, old[row]]
    for name, want in by_steps.state.items():
        if want.dtype.kind == "f":  # the products run over B + J*S rows instead of B, then B x S: fp32 rounding
            np.testing.assert_allclose(by_join.state[name], want, rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(by_join.state[name], want, err_msg=name)
    assert [by_join.state["pos"][row] for row, _ in joining] == [len(p) for _, p in joining]
    for _ in range(4):  # and every row goes on decoding alike
        by_steps.decode()
        by_join.decode()
    np.testing.assert_array_equal(by_join.state["tokens"], by_steps.state["tokens"])


def test_join_feeds_refuses_what_the_entry_cannot_take():
    with pytest.raises(InputError, match="distinct rows"):
        join_feeds([(1, [3]), (1, [4])], S, 2)
    with pytest.raises(InputError, match="1 to 8"):
        join_feeds([(1, list(range(9)))], S, 1)
    feeds = join_feeds([(2, [5, 6])], S, 3)  # one prompt, two empty slots
    assert feeds["lengths"].tolist() == [2, 0, 0] and feeds["row"][0] == 2 and feeds["input_ids"].shape == (3, S)


def test_a_model_exported_with_its_cache_has_no_join_entry(tmp_path):
    gm = load_generation_model("llama-tiny")
    gm.builder = lambda shape, eos: {}  # what an ONNX export with its KV cache brings
    with pytest.raises(InputError, match="join entry"):
        build_graphs(gm, B, T, S, join=True)


def test_a_plan_with_a_join_entry_compiles_from_the_cli_saves_loads_and_is_checked(tmp_path):
    import json

    import fusec
    from fusec.cli import main
    from fusec.plancheck import validate
    from fusec.planfile import PlanFileError

    out = tmp_path / "j.fplan"
    assert main(["compile", "llama-tiny", "--generate", "--batch", "3", "--max-seq-len", "24", "--max-prompt-len", "8",
                 "--join", "2", "--arch", "sm_90", "-o", str(out)]) == 0
    plan = fusec.load(out)
    assert sorted(plan.entries) == ["decode", "join", "prefill"] and plan.manifest["generation"]["join"] == 2
    assert [(d["name"], d["shape"]) for d in plan.manifest["entries"]["join"]["inputs"]] == \
        [("input_ids", [2, 8]), ("lengths", [2]), ("row", [2])]
    m = json.loads(json.dumps(plan.manifest))
    for bad in ("yes", 0, 4):  # a count of prompts, 1 to the batch
        m["generation"]["join"] = bad
        with pytest.raises(PlanFileError, match="generation.join"):
            validate(m, plan.blobs(), "j", fusec.__version__)
    m["generation"]["join"] = True  # as fusec wrote a one-prompt join entry before counts: not this one's
    with pytest.raises(PlanFileError, match="input 'row' is \\[2\\]"):
        validate(m, plan.blobs(), "j", fusec.__version__)
    del m["generation"]["join"]  # a join entry the record does not declare
    with pytest.raises(PlanFileError, match="entry points"):
        validate(m, plan.blobs(), "j", fusec.__version__)


@pytest.mark.parametrize("argv,message", [
    (["compile", "llama-tiny", "--join", "--arch", "sm_90", "-o", "x.fplan"], "--join applies to generation plans"),
    (["serve", "plan.fplan", "--join", "--port", "0"], "a plan has its entries already"),
    (["compile", "llama-tiny", "--generate", "--batch", "2", "--join", "3", "--arch", "sm_90", "-o", "x.fplan"],
     "--join must be 0 (none) or 1 to the batch (2)"),
    (["serve", "llama-tiny", "--batch", "2", "--join", "3", "--port", "0"], "--join must be 0 (none) or 1 to the batch"),
])
def test_join_is_refused_where_it_cannot_apply_in_one_line(capsys, tmp_path, monkeypatch, argv, message):
    from fusec.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x.fplan").exists()


def test_serve_compiles_a_join_entry_of_two_by_default_where_one_can_be_built():
    from fusec.cli.serve import join_prompts

    gm = load_generation_model("llama-tiny")
    assert join_prompts(None, gm, 8) == 2 and join_prompts(None, gm, 1) == 1  # at most the batch
    assert join_prompts(0, gm, 8) == 0 and join_prompts(3, gm, 8) == 3  # as given
    gm.builder = lambda shape, eos: {}  # an ONNX export with its KV cache: none by default
    assert join_prompts(None, gm, 8) == 0


def test_the_join_step_under_its_memory_plan_with_concat_inputs_in_place():
    """The optimized join graph run with every value at its planned arena slot (its concat inputs
    written in their blocks of the concat's output: no copies) gives the unplanned reference's
    results, bit for bit."""
    from fusec import reference
    from fusec.passes.base import PassOptions
    from fusec.passes.memory_plan import plan_memory
    from fusec.passes.pipeline import optimize

    gs = build_graphs(load_generation_model("qwen3-tiny"), B, T, S, eos_ids=(), join=2)
    e = _busy_engine(gs, Sampling(0.8, 20, 0.9))
    g, _ = optimize(gs["join"], PassOptions())
    feeds = {**join_feeds([(1, [11, 12, 13, 14]), (3, [5, 6])], S, 2), **e.state}
    feeds = {v.name: feeds[v.name] for v in g.inputs}
    plan = plan_memory(g)
    assert sum(a["kind"] == "concat" for a in plan.alias.values()) >= 2 * load_generation_model("qwen3-tiny").config.num_layers
    got, want = reference.run_planned(g, feeds, plan), reference.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
