"""The admit entry (models/generate.py): a prefill of A prompts into chosen rows of a batch-B
generation plan leaves every state exactly as the masked prefill of the whole batch does, so a
server admitting k rows computes about k rows instead of B (reference backend, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.errors import InputError
from fusec.generation import ReferenceEngine, admit_feeds, admit_rows, sampling_states
from fusec.genmodel import build_graphs, load_generation_model
from fusec.models.generate import GenerationShape
from fusec.sampling import Sampling

B, T, S = 6, 24, 8


@pytest.fixture(scope="module")
def graphs():
    return build_graphs(load_generation_model("qwen3-tiny"), B, T, S, eos_ids=(), admit_batch=2)


def _busy_engine(graphs, sampling: Sampling) -> ReferenceEngine:
    """Every row prefilled and three decode steps in: the state a server admits into."""
    e = ReferenceEngine(graphs)
    e.write_states(sampling_states([sampling] * B, np.arange(B, dtype=np.int64) * 7 + 3))
    rng = np.random.default_rng(0)
    e.prefill(rng.integers(1, 1000, (B, S)), np.array([5, 8, 3, 6, 2, 7]))
    for _ in range(3):
        e.decode()
    return e


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(0.8, 20, 0.9)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("lengths", [[0, 4, 0, 0, 0, 0], [0, 4, 0, 7, 0, 0], [3, 0, 8, 0, 1, 0]],
                         ids=["one-row", "one-run", "two-runs"])
def test_admitting_rows_leaves_the_state_the_prefill_leaves(graphs, sampling, lengths):
    lengths = np.array(lengths, np.int64)
    ids = np.random.default_rng(1).integers(1, 1000, (B, S))
    by_prefill, by_admit = _busy_engine(graphs, sampling), _busy_engine(graphs, sampling)
    by_prefill.prefill(ids, lengths)
    runs = admit_rows(by_admit, ids, lengths)
    assert runs == -(-int((lengths > 0).sum()) // 2)  # every case here computes fewer rows than B
    for name, want in by_prefill.state.items():
        np.testing.assert_array_equal(by_admit.state[name], want, err_msg=name)
    for _ in range(4):  # and the rows go on decoding alike
        by_prefill.decode()
        by_admit.decode()
    np.testing.assert_array_equal(by_admit.state["tokens"], by_prefill.state["tokens"])


class _Recorder:
    def __init__(self, admit_batch: int | None):
        self.meta = {} if admit_batch is None else {"admit_batch": admit_batch}
        self.calls: list[tuple[str, object]] = []

    def prefill(self, ids, lengths, timed=True, measure=False):
        self.calls.append(("prefill", list(lengths)))

    def admit(self, feeds):
        self.calls.append(("admit", list(feeds["row_lengths"])))


@pytest.mark.parametrize("admit_batch,lengths,want", [
    (2, [0, 4, 0, 5], ["admit"]),             # 1 run of 2 rows < 4
    (2, [3, 4, 0, 5], ["prefill"]),           # 2 runs of 2 rows = 4: the prefill is no dearer
    (None, [0, 4, 0, 0], ["prefill"]),        # a plan without an admit entry
    (1, [0, 4, 0, 5], ["admit", "admit"]),    # 2 runs of 1 row < 4
])
def test_admission_runs_the_entry_that_computes_fewer_rows(admit_batch, lengths, want):
    e = _Recorder(admit_batch)
    admit_rows(e, np.ones((4, S), np.int64), np.array(lengths))
    assert [c[0] for c in e.calls] == want
    admitted = [sum(c[1][i] for c in e.calls) for i in range(4)] if want[0] == "admit" else e.calls[0][1]
    assert list(admitted) == lengths  # each admitted row exactly once, with its length


def test_admit_feeds_put_each_prompt_in_a_slot_and_point_its_row_at_it():
    ids = np.arange(4 * 3).reshape(4, 3)
    (f1, f2) = admit_feeds(ids, np.array([2, 0, 3, 1]), 2)
    np.testing.assert_array_equal(f1["input_ids"], ids[[0, 2]])
    np.testing.assert_array_equal(f1["lengths"], [2, 3])
    np.testing.assert_array_equal(f1["row_lengths"], [2, 0, 3, 0])
    np.testing.assert_array_equal(f1["src"][[0, 2]], [0, 1])
    np.testing.assert_array_equal(f2["input_ids"][0], ids[3])
    np.testing.assert_array_equal(f2["lengths"], [1, 0])  # the unused slot computes nothing anyone keeps
    np.testing.assert_array_equal(f2["row_lengths"], [0, 0, 0, 1])


@pytest.mark.parametrize("admit_batch", [-1, 6, 7, True])
def test_admit_batch_must_be_below_the_batch(admit_batch):
    with pytest.raises(InputError, match="admit-batch"):
        GenerationShape(6, 24, 8, admit_batch)


def test_a_plan_with_an_admit_entry_compiles_saves_loads_and_is_checked(tmp_path):
    import json

    import fusec
    from fusec.compiler import compile_generation
    from fusec.plancheck import validate
    from fusec.planfile import PlanFileError

    plan = compile_generation("llama-tiny", batch=4, max_seq_len=24, prefill_len=8, dtype="bf16", arch="sm_90",
                              eos_ids=(), admit_batch=1)
    assert sorted(plan.entries) == ["admit", "decode", "prefill"] and plan.manifest["generation"]["admit_batch"] == 1
    plan.save(tmp_path / "a.fplan")
    assert sorted(fusec.load(tmp_path / "a.fplan").entries) == ["admit", "decode", "prefill"]
    m = json.loads(json.dumps(plan.manifest))
    validate(m, plan.blobs(), "a", fusec.__version__)
    m["generation"]["admit_batch"] = 4  # not below the batch
    with pytest.raises(PlanFileError, match="admit_batch"):
        validate(m, plan.blobs(), "a", fusec.__version__)
    del m["generation"]["admit_batch"]  # an admit entry the record does not declare
    with pytest.raises(PlanFileError, match="entry points"):
        validate(m, plan.blobs(), "a", fusec.__version__)


@pytest.mark.parametrize("argv,message", [
    (["--generate", "--batch", "4", "--admit-batch", "4"], "--admit-batch must be 0 (none) or less than the batch"),
    (["--admit-batch", "1"], "--admit-batch applies to generation plans"),
])
def test_compile_refuses_an_admit_batch_it_cannot_build_in_one_line(capsys, tmp_path, argv, message):
    from fusec.cli import main

    code = main(["compile", "llama-tiny", *argv, "--arch", "sm_90", "-o", str(tmp_path / "g.fplan")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "g.fplan").exists()


@pytest.mark.parametrize("argv,message", [
    (["plan.fplan", "--admit-batch", "1"], "a plan has its entries already"),
    (["llama-tiny", "--batch", "4", "--admit-batch", "4"], "less than the batch (4)"),
    (["llama-tiny", "--admit-batch", "-1"], "less than the batch (8)"),
])
def test_serve_refuses_an_admit_batch_it_cannot_use_in_one_line(capsys, argv, message):
    from fusec.cli import main

    code = main(["serve", *argv, "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
