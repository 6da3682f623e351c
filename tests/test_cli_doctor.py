"""Install and toolchain (issue 11 item 1): the CUDA extras bring everything the GPU path loads,
`fusec doctor` reports each piece with the command that fixes a missing one, `--version` lists the
toolchain, `python -m fusec` works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import gpu_available
from test_cli import call

from fusec import toolchain

REPO = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
PIECES = ("driver", "cupy", "gpu", "nvrtc", "arch", "cublas", "cache")


def _extras() -> dict[str, list[str]]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]


@pytest.mark.parametrize("major, nvrtc, cublas", [(12, "nvidia-cuda-nvrtc-cu12", "nvidia-cublas-cu12"),
                                                  (13, "nvidia-cuda-nvrtc", "nvidia-cublas")])
def test_each_cuda_extra_brings_cupy_nvrtc_cublas_and_pathfinder(major, nvrtc, cublas) -> None:
    # the PyPI names (checked with `pip download --no-deps`): cuBLAS 13 ships libcublas and libcublasLt
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in _extras()[f"cuda{major}"]}
    assert names == {f"cupy-cuda{major}x", nvrtc, cublas, "cuda-pathfinder", "cuda-bindings"}
    # doctor's fix commands name exactly the extra's requirements
    assert sorted(_extras()[f"cuda{major}"]) == sorted(toolchain.PACKAGES[major].values())


def test_doctor_reports_every_piece_and_exits_by_whether_plans_can_run(capsys) -> None:
    code, out, err = call(capsys, ["doctor"])
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln and not ln.startswith(" ")}
    assert set(PIECES) <= set(rows), out
    assert err == ""
    assert out.splitlines()[-1].startswith("compile plans: ")
    # conftest probes CuPy on its own: no GPU there means the GPU path cannot work, so exit 1
    if not gpu_available():
        assert code == 1 and "MISSING" in rows["gpu"]


def test_doctor_json_names_a_fix_for_every_missing_piece(capsys) -> None:
    code, out, _ = call(capsys, ["doctor", "--json"])
    rep = json.loads(out)
    checks = {c["name"]: c for c in rep["checks"]}
    assert set(checks) == set(PIECES)
    assert rep["missing"] == [c["name"] for c in rep["checks"] if not c["ok"]]
    for c in rep["checks"]:
        assert c["ok"] or c["fix"], c
    assert code == (0 if rep["can_run"] else 1)
    assert rep["versions"]["fusec"].startswith("0.")
    from fusec.codegen.compile import cache_dir

    assert checks["cache"]["detail"].split()[0] == str(cache_dir())


def test_doctor_without_cupy_gives_the_pip_command(capsys, monkeypatch) -> None:
    # every CuPy module unimportable, as on a machine where it is not installed
    for name in [m for m in sys.modules if m.split(".")[0] in ("cupy", "cupy_backends")] + ["cupy", "cupy_backends"]:
        monkeypatch.setitem(sys.modules, name, None)
    code, out, _ = call(capsys, ["doctor"])
    assert code == 1
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("cupy "))
    assert "MISSING" in lines[i]
    fix = lines[i + 1].strip()
    major = toolchain.cuda_major()
    assert fix == "fix: pip install " + " ".join(f'"{toolchain.PACKAGES[major][p]}"'
                                                 for p in ("cupy", "nvrtc", "cublas", "pathfinder"))
    assert "compile plans: no" in lines[-1]


def test_doctor_without_cublas_names_the_cublas_package(capsys, monkeypatch) -> None:
    from cuda.pathfinder import DynamicLibNotFoundError

    def missing(name):
        raise DynamicLibNotFoundError(f'Failure finding "lib{name}.so.13": No such file')

    monkeypatch.setattr(toolchain, "_load", missing)
    code, out, _ = call(capsys, ["doctor", "--json"])
    cublas = next(c for c in json.loads(out)["checks"] if c["name"] == "cublas")
    assert code == 1 and not cublas["ok"]
    assert cublas["fix"] == f'pip install "{toolchain.PACKAGES[toolchain.cuda_major()]["cublas"]}"'


def test_version_lists_the_toolchain(capsys) -> None:
    import numpy
    import onnx

    code, out, _ = call(capsys, ["--version"])
    assert code == 0
    first, second = out.splitlines()
    assert first == f"fusec {__import__('fusec').__version__}"
    assert f"numpy {numpy.__version__}" in second and f"onnx {onnx.__version__}" in second
    for name in ("cupy", "nvrtc", "cuda driver", "python"):
        assert name in second


def test_python_dash_m_fusec_runs_the_cli(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "fusec", "--version"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("fusec 0."), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fusec", "frobnicate"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


@pytest.mark.gpu
def test_doctor_on_a_gpu_reports_it_and_exits_0(capsys) -> None:
    import cupy

    code, out, _ = call(capsys, ["doctor", "--json"])
    rep = json.loads(out)
    checks = {c["name"]: c for c in rep["checks"]}
    assert code == 0 and rep["can_run"] and rep["can_compile"], rep
    props = cupy.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    assert checks["gpu"]["ok"] and name in checks["gpu"]["detail"]
    assert checks["arch"]["detail"].startswith(f"sm_{props['major']}{props['minor']} (this GPU)")
    assert checks["driver"]["ok"] and checks["cublas"]["ok"] and checks["nvrtc"]["ok"]
    assert rep["versions"]["cuda_driver"] is not None


@pytest.mark.gpu
def test_doctor_text_on_a_gpu_has_nothing_missing(capsys) -> None:
    code, out, _ = call(capsys, ["doctor"])
    assert code == 0 and "MISSING" not in out
    assert out.splitlines()[-1].startswith("compile plans: yes   run plans on a GPU: yes")
