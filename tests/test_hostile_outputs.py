"""Hostile and careless output paths (issue 10, items 5 and 6): every failure to write is one line
naming the path, decided before the work is done; nothing is half-written; Ctrl-C exits 130 and
removes its temporary file; a writer killed with SIGKILL leaves a ``.NAME.<pid>.*.tmp`` file that
the next write to the same target removes; the model or inputs file is never overwritten; an
output name is never a path in the outputs archive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hostile_helpers import fails, model, relu_model, save, vi
from onnx import helper

from fusec import device
from fusec.cli import main
from fusec.errors import FusecError
from fusec.fsutil import OutputError, atomic_write
from fusec.inputs import save_outputs_npz


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_available", lambda: False)


@pytest.fixture
def relu(tmp_path) -> Path:
    return save(relu_model(), tmp_path / "relu.onnx")


def _tmp_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("target, needle", [
    ("", "empty"),
    ("/proc/self/fusec.fplan", "/proc"),
    ("/proc/version", "/proc"),
    ("/dev/null", "not a regular file"),
    ("{tmp}", "is a directory"),
    ("{tmp}/missing/g.fplan", "does not exist"),
])
def test_compile_output_paths_are_refused_before_compiling(capsys, tmp_path, target, needle) -> None:
    target = target.format(tmp=tmp_path)
    fails(capsys, ["compile", "gpt2-tiny", "-o", target], needles=[needle])
    assert _tmp_files(tmp_path) == []


def test_read_only_directory_is_one_line_naming_the_plan(capsys, monkeypatch, tmp_path) -> None:
    """What a read-only directory does to a non-root user (the tests may run as root)."""
    import fusec.fsutil

    real = fusec.fsutil.tempfile.mkstemp

    def denied(*a, **k):
        if k.get("dir") != str(tmp_path):  # the kernel cache elsewhere stays writable
            return real(*a, **k)
        raise PermissionError(13, "Permission denied", os.path.join(k["dir"], "x.tmp"))

    monkeypatch.setattr(fusec.fsutil.tempfile, "mkstemp", denied)
    fails(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan")], needles=["g.fplan", "Permission denied"])
    assert list(tmp_path.iterdir()) == []


def test_compile_refuses_to_overwrite_its_input_model(capsys, relu) -> None:
    before = relu.read_bytes()
    fails(capsys, ["compile", str(relu), "-o", str(relu)], needles=["relu.onnx", "input"])
    assert relu.read_bytes() == before
    link = relu.with_name("alias.onnx")
    os.link(relu, link)  # another name for the same file
    fails(capsys, ["compile", str(relu), "-o", str(link)], needles=["alias.onnx", "input"])
    assert relu.read_bytes() == before


def test_export_model_refuses_device_nodes_and_its_input(capsys, relu) -> None:
    fails(capsys, ["export-model", "gpt2-tiny", "-o", "/dev/null"], needles=["/dev/null", "not a regular file"])
    before = relu.read_bytes()
    fails(capsys, ["export-model", str(relu), "-o", str(relu)], needles=["relu.onnx", "input"])
    assert relu.read_bytes() == before


def test_dump_dir_that_is_a_file(capsys, tmp_path, relu) -> None:
    fails(capsys, ["compile", str(relu), "-o", str(tmp_path / "r.fplan"), "--dump-dir", str(relu)],
          needles=["--dump-dir", "relu.onnx", "not a directory"])


@pytest.mark.parametrize("target, needle", [
    ("", "empty"), ("/dev/null", "not a regular file"), ("/proc/self/out.npz", "/proc"), ("{tmp}", "directory"),
])
def test_save_outputs_paths_are_refused_before_running(capsys, tmp_path, relu, target, needle) -> None:
    fails(capsys, ["run", str(relu), "--backend", "reference", "--save-outputs", target.format(tmp=tmp_path)],
          needles=[needle])


def test_save_outputs_refuses_to_overwrite_the_inputs(capsys, tmp_path, relu) -> None:
    inp = tmp_path / "in.npz"
    np.savez(inp, x=np.ones((2, 4), np.float32))
    before = inp.read_bytes()
    fails(capsys, ["run", str(relu), "--backend", "reference", "--inputs", str(inp), "--save-outputs", str(inp)],
          needles=["in.npz", "input"])
    assert inp.read_bytes() == before


@pytest.mark.parametrize("name", ["../../x", "/etc/x", "a/../../b", "..", "a\\..\\b"])
def test_output_names_never_become_paths_in_the_archive(capsys, tmp_path, name) -> None:
    m = model([helper.make_node("Relu", ["x"], [name])], [vi("x", [2, 4])], [vi(name, [2, 4])])
    path = save(m, tmp_path / "m.onnx")
    out = tmp_path / "out.npz"
    fails(capsys, ["run", str(path), "--backend", "reference", "--save-outputs", str(out)],
          needles=[repr(name), "outputs .npz archive"])
    assert not out.exists() and _tmp_files(tmp_path) == []


def test_plain_output_names_with_slashes_still_save(tmp_path) -> None:
    out = tmp_path / "out.npz"
    save_outputs_npz(out, {"encoder/layer.0/out": np.ones(3)})
    assert zipfile.ZipFile(out).namelist() == ["encoder/layer.0/out.npy"]


def test_ctrl_c_while_writing_exits_130_and_leaves_nothing(capsys, monkeypatch, tmp_path, relu) -> None:
    out = tmp_path / "out.npz"

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(np.lib.format, "write_array", interrupted)
    fails(capsys, ["run", str(relu), "--backend", "reference", "--save-outputs", str(out)], code=130,
          needles=["interrupted"])
    assert not out.exists() and _tmp_files(tmp_path) == []


def test_ctrl_c_while_compiling_exits_130(capsys, monkeypatch, tmp_path) -> None:
    import fusec.compiler

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fusec.compiler, "compile", interrupted)
    fails(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan")], code=130)
    assert list(tmp_path.iterdir()) == []


_WRITER = """
import sys, time
from fusec.fsutil import atomic_write
with atomic_write(sys.argv[1]) as f:
    f.write(b"x" * (24 << 20))
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


def test_sigkill_mid_write_leaves_a_temp_file_that_the_next_write_removes(tmp_path) -> None:
    target = tmp_path / "g.fplan"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(target)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (left,) = _tmp_files(tmp_path)
    assert left.startswith(".g.fplan.") and (tmp_path / left).stat().st_size == 24 << 20
    assert not target.exists()
    # a temp file of a live writer (this process) is left alone
    live = tmp_path / f".g.fplan.{os.getpid()}.live.tmp"
    live.write_bytes(b"")
    with atomic_write(target) as f:
        f.write(b"plan")
    assert target.read_bytes() == b"plan" and _tmp_files(tmp_path) == [live.name]


def test_old_temp_files_are_removed_whatever_their_pid(tmp_path) -> None:
    target = tmp_path / "o.npz"
    stale = tmp_path / ".o.npz.1.abc.tmp"  # pid 1 is alive, but the file is two days old
    stale.write_bytes(b"x")
    old = time.time() - 2 * 86400
    os.utime(stale, (old, old))
    other = tmp_path / ".other.npz.99999999.abc.tmp"  # another target's: not ours to touch
    other.write_bytes(b"x")
    save_outputs_npz(target, {"y": np.zeros(2)})
    assert not stale.exists() and other.exists()


def test_atomic_write_errors_name_the_path_and_are_fusec_errors(tmp_path) -> None:
    with pytest.raises(OutputError) as ei:
        with atomic_write(tmp_path / "missing" / "x.bin") as f:
            f.write(b"x")
    assert isinstance(ei.value, FusecError) and isinstance(ei.value, OSError)
    assert "missing" in str(ei.value)


@pytest.mark.parametrize("exc, needles, code", [
    (PermissionError(13, "Permission denied", "/secret/place"), ["'/secret/place'", "Permission denied"], 1),
    (OSError(28, "No space left on device", "/full/disk/g.fplan"), ["'/full/disk/g.fplan'", "No space left"], 1),
    (MemoryError(), ["out of memory"], 1),
    (RecursionError("maximum recursion depth exceeded"), ["nested too deeply"], 1),
    (KeyboardInterrupt(), ["interrupted"], 130),
])
def test_the_cli_boundary_turns_every_failure_into_one_line(capsys, monkeypatch, exc, needles, code) -> None:
    import fusec.cli.models as models_cmd

    def boom(args):
        raise exc

    monkeypatch.setattr(models_cmd, "run", boom)
    fails(capsys, ["models"], code=code, needles=needles)


def test_usage_errors_exit_2(capsys) -> None:
    assert main(["compile", "gpt2-tiny"]) == 2  # -o is required
    assert "usage" in capsys.readouterr().err
