"""The toolchain a plan was compiled with, recorded in its manifest, and the check made when it is
loaded on a GPU.

Recorded at compile (``toolchain()``): ``nvrtc_version`` (the CUDA compiler that made the cubins),
``cupy_version`` and ``driver_version`` (the CUDA version the compiling machine's driver supports,
"none" on a machine without one: fusec cross-compiles). Checked at load (``check``), each
problem one line naming the field:

- ``arch``: a cubin runs only on its own architecture: refused ("plan compiled for sm_90 but this
  GPU is sm_80"), unless the plan is loaded with ``recompile=True``;
- ``nvrtc_version``: cubins from CUDA N.x need a driver for CUDA N or newer: refused when this
  driver's major version is older; a warning when only its minor version is (CUDA's minor-version
  compatibility runs the cubins, features of the newer minor may be missing);
- ``cupy_version``: the runtime only calls CuPy's API: a warning when the major versions differ;
- ``driver_version``: for information; a warning when the compiling machine's driver was of a
  newer CUDA major version than this one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

from fusec.errors import FusecError

FIELDS = ("nvrtc_version", "cupy_version", "driver_version")


class PlanArchError(FusecError):
    """The plan's ``arch`` does not match the GPU it is asked to run on."""


class PlanToolchainError(FusecError):
    """The plan was compiled with a CUDA toolchain this machine's driver cannot run."""


class PlanToolchainWarning(UserWarning):
    """The plan was compiled with another (compatible) toolchain; the message names the field."""


def _cupy() -> Any:
    import cupy

    return cupy


def nvrtc_version() -> str:
    from fusec.codegen.compile import nvrtc_version as v

    return ".".join(map(str, v()))


def cupy_version() -> str:
    try:
        return str(_cupy().__version__)
    except Exception:
        return "unavailable"


def driver_version() -> str:
    """The CUDA version this machine's driver supports ("13.0"), or "none" without a driver."""
    try:
        v = int(_cupy().cuda.runtime.driverGetVersion())
    except Exception:
        return "none"
    return "none" if v <= 0 else f"{v // 1000}.{(v % 1000) // 10}"


def toolchain() -> dict[str, str]:
    """The manifest fields recorded at compile."""
    return {"nvrtc_version": nvrtc_version(), "cupy_version": cupy_version(), "driver_version": driver_version()}


def _major_minor(text: Any) -> tuple[int, int] | None:
    m = re.match(r"([0-9]+)(?:\.([0-9]+))?", str(text))
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def check(manifest: Mapping[str, Any], where: str, gpu_arch: str, here: Mapping[str, str] | None = None,
          arch_ok: bool = False) -> list[str]:
    """Check a plan's recorded toolchain against this machine (a GPU is present: ``gpu_arch``).
    Raises PlanArchError / PlanToolchainError naming the field; warns (PlanToolchainWarning) and
    returns the warning lines for compatible differences. ``here``: this machine's versions
    (``toolchain()``; given by tests). ``arch_ok``: the caller recompiles for ``gpu_arch``."""
    arch = str(manifest.get("arch"))
    if arch != gpu_arch and not arch_ok:
        raise PlanArchError(f"{where}: plan compiled for {arch} but this GPU is {gpu_arch} (field 'arch'); "
                            "load it with recompile=True or recompile it: fusec compile PLAN --arch "
                            f"{gpu_arch} -o NEW_PLAN")
    here = dict(here) if here is not None else {"cupy_version": cupy_version(), "driver_version": driver_version()}
    notes: list[str] = []
    drv = _major_minor(here.get("driver_version"))
    built = _major_minor(manifest.get("nvrtc_version"))
    if drv is not None and built is not None and not arch_ok:
        if drv[0] < built[0]:
            raise PlanToolchainError(
                f"{where}: plan compiled with NVRTC {manifest['nvrtc_version']} (field 'nvrtc_version'), but this "
                f"driver runs CUDA {here['driver_version']} at most; update the driver, or recompile the plan "
                "here: fusec compile PLAN -o NEW_PLAN")
        if drv < built:
            notes.append(f"{where}: plan compiled with NVRTC {manifest['nvrtc_version']} (field 'nvrtc_version'), "
                         f"this driver runs CUDA {here['driver_version']}: running through CUDA's minor-version "
                         "compatibility")
    mine, theirs = _major_minor(here.get("cupy_version")), _major_minor(manifest.get("cupy_version"))
    if mine is not None and theirs is not None and mine[0] != theirs[0]:
        notes.append(f"{where}: plan compiled with CuPy {manifest['cupy_version']} (field 'cupy_version'), "
                     f"running with CuPy {here['cupy_version']}")
    compiled_on = _major_minor(manifest.get("driver_version"))
    if drv is not None and compiled_on is not None and compiled_on[0] > drv[0]:
        notes.append(f"{where}: plan compiled on a machine whose driver runs CUDA {manifest['driver_version']} "
                     f"(field 'driver_version'), this one runs CUDA {here['driver_version']}")
    for line in notes:
        warnings.warn(line, PlanToolchainWarning, stacklevel=3)
    return notes
