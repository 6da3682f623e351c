"""fusec profile / export-graph / memory: the command line (CPU; the trace itself is in test_report_gpu)."""

from __future__ import annotations

import os

import onnx
import pytest

from fusec.cli import main
from fusec.device import gpu_available


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    import fusec

    d = tmp_path_factory.mktemp("plans")
    fusec.compile("gpt2-tiny", arch="sm_90").save(d / "g.fplan")
    fusec.compile("gpt2-tiny", arch="sm_90", disabled_fusions=["gemm_epilogue"]).save(d / "noepi.fplan")
    return {"plan": os.fspath(d / "g.fplan"), "noepi": os.fspath(d / "noepi.fplan")}


def _one_line_error(capsys, argv, *needles):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fusec: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_export_graph_model_and_plan(tmp_path, capsys, plans):
    out = tmp_path / "m.onnx"
    assert main(["export-graph", "gpt2-tiny", "-o", os.fspath(out)]) == 0
    assert "ai.fusec" in capsys.readouterr().out
    onnx.checker.check_model(os.fspath(out))
    out2 = tmp_path / "p.onnx"
    assert main(["export-graph", plans["plan"], "-o", os.fspath(out2), "--no-weights"]) == 0
    model = onnx.load(os.fspath(out2))
    onnx.checker.check_model(model)
    assert not [t for t in model.graph.initializer if t.name == "wte"]
    import fusec

    kernel_names = {k["entry"] for k in fusec.load(plans["plan"]).manifest["kernels"]}
    fused = [n for n in model.graph.node if n.domain == "ai.fusec" and any(a.name == "rule" for a in n.attribute)]
    assert fused
    for n in fused:
        ks = [s.decode() for a in n.attribute if a.name == "kernels" for s in a.strings]
        assert ks and all(k in kernel_names or k.startswith("cublas") for k in ks), ks
    props = {p.key: p.value for p in model.metadata_props}
    assert props["fusec.arch"] == "sm_90" and props["fusec.source"] == plans["plan"]


def test_memory_html_and_png(tmp_path, capsys, plans):
    page = tmp_path / "t.html"
    assert main(["memory", plans["plan"], "-o", os.fspath(page)]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "<svg" in page.read_text()
    pytest.importorskip("matplotlib")
    pic = tmp_path / "t.png"
    assert main(["memory", "gpt2-tiny", "-o", os.fspath(pic)]) == 0
    assert pic.read_bytes()[:4] == b"\x89PNG"


def test_errors_are_one_line(tmp_path, capsys, plans):
    t = os.fspath(tmp_path)
    _one_line_error(capsys, ["memory", "gpt2-tiny", "-o", f"{t}/t.svg"], ".html", ".png")
    _one_line_error(capsys, ["export-graph", "gpt2-tiny", "-o", f"{t}/t.txt"], ".onnx")
    _one_line_error(capsys, ["export-graph", plans["plan"], "--dtype", "fp32", "-o", f"{t}/x.onnx"], "--dtype")
    _one_line_error(capsys, ["export-graph", "gpt2-tiny", "--model", "gpt2-tiny", "-o", f"{t}/x.onnx"], "--model")
    _one_line_error(capsys, ["export-graph", "no-such-model", "-o", f"{t}/x.onnx"], "no-such-model")
    _one_line_error(capsys, ["export-graph", plans["plan"], "--entry", "decode", "-o", f"{t}/x.onnx"], "'decode'")
    _one_line_error(capsys, ["memory", "gpt2-tiny", "-o", f"{t}/no/such/dir/t.html"], "does not exist")
    _one_line_error(capsys, ["export-graph", "gpt2-tiny", "--disable-fusion", "bogus", "-o", f"{t}/x.onnx"], "bogus")
    line = _one_line_error(capsys, ["memory", plans["plan"], "--disable-fusion", "gemm_epilogue", "-o", f"{t}/x.html"],
                           "--disable-fusion")
    assert "fused graph" in line
    assert main(["memory", plans["noepi"], "--disable-fusion", "gemm_epilogue", "-o", f"{t}/x.html"]) == 0
    _one_line_error(capsys, ["profile", "gpt2-tiny", "--warmup", "0", "-o", f"{t}/t.json"], "--warmup")
    assert not [p for p in os.listdir(t) if p.startswith("x.onnx") or p.startswith("t.")]


def test_usage_errors(capsys):
    assert main(["memory", "gpt2-tiny"]) == 2  # -o is required
    assert main(["profile", "gpt2-tiny", "-o", "x.json", "--warmup", "one"]) == 2


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a GPU")
def test_profile_without_a_gpu_says_so(tmp_path, capsys):
    _one_line_error(capsys, ["profile", "gpt2-tiny", "-o", os.fspath(tmp_path / "t.json")], "GPU", "fusec memory")
    assert not (tmp_path / "t.json").exists()
