"""Hostile input, external data (issue 10, item 1): an ONNX file's external tensors are read from
one descriptor that was checked (no symlink on any path component, a regular file with one link,
the same device/inode as the path that was validated); nothing outside the model's directory is
ever read, whatever the ONNX checker of the installed version refuses or not."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from hostile_helpers import fails
from onnx import TensorProto, helper

from fusec.errors import ModelError
from fusec.frontend import onnx_load
from fusec.frontend.onnx_import import import_onnx

SECRET = np.full((64, 80), 1234.5, np.float32)


def _model() -> onnx.ModelProto:
    w = np.random.default_rng(0).standard_normal((64, 80)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "ext",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 80])],
                          [onnx.numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    return m


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(model.onnx, its w.bin, a secret file outside the model's directory)."""
    d = tmp_path / "m"
    d.mkdir()
    path = d / "model.onnx"
    onnx.save_model(_model(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="w.bin", size_threshold=1024)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET.tobytes())
    return path, d / "w.bin", secret


@pytest.fixture
def lax_checker(monkeypatch):
    """An onnx whose checker refuses nothing (older versions accept links): fusec must not rely on it."""
    monkeypatch.setattr(onnx.checker, "check_model", lambda *a, **k: None)


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(ModelError) as ei:
        import_onnx(path)
    msg = str(ei.value)
    assert "\n" not in msg and "'w'" in msg and "model.onnx" in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_plain_external_data_still_loads(layout) -> None:
    path, _, _ = layout
    (w,) = [c for c in import_onnx(path).constants if c.name == "w"]
    assert w.shape == (64, 80) and not np.array_equal(w.data, SECRET)


def test_hard_link_to_an_outside_file_is_refused(layout, lax_checker) -> None:
    path, wbin, secret = layout
    wbin.unlink()
    os.link(secret, wbin)
    _refused(path, "hard links")


def test_symlink_inside_the_directory_is_refused_without_the_checker(layout, lax_checker) -> None:
    path, wbin, _ = layout
    real = wbin.with_name("real.bin")
    wbin.rename(real)
    wbin.symlink_to(real.name)
    _refused(path, "symbolic link")


def test_symlinked_directory_component_is_refused(layout, lax_checker, tmp_path) -> None:
    path, wbin, _ = layout
    (tmp_path / "elsewhere").mkdir()
    wbin.rename(tmp_path / "elsewhere" / "w.bin")
    # data/ -> ../elsewhere resolves outside: refused; a link that stays inside is refused too
    inner = path.parent / "inner"
    inner.mkdir()
    (tmp_path / "elsewhere" / "w.bin").rename(inner / "w.bin")
    (path.parent / "data").symlink_to("inner")
    m = onnx.load(str(path), load_external_data=False)
    for e in m.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "data/w.bin"
    path.write_bytes(m.SerializeToString())
    _refused(path, "symbolic link")


def test_swap_to_a_symlink_after_validation_reads_nothing(layout, lax_checker, monkeypatch) -> None:
    """The race of the issue: w.bin is a regular file when its path is checked and a symlink to
    the secret when it is opened. The open does not follow it."""
    path, wbin, secret = layout
    _after_validation(monkeypatch, wbin, lambda: (wbin.unlink(), wbin.symlink_to(secret)))
    _refused(path, "symbolic link")


def test_swap_to_another_file_after_validation_is_refused(layout, lax_checker, monkeypatch) -> None:
    path, wbin, _ = layout

    def replace() -> None:  # a new inode under the validated name (written first: no inode reuse)
        other = wbin.with_name("other.bin")
        other.write_bytes(wbin.read_bytes())
        other.replace(wbin)

    _after_validation(monkeypatch, wbin, replace)
    _refused(path, "changed while it was checked")


def _after_validation(monkeypatch, wbin: Path, swap) -> None:
    """Run ``swap`` right after fusec stats the validated path of ``wbin`` (once)."""
    real_stat, target, done = os.stat, os.path.realpath(wbin), []

    def stat_then_swap(p, *a, **k):
        st = real_stat(p, *a, **k)
        if not done and k.get("follow_symlinks", True) and os.fspath(p) == target:
            done.append(True)
            swap()
        return st

    monkeypatch.setattr(onnx_load.os, "stat", stat_then_swap)


def test_a_fifo_as_external_data_is_refused_without_blocking(layout, lax_checker) -> None:
    path, wbin, _ = layout
    wbin.unlink()
    os.mkfifo(wbin)
    _refused(path, "not a regular file")


def test_a_directory_as_external_data_is_refused(layout, lax_checker) -> None:
    path, wbin, _ = layout
    wbin.unlink()
    wbin.mkdir()
    _refused(path, "directory")


def test_external_tensor_claiming_a_huge_shape_is_refused_before_reading(layout, lax_checker) -> None:
    path, _, _ = layout
    m = onnx.load(str(path), load_external_data=False)
    del m.graph.initializer[0].dims[:]
    m.graph.initializer[0].dims.extend([1_000_000, 1_000_000])
    path.write_bytes(m.SerializeToString())
    with pytest.raises(ModelError, match="elements"):
        import_onnx(path)


def test_cli_hard_link_is_one_line(capsys, layout, lax_checker) -> None:
    path, wbin, secret = layout
    wbin.unlink()
    os.link(secret, wbin)
    fails(capsys, ["inspect", str(path)], needles=["model.onnx", "'w'", "hard links"])
