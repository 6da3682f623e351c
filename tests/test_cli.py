"""The command line on good input: every command's --help, models, inspect, run, export-model.

Commands run in-process through ``fusec.cli.main`` (fast); tests/test_packaging.py runs the
installed executable.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from fusec import device, reference
from fusec.cli import COMMANDS, main, one_line, print_error
from fusec.cli import run as run_cmd
from fusec.inputs import random_inputs
from fusec.loader import load_graph

WEIRD_IN = 'in"put\'s\nname é'
WEIRD_OUT = "out\r\nput ✓ \"q\""


def tiny_onnx(vocab: int = 11, dim: int = 8, out: int = 4) -> onnx.ModelProto:
    """Token ids [batch, seq] (dynamic) -> embedding gather -> mask -> matmul -> softmax."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((vocab, dim)).astype(np.float32), "wte"),
        numpy_helper.from_array(rng.standard_normal((dim, out)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
    ]
    nodes = [
        helper.make_node("Gather", ["wte", "input_ids"], ["emb"], axis=0),
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "last_axis"], ["mask_u"]),
        helper.make_node("Mul", ["emb", "mask_u"], ["masked"]),
        helper.make_node("MatMul", ["masked", "w"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", "seq", out])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def weird_names_onnx() -> onnx.ModelProto:
    """Static [2, 3] float input and output whose names hold quotes, newlines and non-ASCII."""
    graph = helper.make_graph(
        [helper.make_node("Relu", [WEIRD_IN], ["mid\nvalue"], name="node\n\"1\""),
         helper.make_node("Neg", ["mid\nvalue"], [WEIRD_OUT])],
        "weird\ngraph",
        [helper.make_tensor_value_info(WEIRD_IN, TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(WEIRD_OUT, TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def call(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_available", lambda: False)


# ---------------------------------------------------------------------------------------------
# help and registration


def test_every_command_has_help_with_an_example(capsys) -> None:
    code, out, _ = call(capsys, ["--help"])
    assert code == 0
    names = [m.replace("_", "-") for m in COMMANDS]
    for name in names:
        assert name in out
    for name in names:
        code, out, err = call(capsys, [name, "--help"])
        assert code == 0, name
        assert out.startswith(f"usage: fusec {name}"), name
        assert "examples:" in out and f"fusec {name}" in out.split("examples:")[1], name
        assert err == ""


def test_version(capsys) -> None:
    code, out, _ = call(capsys, ["--version"])
    assert code == 0 and out.startswith("fusec 0.")


def test_each_command_module_has_the_command_interface() -> None:
    import importlib

    for name in COMMANDS:
        module = importlib.import_module(f"fusec.cli.{name}")
        assert callable(module.add_parser) and callable(module.run), name


# ---------------------------------------------------------------------------------------------
# models


def test_models_lists_every_builtin_with_description_and_shapes(capsys) -> None:
    import fusec.models

    code, out, _ = call(capsys, ["models"])
    assert code == 0
    lines = out.splitlines()
    assert [ln.split()[0] for ln in lines] == fusec.models.names()
    assert "input_ids:1x16" in next(ln for ln in lines if ln.startswith("gpt2-tiny "))

    code, out, _ = call(capsys, ["models", "--json"])
    rows = json.loads(out)["models"]
    assert [r["name"] for r in rows] == fusec.models.names()
    tiny = next(r for r in rows if r["name"] == "gpt2-tiny")
    assert tiny["description"] and tiny["default_shapes"]["input_ids"] == [1, 16]


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_json_builtin(capsys) -> None:
    code, out, err = call(capsys, ["inspect", "gpt2-tiny", "--json"])
    assert code == 0 and err == ""
    report = json.loads(out)  # exactly one JSON object: json.loads rejects trailing text
    graph = load_graph("gpt2-tiny")
    assert report["model"] == "gpt2-tiny"
    assert report["inputs"] == [{"name": "input_ids", "shape": [1, 16], "dtype": "i64"},
                                {"name": "attention_mask", "shape": [1, 16], "dtype": "i64"}]
    assert report["outputs"] == [{"name": "logits", "shape": [1, 16, 1000], "dtype": "f32"}]
    assert report["parameters"] == graph.num_parameters > 100_000
    assert report["weights_bytes"] == graph.weight_bytes >= 4 * report["parameters"]
    assert report["imported_ops"] == graph.op_histogram() and report["imported_ops"]["matmul"] > 0
    # the optimized graph (issue 3's contract): patterns recognized, kernels counted, memory planned
    assert sum(report["ops"].values()) == report["nodes"] < len(graph.nodes)
    assert report["patterns"]["attention"] == 2 and report["patterns"]["layernorm"] == 5
    assert isinstance(report["kernels"], int) and 0 < report["kernels"] < len(graph.nodes)
    assert all({"name", "kind", "members", "decision", "reason"} <= set(f) for f in report["fusions"])
    mem = report["memory"]
    assert mem["lower_bound_bytes"] <= mem["planned_bytes"] <= 1.1 * mem["lower_bound_bytes"] < mem["naive_bytes"]
    assert isinstance(report["transposes_cached"], int) and isinstance(report["gemms_merged"], int)


def test_inspect_text_builtin_with_shapes(capsys) -> None:
    code, out, _ = call(capsys, ["inspect", "bert-tiny", "--shapes", "input_ids:2x8,attention_mask:2x8"])
    assert code == 0
    rows = [ln.split() for ln in out.splitlines()]  # aligned columns: name, type
    assert ["input_ids", "i64[2,8]"] in rows and ["last_hidden_state", "f32[2,8,128]"] in rows
    assert any(ln.startswith("parameters  ") for ln in out.splitlines())


def test_inspect_report_renders_keys_added_by_later_stages(capsys) -> None:
    from fusec.cli.inspect import build_report, render_text

    report = build_report(load_graph("gpt2-tiny"), "gpt2-tiny")
    report["compile"] = {"fused_kernels": 7, "decisions": {"gelu\nepilogue": "fused"}}
    text = render_text(report)
    assert "compile:" in text.splitlines()
    assert "  fused_kernels: 7" in text.splitlines()
    assert '    "gelu\\nepilogue": "fused"' in text.splitlines()


def test_inspect_onnx_file_with_shapes(capsys, tmp_path) -> None:
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), path)
    code, out, err = call(capsys, ["inspect", str(path), "--shapes", "input_ids:2x5,attention_mask:2x5", "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["inputs"][0] == {"name": "input_ids", "shape": [2, 5], "dtype": "i64"}
    assert report["outputs"] == [{"name": "probs", "shape": [2, 5, 4], "dtype": "f32"}]
    assert report["parameters"] == 11 * 8 + 8 * 4


def test_inspect_and_run_escape_weird_names(capsys, tmp_path, no_gpu) -> None:
    path = tmp_path / "weird.onnx"
    onnx.save(weird_names_onnx(), path)

    code, out, err = call(capsys, ["inspect", str(path), "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert out.isascii()
    assert report["inputs"] == [{"name": WEIRD_IN, "shape": [2, 3], "dtype": "f32"}]
    assert report["outputs"][0]["name"] == WEIRD_OUT

    code, out, err = call(capsys, ["inspect", str(path)])
    assert code == 0, err
    assert f"  {json.dumps(WEIRD_IN)}  f32[2,3]" in out.splitlines()
    assert f"  {json.dumps(WEIRD_OUT)}  f32[2,3]" in out.splitlines()
    assert "\r" not in out

    saved = tmp_path / "out.npz"
    code, out, err = call(capsys, ["run", str(path), "--save-outputs", str(saved)])
    assert code == 0, err
    assert any(ln.startswith(f"output {json.dumps(WEIRD_OUT)}  f32[2,3]") for ln in out.splitlines())
    assert "\r" not in out
    with np.load(saved, allow_pickle=False) as z:
        assert z.files == [WEIRD_OUT]
        assert (z[WEIRD_OUT] <= 0).all()  # -relu(x)


# ---------------------------------------------------------------------------------------------
# run


def test_run_without_gpu_notes_it_and_uses_the_reference(capsys, no_gpu) -> None:
    code, out, err = call(capsys, ["run", "gpt2-tiny"])
    assert code == 0
    note, cross = err.splitlines()
    assert note.startswith("no GPU found (") and note.endswith("): running the numpy reference backend")
    assert cross.startswith("compiled the plan for sm_90 too (") and "kernels" in cross
    assert "backend reference" in out.splitlines()[0]
    line = next(ln for ln in out.splitlines() if ln.startswith("output logits"))
    assert "f32[1,16,1000]" in line and "mean=" in line and "std=" in line and "values=[" in line


def test_run_saved_outputs_equal_the_reference_on_the_same_seed(capsys, tmp_path, no_gpu) -> None:
    saved = tmp_path / "out.npz"
    code, _, _ = call(capsys, ["run", "llama-tiny", "--backend", "reference", "--seed", "5", "--no-optimize",
                               "--shapes", "input_ids:2x8,attention_mask:2x8", "--save-outputs", str(saved)])
    assert code == 0
    graph = load_graph("llama-tiny", {"input_ids": (2, 8), "attention_mask": (2, 8)})
    expected = reference.run(graph, random_inputs(graph, seed=5))
    other_seed = reference.run(graph, random_inputs(graph, seed=6))
    with np.load(saved, allow_pickle=False) as z:
        assert z.files == ["logits"]
        np.testing.assert_array_equal(z["logits"], expected["logits"])
        assert not np.array_equal(z["logits"], other_seed["logits"])
    assert os.listdir(tmp_path) == ["out.npz"]


def test_run_reads_inputs_from_npz(capsys, tmp_path, no_gpu) -> None:
    graph = load_graph("qwen3-tiny")
    inputs = random_inputs(graph, seed=11)
    inputs["attention_mask"][0, :3] = 0  # left padding: not what random inputs would give
    np.savez(tmp_path / "in.npz", **inputs)
    code, out, _ = call(capsys, ["run", "qwen3-tiny", "--backend", "reference", "--inputs", str(tmp_path / "in.npz"),
                                 "--no-optimize", "--save-outputs", str(tmp_path / "out.npz")])
    assert code == 0
    assert "inputs from" in out.splitlines()[0]
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_array_equal(z["logits"], reference.run(graph, inputs)["logits"])


def test_run_onnx_file_matches_onnxruntime(capsys, tmp_path, no_gpu) -> None:
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), path)
    ids = np.array([[1, 5, 10], [0, 2, 3]], np.int64)
    mask = np.array([[1, 1, 1], [0, 1, 1]], np.int64)
    np.savez(tmp_path / "in.npz", input_ids=ids, attention_mask=mask)
    code, _, err = call(capsys, ["run", str(path), "--shapes", "input_ids:2x3,attention_mask:2x3",
                                 "--inputs", str(tmp_path / "in.npz"), "--save-outputs", str(tmp_path / "out.npz")])
    assert code == 0, err
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = sess.run(None, {"input_ids": ids, "attention_mask": mask})
    with np.load(tmp_path / "out.npz") as z:
        np.testing.assert_allclose(z["probs"], want, rtol=1e-5, atol=1e-6)


def test_run_explicit_cuda_without_gpu_is_an_error(capsys, no_gpu) -> None:
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "cuda"])
    assert code == 1 and out == ""
    assert err.startswith("fusec: error: --backend cuda needs a GPU: no GPU found (") and err.count("\n") == 1
    assert err.endswith("; use --backend reference (numpy, any machine)\n")


def test_run_default_backend_is_cuda_when_a_gpu_is_found(capsys, monkeypatch) -> None:
    seen = {}

    def fake_cuda(args, graph, inputs, plan):
        seen["inputs"] = sorted(inputs)
        return reference.run(graph, inputs), {"launches": 1}, plan

    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(run_cmd, "_run_cuda", fake_cuda)
    code, out, err = call(capsys, ["run", "gpt2-tiny", "--stats"])
    assert code == 0 and err == ""
    assert "backend cuda" in out.splitlines()[0]
    assert seen["inputs"] == ["attention_mask", "input_ids"]
    assert "stats  launches=1" in out.splitlines()


def test_run_optimized_reference_is_the_default_and_agrees_with_the_raw_graph(capsys, tmp_path, no_gpu) -> None:
    for flag, name in (([], "opt.npz"), (["--no-optimize"], "raw.npz")):
        code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--seed", "2", *flag,
                                     "--save-outputs", str(tmp_path / name)])
        assert code == 0, err
    with np.load(tmp_path / "opt.npz") as a, np.load(tmp_path / "raw.npz") as b:
        opt, raw = a["logits"], b["logits"]
    assert np.linalg.norm(opt - raw) / np.linalg.norm(raw) < 1e-5


def test_run_check_prints_the_error_against_the_reference(capsys, no_gpu) -> None:
    code, out, err = call(capsys, ["run", "bert-tiny", "--backend", "reference", "--check"])
    assert code == 0, err
    header, table = out.split("check against the numpy reference (fp32) (atol 0.0001, rtol 0.0001")[1].split("\n", 1)
    line = next(ln for ln in table.splitlines() if ln.split()[0] == "last_hidden_state")
    max_abs, max_rel, mismatches, result = line.split()[2:6]
    assert float(max_abs) < 1e-5 and mismatches.startswith("0/") and result == "ok"


def test_a_plan_file_needs_a_gpu_and_the_cuda_backend(capsys, tmp_path, no_gpu) -> None:
    import fusec

    path = tmp_path / "g.fplan"
    fusec.compile("gpt2-tiny", dtype="fp32", arch="sm_90").save(path)
    code, _, err = call(capsys, ["run", str(path)])
    assert code == 1 and err.startswith(f"fusec: error: {path} is a compiled plan and runs only on a GPU: no GPU found")
    # no circle: both say exactly what to run instead (the plan's source model on the reference)
    assert "`fusec run gpt2-tiny --backend reference" in err and err.count("\n") == 1
    code, _, err = call(capsys, ["run", str(path), "--backend", "reference"])
    assert code == 1 and "runs only on the cuda backend" in err and "`fusec run gpt2-tiny --backend reference" in err


def test_summarize_counts_nonfinite_values() -> None:
    s = run_cmd.summarize(np.array([1.0, np.nan, 3.0, np.inf, 5.0], np.float32))
    assert s == "mean=3  std=1.63299  nonfinite=2  values=[1, nan, 3, inf, ...]"
    assert run_cmd.summarize(np.array([True, False])) == "mean=0.5  std=0.5  values=[True, False]"


# ---------------------------------------------------------------------------------------------
# export-model


def test_export_model_writes_onnx_that_loads_back(capsys, tmp_path) -> None:
    target = tmp_path / "gpt2-tiny.onnx"
    code, out, err = call(capsys, ["export-model", "gpt2-tiny", "-o", str(target)])
    assert code == 0, err
    assert target.exists() and "wrote" in out
    onnx.checker.check_model(str(target))
    code, out, err = call(capsys, ["inspect", str(target), "--json"])
    assert code == 0, err
    exported = json.loads(out)
    code, out, _ = call(capsys, ["inspect", "gpt2-tiny", "--json"])
    builtin = json.loads(out)
    assert exported["inputs"] == builtin["inputs"] and exported["outputs"] == builtin["outputs"]
    assert exported["parameters"] == builtin["parameters"]

    ort = pytest.importorskip("onnxruntime")  # --help promises the file loads in onnxruntime too
    graph = load_graph("gpt2-tiny")
    inputs = random_inputs(graph, seed=2)
    (got,) = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"]).run(["logits"], inputs)
    np.testing.assert_allclose(got, reference.run(graph, inputs)["logits"], rtol=1e-4, atol=1e-5)


def test_readme_tour_commands_work(capsys, tmp_path, monkeypatch) -> None:
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    tour = readme.split("## A short tour", 1)[1]
    lines = [ln for block in tour.split("```bash\n")[1:] for ln in block.split("```")[0].splitlines()]
    commands = [shlex.split(ln) for ln in lines if ln.startswith("fusec ")]
    assert len(commands) >= 3
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        code, _, err = call(capsys, argv[1:])
        assert code == 0, (argv, err)


# ---------------------------------------------------------------------------------------------
# the one-line error contract


def test_error_messages_stay_on_one_line(capsys) -> None:
    print_error("bad name 'a\nb\r\x1b[31m' \u2028 end é")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fusec: error: ")
    assert "\\n" in err and "\\x1b" in err and "\\u2028" in err and "é" in err
    assert one_line("plain 'text' é") == "plain 'text' é"


def test_run_without_cuda_packages_still_runs_the_reference(capsys, monkeypatch, no_gpu) -> None:
    import fusec

    def no_cuda(*a, **k):
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(fusec, "compile", no_cuda)
    code, out, err = call(capsys, ["run", "gpt2-tiny"])
    assert code == 0 and "backend reference" in out.splitlines()[0]
    assert "the side compile for the GPU failed" in err and "CuPy is not installed" in err
    assert 'pip install "cupy-cuda' in err
