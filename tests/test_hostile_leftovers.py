"""Hostile input that was left over (issue 21): each case is one error line (exit 1) with nothing
half-done, or works where valid: --inputs naming a device, a graph output that is also a graph
input, names longer than a plan stores, an out-of-range token id named by its input, a file
swapped while external data is resolved, a kernel cache that cannot be written or whose entry
became a directory, and every unsupported node of a model in one refusal."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_helpers import const, fails, model, save, vi
from onnx import TensorProto, helper

from fusec import reference
from fusec.cli import main
from fusec.codegen import compile as CC
from fusec.errors import InputError, ModelError
from fusec.loader import load_graph

SRC = 'extern "C" __global__ void fc_left_k(float* x) { x[threadIdx.x] = %s; }'


def test_inputs_naming_a_device_is_refused_at_once(capsys, monkeypatch):
    monkeypatch.setenv("FUSEC_MAX_BYTES", str(1 << 20))  # before the fix /dev/zero was read up to this
    line = fails(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--inputs", "/dev/zero"])
    assert "'/dev/zero' is not a regular file or a pipe" in line, line


def _passthrough(tmp_path: Path) -> Path:
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 4])], [vi("y", [2, 4]), vi("x", [2, 4])])
    onnx.checker.check_model(m)  # valid ONNX: a graph output may be a graph input
    return save(m, tmp_path / "passthrough.onnx")


def test_a_graph_output_that_is_a_graph_input_passes_it_through(tmp_path):
    g = load_graph(_passthrough(tmp_path))
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    out = reference.run(g, {"x": x})
    assert list(out) == ["y", "x"]
    np.testing.assert_array_equal(out["x"], x)
    np.testing.assert_array_equal(out["y"], np.maximum(x, 0))


def test_a_passthrough_output_compiles_into_the_plan_signature(tmp_path, capsys):
    assert main(["compile", str(_passthrough(tmp_path)), "-o", str(tmp_path / "p.fplan"), "--arch", "sm_90", "-q"]) == 0
    import fusec

    m = fusec.load(tmp_path / "p.fplan").manifest
    assert [o["name"] for o in m["outputs"]] == ["y", "x"] and [i["name"] for i in m["inputs"]] == ["x"]


@pytest.mark.parametrize("what", ["input", "output"])
def test_an_io_name_longer_than_a_plan_stores_is_one_line_before_any_work(tmp_path, capsys, what):
    long = "n" * 5000
    if what == "input":
        m = model([helper.make_node("Relu", [long], ["y"])], [vi(long, [2, 4])], [vi("y", [2, 4])])
    else:
        m = model([helper.make_node("Relu", ["x"], [long])], [vi("x", [2, 4])], [vi(long, [2, 4])])
    path = save(m, tmp_path / "long.onnx")
    line = fails(capsys, ["compile", str(path), "-o", str(tmp_path / "l.fplan"), "--arch", "sm_90", "-q"])
    assert f"graph {what} 'nnnn" in line and "5000 characters" in line and "at most 4096" in line, line
    assert "manifest" not in line and not (tmp_path / "l.fplan").exists()


def test_a_long_graph_name_still_compiles(tmp_path, capsys):
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 4])], [vi("y", [2, 4])])
    m.graph.name = "g" * 5000
    path = save(m, tmp_path / "named.onnx")
    assert main(["compile", str(path), "-o", str(tmp_path / "n.fplan"), "--arch", "sm_90", "-q"]) == 0
    import fusec

    shown = fusec.load(tmp_path / "n.fplan").manifest["model"]
    assert len(shown) == 4096 and shown.endswith("...")


def test_an_out_of_range_token_id_is_blamed_on_its_input_not_on_gather():
    g = load_graph("gpt2-tiny")
    feeds = {"input_ids": np.full((1, 16), 99999, np.int64), "attention_mask": np.ones((1, 16), np.int64)}
    with pytest.raises(InputError, match=r"input 'input_ids': value 99999 is out of range \[-1000, 1000\)"):
        reference.run(g, feeds)


def test_a_file_swapped_while_external_data_is_resolved_is_a_model_error(tmp_path, monkeypatch):
    from fusec.frontend import onnx_load
    from fusec.frontend.onnx_import import import_onnx

    w = onnx.numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [vi("x", [2, 8])], [vi("y", [2, 8])], [w])
    onnx.save_model(m, tmp_path / "m.onnx", save_as_external_data=True, location="w.bin", size_threshold=0)
    real = os.path.realpath

    def swapped(p, *a, **k):  # what realpath meets when the link it reads is replaced meanwhile
        if str(p).endswith("w.bin"):
            raise OSError(22, "Invalid argument", str(p))
        return real(p, *a, **k)

    monkeypatch.setattr(onnx_load.os.path, "realpath", swapped)
    with pytest.raises(ModelError, match="w.bin.*cannot resolve the path.*changed during the import"):
        import_onnx(tmp_path / "m.onnx")


@pytest.fixture
def fresh_compile(monkeypatch):
    CC.clear_memory_cache()
    yield
    CC.clear_memory_cache()


@pytest.mark.parametrize("where", ["/proc/fusec-cache", "FILE/cache"])
def test_a_cache_that_cannot_be_made_compiles_without_it_and_says_so_once(tmp_path, monkeypatch, capsys,
                                                                          fresh_compile, where):
    (tmp_path / "FILE").write_text("a file, not a directory")
    monkeypatch.setenv("FUSEC_CACHE_DIR", where.replace("FILE", str(tmp_path / "FILE")))
    a = CC.compile_cuda(SRC % "1.0f", "fc_left_k", "sm_90")
    b = CC.compile_cuda(SRC % "2.0f", "fc_left_k", "sm_90")
    assert a.cubin[:4] == b.cubin[:4] == b"\x7fELF" and not a.from_disk
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fusec: warning: kernel cache") and "compiling without it" in err[0], err


def test_a_cache_entry_that_became_a_directory_is_recompiled_and_rewritten(tmp_path, monkeypatch, capsys,
                                                                          fresh_compile):
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    first = CC.compile_cuda(SRC % "3.0f", "fc_left_k", "sm_90")
    entry = next((tmp_path / "cache" / "kernels").rglob("*.bin"))
    entry.unlink()
    (entry / "junk").mkdir(parents=True)
    CC.clear_memory_cache()
    again = CC.compile_cuda(SRC % "3.0f", "fc_left_k", "sm_90")
    assert again.cubin == first.cubin and not again.from_disk and entry.is_file()
    CC.clear_memory_cache()
    assert CC.compile_cuda(SRC % "3.0f", "fc_left_k", "sm_90").from_disk  # the rewritten entry is read back
    assert capsys.readouterr().err == ""


def test_every_node_fusec_cannot_import_is_listed_in_one_refusal(tmp_path, capsys):
    m = model([helper.make_node("Dropout", ["x", "ratio", "train"], ["d"], name="drop"),
               helper.make_node("Relu", ["d"], ["r"], name="after_drop"),  # fed by a refused node: not reported
               helper.make_node("Cast", ["x"], ["s"], name="to_string", to=TensorProto.STRING),
               helper.make_node("Relu", ["x"], ["ok"])],
              [vi("x", [3, 3])], [vi("r", [3, 3]), vi("s", [3, 3], TensorProto.STRING), vi("ok", [3, 3])],
              [const("ratio", np.array(0.5, np.float32)), const("train", np.array(True))])
    line = fails(capsys, ["inspect", str(save(m, tmp_path / "two.onnx"))])
    assert "2 nodes cannot be imported" in line and "'drop' (Dropout)" in line and "'to_string' (Cast)" in line, line
    assert "after_drop" not in line
