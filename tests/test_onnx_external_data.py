"""Safe loading: external data is validated before any byte is read; bad files are ModelErrors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusec import reference
from fusec.errors import ModelError
from fusec.frontend.onnx_import import import_onnx

rng = np.random.default_rng(20261123)


def _model() -> onnx.ModelProto:
    w = rng.standard_normal((64, 80)).astype(np.float32)  # 5120 elements: a weight, stored externally
    b = rng.standard_normal(80).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    g = helper.make_graph(nodes, "ext", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 80])],
                          [onnx.numpy_helper.from_array(w, "w"), onnx.numpy_helper.from_array(b, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def _save_external(d: Path, location: str = "weights.bin") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / "model.onnx"
    onnx.save_model(_model(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=1024)
    return path


def _retarget(path: Path, **fields: str) -> None:
    """Rewrite the external-data fields of tensor 'w' in place (what a hostile file would say)."""
    m = onnx.load(str(path), load_external_data=False)
    (w,) = [t for t in m.graph.initializer if t.name == "w"]
    assert w.data_location == TensorProto.EXTERNAL
    entries = {e.key: e.value for e in w.external_data}
    entries.update(fields)
    del w.external_data[:]
    for k, v in entries.items():
        w.external_data.add(key=k, value=v)
    path.write_bytes(m.SerializeToString())


def _model_error(path: Path | str, *needles: str) -> str:
    with pytest.raises(ModelError) as ei:
        import_onnx(path, {"x": (3, 64)})
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def test_valid_external_tensor_loads_and_matches_onnxruntime(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    assert (tmp_path / "m" / "weights.bin").stat().st_size == 64 * 80 * 4
    g = import_onnx(path, {"x": (3, 64)})
    (w,) = [c for c in g.constants if c.name == "w"]
    assert w.shape == (64, 80)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(reference.run(g, {"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_external_data_in_a_subdirectory_is_fine_but_symlinks_are_refused(tmp_path: Path) -> None:
    (tmp_path / "m" / "data").mkdir(parents=True)
    path = _save_external(tmp_path / "m", location="data/weights.bin")
    assert [c.shape for c in import_onnx(path, {"x": (2, 64)}).constants if c.name == "w"] == [(64, 80)]
    # a symlink that stays inside the directory passes our check, but the ONNX checker refuses all
    os.symlink(tmp_path / "m" / "data" / "weights.bin", tmp_path / "m" / "link.bin")
    _retarget(path, location="link.bin")
    _model_error(path, "symbolic link")


def test_dotdot_location_is_rejected(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    (tmp_path / "outside.bin").write_bytes((tmp_path / "m" / "weights.bin").read_bytes())
    _retarget(path, location="../outside.bin")
    _model_error(path, "'w'", "'../outside.bin'", "'..'", "model.onnx")


def test_absolute_location_is_rejected(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    target = str((tmp_path / "m" / "weights.bin").resolve())
    _retarget(path, location=target)
    _model_error(path, "'w'", repr(target), "absolute path")


def test_symlink_escaping_the_directory_is_rejected(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    outside = tmp_path / "secret.bin"
    outside.write_bytes((tmp_path / "m" / "weights.bin").read_bytes())
    os.symlink(outside, tmp_path / "m" / "escape.bin")
    _retarget(path, location="escape.bin")
    _model_error(path, "'w'", "'escape.bin'", "outside the model's directory")


def test_offset_past_end_of_file_is_rejected(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    size = (tmp_path / "m" / "weights.bin").stat().st_size
    _retarget(path, offset=str(size + 16))
    _model_error(path, "'w'", "'weights.bin'", "past the end")
    _retarget(path, offset="64", length=str(size))  # inside the file, but running over its end
    _model_error(path, "'w'", "past the end")


def test_missing_external_file_is_rejected(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    _retarget(path, location="nope.bin")
    _model_error(path, "'w'", "'nope.bin'", "not found")


def test_external_data_without_a_path_is_rejected(tmp_path: Path) -> None:
    path = _save_external(tmp_path / "m")
    with pytest.raises(ModelError, match="stores its data externally"):
        import_onnx(onnx.load(str(path), load_external_data=False), {"x": (3, 64)})


def test_truncated_file_is_a_model_error(tmp_path: Path) -> None:
    data = _model().SerializeToString()
    for cut in (len(data) // 2, len(data) - 3):
        p = tmp_path / f"cut{cut}.onnx"
        p.write_bytes(data[:cut])
        _model_error(p, repr(str(p)))


def test_non_onnx_and_missing_files_are_model_errors(tmp_path: Path) -> None:
    text = tmp_path / "notes.onnx"
    text.write_text("this is not an ONNX model\nat all\n")
    _model_error(text, repr(str(text)))
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    _model_error(empty, "not an ONNX model")
    _model_error(tmp_path / "missing.onnx", "not found", "missing.onnx")
    _model_error(tmp_path, "not a file")
