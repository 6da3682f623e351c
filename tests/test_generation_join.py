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


@pytest.fixture(scope="module", params=["qwen3-tiny", "llama-tiny"])
def graphs(request):
    return build_graphs(load_generation_model(request.param), B, T, S, eos_ids=(), join=True)


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
@pytest.mark.parametrize("row,prompt", [(1, [11, 12, 13, 14]), (4, list(range(21, 29))), (0, [7])],
                         ids=["short", "full-length", "one-token"])
def test_a_join_is_a_decode_step_and_the_new_rows_prefill(graphs, sampling, row, prompt):
    by_steps, by_join = _busy_engine(graphs, sampling), _busy_engine(graphs, sampling)
    old = int(by_steps.state["pos"][row])
    by_steps.decode()
    lengths = np.zeros(B, np.int64)
    lengths[row] = len(prompt)
    ids = np.zeros((B, S), np.int64)
    ids[row, :len(prompt)] = prompt
    by_steps.prefill(ids, lengths)
    by_join.join(join_feeds(prompt, row, S))
    # what differs is the old request's throw-away step in the joined row: the token it drew at
    # old + 1 (the join records none) and, past the prompt, the keys/values it wrote at old (the
    # join's attention for it already sees the prompt's); no step reads either before rewriting it
    if old + 1 != len(prompt):
        by_steps.state["tokens"][row, old + 1] = by_join.state["tokens"][row, old + 1]
    if old >= S:
        for name in by_steps.state:
            if name[:2] in ("k.", "v."):
                by_steps.state[name][row, :, old] = by_join.state[name][row, :, old]
    for name, want in by_steps.state.items():
        if want.dtype.kind == "f":  # the products run over B + S rows instead of B, then B x S: fp32 rounding
            np.testing.assert_allclose(by_join.state[name], want, rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(by_join.state[name], want, err_msg=name)
    assert by_join.state["pos"][row] == len(prompt)
    for _ in range(4):  # and every row goes on decoding alike
        by_steps.decode()
        by_join.decode()
    np.testing.assert_array_equal(by_join.state["tokens"], by_steps.state["tokens"])


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
                 "--join", "--arch", "sm_90", "-o", str(out)]) == 0
    plan = fusec.load(out)
    assert sorted(plan.entries) == ["decode", "join", "prefill"] and plan.manifest["generation"]["join"] is True
    assert [d["name"] for d in plan.manifest["entries"]["join"]["inputs"]] == ["input_ids", "lengths", "row"]
    m = json.loads(json.dumps(plan.manifest))
    m["generation"]["join"] = "yes"
    with pytest.raises(PlanFileError, match="generation.join"):
        validate(m, plan.blobs(), "j", fusec.__version__)
    del m["generation"]["join"]  # a join entry the record does not declare
    with pytest.raises(PlanFileError, match="entry points"):
        validate(m, plan.blobs(), "j", fusec.__version__)


@pytest.mark.parametrize("argv,message", [
    (["compile", "llama-tiny", "--join", "--arch", "sm_90", "-o", "x.fplan"], "--join applies to generation plans"),
    (["serve", "plan.fplan", "--join", "--port", "0"], "a plan has its entries already"),
])
def test_join_is_refused_where_it_cannot_apply_in_one_line(capsys, tmp_path, monkeypatch, argv, message):
    from fusec.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "x.fplan").exists()
