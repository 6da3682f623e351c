"""Every failure is one line (issue 11 item 2): `fusec: error: ...` with the documented exit code and
no traceback (--debug / FUSEC_DEBUG=1 add it); a missing CuPy, NVRTC or cuBLAS names the pip
command; --arch is checked before compiling; Ctrl-C exits 130 leaving nothing half-written; without
a GPU `run` still prints the reference result when the side compile fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import call

import fusec
from fusec import device, toolchain
from fusec.codegen.compile import KernelCompileError

REPO = Path(__file__).resolve().parent.parent


def one_error_line(err: str) -> str:
    """The single `fusec: error:` line of ``err`` (other stderr lines are notes), without a traceback."""
    lines = [ln for ln in err.splitlines() if ln.startswith("fusec: error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0][len("fusec: error: "):]


@pytest.fixture
def no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_available", lambda: False)


def hide_cupy(monkeypatch) -> None:
    """Every CuPy module unimportable, as on a machine where it is not installed."""
    for name in [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_backends")] + ["cupy", "cupy_backends"]:
        monkeypatch.setitem(sys.modules, name, None)


def _pip(*pieces: str) -> str:
    reqs = toolchain.PACKAGES[toolchain.cuda_major()]
    return "pip install " + " ".join(f'"{reqs[p]}"' for p in pieces)


# ---- a missing toolchain piece names the pip command -------------------------------------------


def test_compile_without_cupy_is_one_line_with_the_pip_command(capsys, tmp_path, monkeypatch) -> None:
    hide_cupy(monkeypatch)
    out = tmp_path / "x.fplan"
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "--arch", "sm_90", "-o", str(out)])
    msg = one_error_line(err)
    assert code == 1 and msg.startswith("CuPy is not installed")
    assert msg.endswith(_pip("cupy", "nvrtc", "cublas", "pathfinder"))
    assert list(tmp_path.iterdir()) == []


def test_bench_without_cupy_says_cupy_is_missing_not_no_device(capsys, monkeypatch) -> None:
    hide_cupy(monkeypatch)
    code, _, err = call(capsys, ["bench", "gpt2-tiny"])
    msg = one_error_line(err)
    assert code == 1 and "CuPy is not installed" in msg and "sees no CUDA device" not in msg
    assert msg.endswith(_pip("cupy", "nvrtc", "cublas", "pathfinder") + ")")


def test_a_cupy_import_failing_deep_inside_is_one_line(capsys, tmp_path, monkeypatch) -> None:
    def deep(*a, **k):
        raise ModuleNotFoundError("No module named 'cupy_backends'", name="cupy_backends")

    monkeypatch.setattr(fusec, "compile", deep)
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "x.fplan")])
    assert code == 1 and one_error_line(err).startswith("CuPy is not installed (the CUDA side of fusec needs it): pip")


def test_nvrtc_missing_is_one_line_with_the_pip_command(capsys, tmp_path, monkeypatch) -> None:
    def no_nvrtc():
        raise RuntimeError("CuPy failed to load libnvrtc.so.13: OSError: libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(toolchain, "nvrtc_info", no_nvrtc)
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "x.fplan")])
    msg = one_error_line(err)
    assert code == 1 and msg.startswith("NVRTC is not installed") and msg.endswith(_pip("nvrtc"))


def test_cublas_missing_at_run_time_names_the_pip_command(capsys, monkeypatch) -> None:
    from cuda.pathfinder import DynamicLibNotFoundError

    from fusec.cli import run as run_cmd

    def no_cublas(*a, **k):
        raise DynamicLibNotFoundError('Failure finding "libcublasLt.so.13": No such file: libcublasLt.so.13')

    monkeypatch.setattr(device, "gpu_available", lambda: True)
    monkeypatch.setattr(toolchain, "gpu_missing_reason", lambda: None)
    monkeypatch.setattr(run_cmd, "_run_cuda", no_cublas)
    code, out, err = call(capsys, ["run", "gpt2-tiny"])
    msg = one_error_line(err)
    assert code == 1 and out == ""
    assert msg.startswith("cuBLAS/cuBLASLt is not installed") and msg.endswith(_pip("cublas"))


def test_explain_missing_leaves_other_errors_alone() -> None:
    assert toolchain.explain_missing(ModuleNotFoundError("No module named 'yaml'", name="yaml")) is None
    assert toolchain.explain_missing(RuntimeError("something else")) is None
    assert "cuda-pathfinder" in toolchain.explain_missing(ModuleNotFoundError("x", name="cuda.pathfinder"))


# ---- --debug, internal errors, compiler logs ---------------------------------------------------


def test_debug_flag_and_env_show_the_traceback(capsys, monkeypatch, no_gpu) -> None:
    argv = ["run", "gpt2-tiny", "--backend", "cuda"]
    code, _, err = call(capsys, argv)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1
    for extra, env in (([], "1"), (["--debug"], None)):
        if env:
            monkeypatch.setenv("FUSEC_DEBUG", env)
        else:
            monkeypatch.delenv("FUSEC_DEBUG", raising=False)
        code, _, err = call(capsys, [*extra, *argv])
        assert code == 1 and "Traceback (most recent call last)" in err
        assert err.splitlines()[-1].startswith("fusec: error: --backend cuda needs a GPU")
    code, _, err = call(capsys, [*argv, "--debug"])  # after the command too
    assert code == 1 and "Traceback" in err


def test_an_unexpected_exception_is_one_line_exit_70(capsys, monkeypatch) -> None:
    from fusec.cli import run as run_cmd

    def bug(args):
        raise TypeError("unsupported operand\nsecond line")

    monkeypatch.setattr(run_cmd, "_load_model", bug)
    code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference"])
    msg = one_error_line(err)
    assert code == 70 and msg.startswith("internal error, a bug in fusec: TypeError: unsupported operand (")
    assert "--debug" in msg and err.count("\n") == 1


def test_a_compiler_log_goes_to_a_file_and_the_error_stays_one_line(capsys, tmp_path, monkeypatch) -> None:
    log = "fc_x.cu(3): error: identifier \"y\" is undefined\n1 error detected\nptxas fatal : cannot compile"

    def fails(*a, **k):
        raise KernelCompileError("fc_x", log, "source")

    monkeypatch.setattr(fusec, "compile", fails)
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "x.fplan")])
    msg = one_error_line(err)
    assert code == 1 and err.count("\n") == 1 and "ptxas fatal" not in err
    assert msg.startswith("NVRTC failed to compile kernel 'fc_x' (full log: ")
    path = msg.split("(full log: ")[1].rstrip(")")
    try:
        assert "ptxas fatal : cannot compile" in Path(path).read_text()
    finally:
        os.unlink(path)


# ---- --arch checked up front ---------------------------------------------------------------------


def _nvrtc_archs() -> list[int]:
    from cupy_backends.cuda.libs import nvrtc

    return sorted(int(a) for a in nvrtc.getSupportedArchs())


@pytest.mark.parametrize("arch, dtype, needle", [
    ("sm_75", "fp16", "--arch sm_75 is too old: fusec's kernels need sm_80 or newer (fp16/bf16 tensor-core mma"),
    ("sm_75", "fp32", "--arch sm_75 is too old"),
    ("sm_70", "bf16", "--arch sm_70 is too old"),
    ("sm_90a", "fp16", "--arch sm_90a: arch-specific targets are not supported; fusec's kernels use no sm_90a-only "
                       "instructions, so use --arch sm_90"),
    ("volta", "fp16", "--arch must look like sm_80 or sm_90, got 'volta'"),
])
def test_arch_is_refused_before_compiling(capsys, tmp_path, monkeypatch, arch, dtype, needle) -> None:
    def must_not_compile(*a, **k):
        raise AssertionError("compiled although --arch was refused")

    monkeypatch.setattr(fusec, "compile", must_not_compile)
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "x.fplan"), "--arch", arch,
                                 "--dtype", dtype])
    assert code == 1 and one_error_line(err).startswith(needle) and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_arch_this_nvrtc_lacks_lists_the_ones_it_has(capsys, tmp_path) -> None:
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    have = _nvrtc_archs()
    missing = next(n for n in range(80, 200) if n not in have)
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "x.fplan"), "--arch", f"sm_{missing}"])
    msg = one_error_line(err)
    assert code == 1 and msg.startswith(f"--arch sm_{missing}: this NVRTC (")
    assert msg.split("compiles for ")[1] == ", ".join(f"sm_{a}" for a in have if a >= 80)


def test_the_library_refuses_an_old_arch_before_nvrtc() -> None:
    from fusec.codegen.compile import compile_cuda
    from fusec.errors import InputError

    with pytest.raises(InputError, match="sm_75 is too old"):
        compile_cuda('extern "C" __global__ void k() {}', "k", "sm_75", use_disk=False)


# ---- no GPU: the reference result comes even when the side compile fails ----------------------


def test_run_without_gpu_prints_the_reference_when_the_side_compile_fails(capsys, monkeypatch, no_gpu) -> None:
    def fails(*a, **k):
        raise KernelCompileError("fc_attn_1", "line one\nline two", "src")

    monkeypatch.setattr(fusec, "compile", fails)
    code, out, err = call(capsys, ["run", "gpt2-tiny"])
    assert code == 0 and "backend reference" in out.splitlines()[0]
    assert any(ln.startswith("output logits  f32[1,16,1000]") for ln in out.splitlines())
    notes = err.splitlines()
    assert len(notes) == 2 and notes[1] == ("the side compile for the GPU failed, the reference result follows: "
                                            "NVRTC failed to compile kernel 'fc_attn_1':")


# ---- Ctrl-C ------------------------------------------------------------------------------------------


def test_ctrl_c_while_writing_a_plan_exits_130_and_leaves_nothing(capsys, tmp_path, monkeypatch) -> None:
    from fusec.fsutil import atomic_write
    from fusec.plan import Plan

    def interrupted_save(self, path):
        with atomic_write(path) as f:
            f.write(b"FUSECPLN half a plan")
            raise KeyboardInterrupt

    monkeypatch.setattr(Plan, "save", interrupted_save)
    code, _, err = call(capsys, ["-q", "compile", "gpt2-tiny", "--dtype", "fp32", "-o", str(tmp_path / "x.fplan")])
    assert code == 130 and err == "fusec: error: interrupted\n"
    assert list(tmp_path.iterdir()) == []


def test_sigint_during_compile_exits_130_without_a_traceback(tmp_path) -> None:
    env = {**os.environ, "FUSEC_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    out = tmp_path / "out" / "x.fplan"
    out.parent.mkdir()
    # SIGINT's default action in the child: a test run started in the background (`cmd &`) ignores
    # SIGINT, children inherit that, and Python then leaves it ignored (the compile ran to the end)
    proc = subprocess.Popen([sys.executable, "-m", "fusec", "-v", "compile", "gpt2-tiny", "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    deadline = time.monotonic() + 120
    for line in proc.stderr:  # -v prints every step: interrupt in the middle of compiling the kernels
        seen.append(line)
        if " kernel " in line or time.monotonic() > deadline:
            break
    proc.send_signal(signal.SIGINT)
    rest_out, rest_err = proc.communicate(timeout=120)
    err = "".join(seen) + rest_err
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "fusec: error: interrupted" and "Traceback" not in err
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("argv", [["run", "gpt2-tiny", "--backend", "cuda"], ["ab", "gpt2-tiny"]])
def test_gpu_commands_without_cupy_say_cupy_is_missing_not_no_device(capsys, monkeypatch, argv) -> None:
    monkeypatch.setattr(toolchain, "installed_cupy", lambda: None)
    code, out, err = call(capsys, argv)
    msg = one_error_line(err)
    assert code == 1 and out == "" and "CuPy sees no" not in msg
    assert f"needs a GPU: no GPU usable (CuPy is not installed: {_pip('cupy', 'nvrtc', 'cublas', 'pathfinder')})" in msg


def test_run_without_cupy_notes_it_once_and_runs_the_reference(capsys, monkeypatch) -> None:
    monkeypatch.setattr(toolchain, "installed_cupy", lambda: None)
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    hide_cupy(monkeypatch)
    code, out, err = call(capsys, ["run", "gpt2-tiny"])
    assert code == 0 and out.startswith("model gpt2-tiny  backend reference")
    first, second = err.splitlines()
    assert first == "no GPU usable (CuPy is not installed): running the numpy reference backend"
    assert second.startswith("the side compile for the GPU failed, the reference result follows: CuPy is not installed")
