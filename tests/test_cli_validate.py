"""`fusec run` validation like polygraphy/trtexec (issue 11 item 3): --check against the reference or
onnxruntime, --atol/--rtol, a per-output error table, exit 3 on a mismatch, --save-inputs,
--compare OUT.npz, shapes taken from --inputs."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from test_cli import call, no_gpu, tiny_onnx  # noqa: F401 -- no_gpu: a fixture used by pytestmark

from fusec.cli import _validate

pytestmark = pytest.mark.usefixtures("no_gpu")


def table_rows(out: str, against: str) -> dict[str, list[str]]:
    """{output: [shape, max abs, max rel, mismatches, result...]} of the table checked against ``against``."""
    block = out.split(f"check against {against} (")[1].splitlines()[1:]
    assert block[0].split() == ["output", "shape", "max", "abs", "err", "max", "rel", "err", "mismatches", "result"]
    rows = {}
    for ln in block[1:]:
        if not ln.startswith("  "):
            break
        cells = ln.split()
        rows[cells[0]] = cells[1:]
    return rows


def test_check_against_the_reference_prints_a_table_and_passes(capsys) -> None:
    code, out, err = call(capsys, ["run", "bert-tiny", "--backend", "reference", "--check"])
    assert code == 0, err
    rows = table_rows(out, "the numpy reference (fp32)")
    assert set(rows) == {"last_hidden_state"}
    shape, max_abs, max_rel, mismatches, result = rows["last_hidden_state"]
    n = int(np.prod([int(d) for d in shape.split("x")]))
    assert mismatches == f"0/{n}" and result == "ok" and float(max_abs) < 1e-4


def test_a_mismatch_exits_3_with_one_line_and_counts_like_numpy(capsys, tmp_path) -> None:
    want, got, inputs = tmp_path / "want.npz", tmp_path / "got.npz", tmp_path / "in.npz"
    code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--save-inputs", str(inputs),
                                 "--save-outputs", str(want)])
    assert code == 0, err
    atol, rtol = 1e-3, 1e-3
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--dtype", "bf16", "--inputs", str(inputs),
                                   "--compare", str(want), "--atol", str(atol), "--rtol", str(rtol),
                                   "--save-outputs", str(got)])
    assert code == 3
    errors = [ln for ln in err.splitlines() if ln.startswith("fusec: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"fusec: error: an output differs from {want} beyond atol 0.001 + "
                                                     "rtol 0.001 * |want|: logits (")
    with np.load(want) as a, np.load(got) as b:
        w = a["logits"].astype(np.float64)
        g = b["logits"].view(__import__("ml_dtypes").bfloat16).astype(np.float64) if b["logits"].dtype == "V2" \
            else b["logits"].astype(np.float64)
    expected_bad = int((np.abs(g - w) > atol + rtol * np.abs(w)).sum())
    assert expected_bad > 0
    shape, max_abs, _, mismatches, result = table_rows(out, str(want))["logits"]
    assert mismatches == f"{expected_bad}/{w.size}" and result == "FAIL"
    assert float(max_abs) == pytest.approx(np.abs(g - w).max(), rel=1e-3)
    assert f"({expected_bad} of {w.size} elements)" in errors[0]
    # the default bf16 tolerance accepts the same outputs
    code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--dtype", "bf16", "--inputs", str(inputs),
                                 "--compare", str(want)])
    assert code == 0, err


def test_save_inputs_then_inputs_reproduces_the_outputs(capsys, tmp_path) -> None:
    ins, a, b = tmp_path / "in.npz", tmp_path / "a.npz", tmp_path / "b.npz"
    assert call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--seed", "7", "--save-inputs", str(ins),
                         "--save-outputs", str(a)])[0] == 0
    assert call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--inputs", str(ins), "--save-outputs", str(b)])[0] == 0
    with np.load(ins) as i:
        assert sorted(i.files) == ["attention_mask", "input_ids"]
    with np.load(a) as x, np.load(b) as y:
        np.testing.assert_array_equal(x["logits"], y["logits"])
    code, out, _ = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--inputs", str(ins), "--compare", str(a),
                                 "--atol", "0", "--rtol", "0"])
    assert code == 0 and table_rows(out, str(a))["logits"][3] == "0/16000"


def test_shapes_come_from_the_inputs_file(capsys, tmp_path) -> None:
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), path)  # dynamic [batch, seq]: needs shapes
    np.savez(tmp_path / "in.npz", input_ids=np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], np.int64),
             attention_mask=np.ones((2, 5), np.int64))
    code, out, err = call(capsys, ["run", str(path), "--inputs", str(tmp_path / "in.npz")])
    assert code == 0, err
    assert any(ln.startswith("output probs  f32[2,5,4]") for ln in out.splitlines())
    # a built-in model too: its default 1x16 gives way to the file's 2x8
    np.savez(tmp_path / "g.npz", input_ids=np.zeros((2, 8), np.int64), attention_mask=np.ones((2, 8), np.int64))
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--inputs", str(tmp_path / "g.npz")])
    assert code == 0, err
    assert any(ln.startswith("output logits  f32[2,8,1000]") for ln in out.splitlines())


def test_check_ort_compares_with_onnxruntime(capsys, tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), path)
    code, out, err = call(capsys, ["run", str(path), "--shapes", "input_ids:2x3,attention_mask:2x3", "--check", "ort"])
    assert code == 0, err
    assert table_rows(out, "onnxruntime")["probs"][3:5] == ["0/24", "ok"]
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--check", "ort"])  # exported for ORT
    assert code == 0, err
    assert table_rows(out, "onnxruntime")["logits"][3:5] == ["0/16000", "ok"]


def test_check_ort_without_onnxruntime_is_one_line(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--check", "ort"])
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("fusec: error: --check ort needs onnxruntime, which is not installed: pip install onnxruntime")


def test_compare_with_a_file_missing_an_output_fails(capsys, tmp_path) -> None:
    np.savez(tmp_path / "other.npz", something_else=np.zeros(3, np.float32))
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--compare", str(tmp_path / "other.npz")])
    assert code == 3 and "logits (not in the yardstick)" in err
    assert " ".join(table_rows(out, str(tmp_path / "other.npz"))["logits"][4:]) == "FAIL (not in the yardstick)"


@pytest.mark.parametrize("argv, needle", [
    (["--atol", "-1"], "--atol must be a finite number >= 0, got -1.0"),
    (["--rtol", "nan"], "--rtol must be a finite number >= 0, got nan"),
])
def test_bad_tolerances_are_one_line(capsys, argv, needle) -> None:
    code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--check", *argv])
    assert code == 1 and err == f"fusec: error: {needle}\n"


def test_compare_file_that_is_not_an_npz_is_one_line(capsys, tmp_path) -> None:
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--compare", str(tmp_path / "bad.npz")])
    assert code == 1 and out == "" and err.startswith("fusec: error: --compare file ") and err.count("\n") == 1


def test_element_comparison_rules() -> None:
    nan, inf = float("nan"), float("inf")
    d = _validate.compare_one("x", np.array([1.0, nan, inf, 2.0]), np.array([1.0, nan, inf, 2.5]), 0.1, 0.1)
    assert (d.mismatches, d.total, d.max_abs) == (1, 4, 0.5)  # NaN == NaN, inf == inf; |2 - 2.5| > 0.1 + 0.25
    d = _validate.compare_one("x", np.array([1.0, nan]), np.array([1.0, 1.0]), 1.0, 1.0)
    assert d.mismatches == 1 and not d.ok
    d = _validate.compare_one("ids", np.array([1, 2, 3]), np.array([1, 2, 4]), 10.0, 10.0)
    assert d.mismatches == 1  # integers compare exactly, whatever the tolerance
    d = _validate.compare_one("x", np.zeros((2, 3)), np.zeros((3, 2)), 1.0, 1.0)
    assert not d.ok and d.problem == "shape (2, 3) vs (3, 2)"
    d = _validate.compare_one("x", np.array([0.0, 1.1]), np.array([0.0, 1.0]), 0.0, 0.2)
    assert d.ok and d.max_rel == pytest.approx(0.1)


# ---- on the GPU ------------------------------------------------------------------------------------
_REAL_GPU_AVAILABLE = __import__("fusec.device", fromlist=["gpu_available"]).gpu_available


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_cuda_run_check_agrees_with_the_reference(capsys, monkeypatch, dtype) -> None:
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", _REAL_GPU_AVAILABLE)
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--dtype", dtype, "--check", "--stats"])
    assert code == 0, err
    assert f"backend cuda  dtype {dtype}" in out.splitlines()[0]
    assert table_rows(out, "the numpy reference (fp32)")["logits"][3:5] == ["0/16000", "ok"]
    assert any(ln.startswith("stats  ") for ln in out.splitlines())


@pytest.mark.gpu
def test_a_plan_checks_against_its_source_and_compares_with_saved_outputs(capsys, monkeypatch, tmp_path) -> None:
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", _REAL_GPU_AVAILABLE)
    plan, ins, want = tmp_path / "g.fplan", tmp_path / "in.npz", tmp_path / "want.npz"
    assert call(capsys, ["compile", "gpt2-tiny", "--dtype", "fp16", "-o", str(plan)])[0] == 0
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--seed", "3", "--save-inputs", str(ins),
                                   "--save-outputs", str(want)])
    assert code == 0, err
    code, out, err = call(capsys, ["run", str(plan), "--inputs", str(ins), "--check", "--compare", str(want)])
    assert code == 0, err
    assert table_rows(out, "the numpy reference (fp32)")["logits"][4] == "ok"
    assert table_rows(out, str(want))["logits"][4] == "ok"
    code, out, err = call(capsys, ["run", str(plan), "--inputs", str(ins), "--compare", str(want), "--atol", "0",
                                   "--rtol", "0"])
    assert code == 3 and "an output differs from" in err  # fp16 on the GPU is not bit-equal to fp32 numpy


@pytest.mark.parametrize("dtype", [np.int64, np.bool_, np.uint64])
def test_an_integer_yardstick_for_float_outputs_is_a_dtype_problem_not_a_pass(capsys, tmp_path, dtype) -> None:
    """It used to cast both sides to integers: logits of +-0.7 truncated to 0 'matched' zeros."""
    saved = tmp_path / "out.npz"
    assert call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--save-outputs", str(saved)])[0] == 0
    logits = np.load(saved)["logits"]
    np.savez(tmp_path / "zeros.npz", logits=np.zeros(logits.shape, dtype))
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--compare", str(tmp_path / "zeros.npz")])
    assert code == 3 and f"logits (dtype float32 vs {np.dtype(dtype).name})" in err
    d = _validate.compare_one("ids", np.array([1, 2], np.int32), np.array([1, 2], np.int64), 0.0, 0.0)
    assert d.ok  # integers of two widths still compare by value


def test_compare_reads_only_the_outputs_and_checks_every_header_first(capsys, tmp_path, monkeypatch) -> None:
    """A member the run does not produce is never inflated; one beyond the byte limit is refused by
    its header before the run; non-numeric arrays are refused in one line."""
    saved = tmp_path / "out.npz"
    call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--save-outputs", str(saved)])
    logits = np.load(saved)["logits"]
    np.savez_compressed(tmp_path / "extra.npz", logits=logits, junk=np.zeros((1000, 1000)))
    monkeypatch.setenv("FUSEC_MAX_BYTES", str(4_000_000))  # junk: 8 MB
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--compare", str(tmp_path / "extra.npz")])
    assert code == 1 and out == "" and "output 'junk' needs 8000000 bytes" in err and "FUSEC_MAX_BYTES" in err
    monkeypatch.delenv("FUSEC_MAX_BYTES")
    read: list[str] = []
    real = _validate.load_npz

    def spy(path, what, names=None):  # noqa: ANN001, ANN202
        got = real(path, what, names)
        read.extend(got)
        return got

    monkeypatch.setattr(_validate, "load_npz", spy)
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--compare", str(tmp_path / "extra.npz")])
    assert code == 0, err
    assert read == ["logits"]  # junk's header was checked, its 8 MB never inflated
    np.savez(tmp_path / "text.npz", logits=np.array(["a"]))
    code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--compare", str(tmp_path / "text.npz")])
    assert code == 1 and err.count("\n") == 1 and "output 'logits' has dtype '<U1'; fusec reads numeric arrays only" in err
