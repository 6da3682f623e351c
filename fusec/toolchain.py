"""What the GPU side of fusec loads, and whether this machine has it.

The CUDA path needs: a CUDA driver and a GPU (to run plans), CuPy (device memory, launches), NVRTC
(kernels are compiled at plan-build time; no GPU needed), cuBLAS and cuBLASLt (matrix products at
run time) and cuda-pathfinder (finds the pip-installed libraries). The ``cuda12``/``cuda13`` extras
in pyproject.toml install exactly ``PACKAGES[12]``/``PACKAGES[13]`` (tests/test_cli_doctor.py
checks that they agree).

``checks()`` probes each piece without raising (``fusec doctor``), ``versions()`` is what
``fusec --version`` prints, ``explain_missing(exc)`` turns the exception a missing piece raises deep
inside CuPy or cuda-pathfinder into one line naming the pip command that fixes it, and
``require_compiler()``/``require_gpu()`` check up front, before any work.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import importlib.util
import os
import platform
from typing import Any

from fusec.errors import FusecError

# The pip requirements of each CUDA major's extra, by the piece they bring.
PACKAGES: dict[int, dict[str, str]] = {
    12: {"cupy": "cupy-cuda12x>=13", "nvrtc": "nvidia-cuda-nvrtc-cu12>=12,<13",
         "cublas": "nvidia-cublas-cu12>=12,<13", "pathfinder": "cuda-pathfinder>=1.2",
         "bindings": "cuda-bindings>=12.4,<13"},
    13: {"cupy": "cupy-cuda13x>=13", "nvrtc": "nvidia-cuda-nvrtc>=13,<14",
         "cublas": "nvidia-cublas>=13,<14", "pathfinder": "cuda-pathfinder>=1.2",
         "bindings": "cuda-bindings>=13,<14"},
}


class ToolchainError(FusecError):
    """A piece of the CUDA toolchain is missing or unusable; the message names the fix."""


@dataclasses.dataclass
class Check:
    """One probed piece: ``ok``, what was found (``detail``) and, when not ok, the ``fix``."""

    name: str
    ok: bool
    detail: str
    fix: str | None = None
    version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pip_command(*pieces: str, major: int | None = None) -> str:
    """``pip install "req" ...`` for the named pieces of the CUDA ``major`` extra."""
    reqs = PACKAGES[major or cuda_major()]
    return "pip install " + " ".join(f'"{reqs[p]}"' for p in pieces)


def installed_cupy() -> tuple[str, str] | None:
    """(distribution name, version) of the installed CuPy wheel, e.g. ("cupy-cuda13x", "14.2.0")."""
    for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def driver_version() -> int | None:
    """The CUDA driver's version (e.g. 13000 for 13.0) straight from libcuda, or None without one."""
    try:
        lib = ctypes.CDLL("libcuda.so.1" if os.name != "nt" else "nvcuda.dll")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0 or v.value <= 0:
            return None
        return int(v.value)
    except (OSError, AttributeError):
        return None


def cuda_major() -> int:
    """The CUDA major the fix commands target: the installed CuPy's, else the driver's, else 13."""
    cp = installed_cupy()
    if cp is not None and cp[0] in ("cupy-cuda12x", "cupy-cuda13x"):
        return int(cp[0][len("cupy-cuda"):-1])
    drv = driver_version()
    return 12 if drv is not None and drv < 13000 else 13


def _fmt_cuda(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def _load(name: str):
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return load_nvidia_dynamic_lib(name)


def nvrtc_info() -> tuple[tuple[int, int], tuple[int, ...]]:
    """(NVRTC version, the sm_XX numbers it compiles for), through CuPy's binding fusec uses."""
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    archs = tuple(int(a) for a in nvrtc.getSupportedArchs()) if hasattr(nvrtc, "getSupportedArchs") else ()
    return (int(major), int(minor)), archs


def _cublas_versions() -> tuple[str, str]:
    lib = ctypes.CDLL(_load("cublas").abs_path)
    parts = []
    for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
        v = ctypes.c_int(0)
        lib.cublasGetProperty(prop, ctypes.byref(v))
        parts.append(str(v.value))
    lt = int(ctypes.CDLL(_load("cublasLt").abs_path).cublasLtGetVersion())
    return ".".join(parts), f"{lt // 10000}.{(lt % 10000) // 100}.{lt % 100}"


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text[:200]


def checks() -> list[Check]:
    """Probe every piece the GPU path loads (never raises)."""
    major = cuda_major()
    out: list[Check] = []
    drv = driver_version()
    cp = installed_cupy()
    if drv is None:
        out.append(Check("driver", False, "no CUDA driver (libcuda.so.1 not found)",
                         "install the NVIDIA driver (compiling plans works without it; running them does not)"))
    elif cp is not None and cp[0].startswith("cupy-cuda") and drv // 1000 < int(cp[0][9:11]):
        out.append(Check("driver", False, f"CUDA {_fmt_cuda(drv)}, older than {cp[0]} needs",
                         f"pip uninstall -y {cp[0]} && {pip_command('cupy', 'nvrtc', 'cublas', major=12)}",
                         _fmt_cuda(drv)))
    else:
        out.append(Check("driver", True, f"CUDA {_fmt_cuda(drv)}", version=_fmt_cuda(drv)))

    cupy_ok = False
    try:
        import cupy

        cupy_ok = True
        out.append(Check("cupy", True, f"{cupy.__version__} ({cp[0] if cp else 'cupy'})", version=str(cupy.__version__)))
    except Exception as e:  # noqa: BLE001 -- any import failure means "no usable CuPy"
        out.append(Check("cupy", False, f"not importable ({_why(e)})", pip_command("cupy", "nvrtc", "cublas", "pathfinder",
                                                                                  major=major)))

    gpu_arch = None
    if cupy_ok:
        try:
            n = int(cupy.cuda.runtime.getDeviceCount())
        except Exception as e:  # noqa: BLE001
            n, why = 0, _why(e)
        else:
            why = "CuPy sees no CUDA device"
        if n > 0:
            from fusec import device

            gpu_arch = "sm_" + str(cupy.cuda.Device(0).compute_capability)
            out.append(Check("gpu", True, device.describe()))
        else:
            why = "no CUDA driver" if drv is None else why
            out.append(Check("gpu", False, f"no GPU found ({why})", "run on a machine with an NVIDIA GPU to run plans"))
    else:
        out.append(Check("gpu", False, "unknown (CuPy is not installed)", "install CuPy first (see cupy)"))

    archs: tuple[int, ...] = ()
    if cupy_ok:
        try:
            (vmaj, vmin), archs = nvrtc_info()
            try:
                where = f" at {_load('nvrtc').abs_path}"
            except Exception:  # noqa: BLE001 -- a system NVRTC pathfinder does not know about
                where = ""
            shown = f"; compiles for sm_{archs[0]} .. sm_{archs[-1]}" if archs else ""
            out.append(Check("nvrtc", True, f"{vmaj}.{vmin}{where}{shown}", version=f"{vmaj}.{vmin}"))
        except Exception as e:  # noqa: BLE001
            out.append(Check("nvrtc", False, f"cannot be loaded ({_why(e)})", pip_command("nvrtc", major=major)))
    else:
        out.append(Check("nvrtc", False, "unknown (fusec calls NVRTC through CuPy, which is not installed)",
                         pip_command("cupy", "nvrtc", major=major)))

    from fusec.codegen.compile import MIN_ARCH

    arch = gpu_arch or "sm_90"
    num = int(arch[3:])
    arch_ok = num >= MIN_ARCH and (not archs or num in archs)
    why = "" if arch_ok else f"; fusec's kernels need sm_{MIN_ARCH} or newer" if num < MIN_ARCH else \
        "; this NVRTC cannot compile for it"
    out.append(Check("arch", arch_ok, f"{arch} ({'this GPU' if gpu_arch else 'the default target without a GPU'}){why}",
                     None if arch_ok or num < MIN_ARCH else pip_command("nvrtc", major=major)))

    try:
        blas, lt = _cublas_versions()
        out.append(Check("cublas", True, f"cuBLAS {blas}, cuBLASLt {lt} at {os.path.dirname(_load('cublas').abs_path)}",
                         version=blas))
    except Exception as e:  # noqa: BLE001 -- ImportError (no pathfinder), DynamicLibNotFoundError, OSError
        fix = pip_command("cublas", major=major) if not isinstance(e, ImportError) else \
            pip_command("pathfinder", "cublas", major=major)
        out.append(Check("cublas", False, f"cuBLAS/cuBLASLt not found ({_why(e)})", fix))

    out.append(_cache_check())
    return out


def _cache_check() -> Check:
    from fusec.codegen.compile import cache_dir, check_cache_dirs

    root = cache_dir()
    try:
        check_cache_dirs()
    except FusecError as e:
        return Check("cache", False, str(e), f"set FUSEC_CACHE_DIR to a private directory, or fix {str(root)!r}")
    if root.exists() and not os.access(root, os.W_OK | os.X_OK):
        return Check("cache", False, f"{root} is not writable (kernels are recompiled every time)",
                     f"set FUSEC_CACHE_DIR to a writable directory, or fix {str(root)!r}")
    kernels = root / "kernels"
    n = sum(len(os.listdir(kernels / d)) for d in os.listdir(kernels)) if kernels.is_dir() else 0
    return Check("cache", True, f"{root} ({n} kernel{'s' if n != 1 else ''} cached)" if root.exists()
                 else f"{root} (made on first compile)")


def summary(found: list[Check]) -> dict[str, Any]:
    """What the checks mean: can this machine compile plans, and run them?"""
    ok = {c.name: c.ok for c in found}
    can_compile = ok["cupy"] and ok["nvrtc"]
    can_run = can_compile and ok["driver"] and ok["gpu"] and ok["cublas"] and ok["arch"]
    return {"can_compile": can_compile, "can_run": can_run, "cuda": cuda_major(),
            "missing": [c.name for c in found if not c.ok]}


def versions() -> dict[str, str | None]:
    """fusec and its toolchain's versions (None: not installed / no driver)."""
    from fusec import __version__

    out: dict[str, str | None] = {"fusec": __version__, "python": platform.python_version()}
    for name in ("numpy", "onnx"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    cp = installed_cupy()
    out["cupy"] = f"{cp[1]} ({cp[0]})" if cp else None
    try:
        (vmaj, vmin), _ = nvrtc_info()
        out["nvrtc"] = f"{vmaj}.{vmin}"
    except Exception:  # noqa: BLE001 -- no CuPy or no libnvrtc
        out["nvrtc"] = None
    drv = driver_version()
    out["cuda_driver"] = _fmt_cuda(drv) if drv else None
    return out


def explain_missing(exc: BaseException) -> str | None:
    """One line naming the missing piece and the pip command, when ``exc`` is what a missing
    CuPy, NVRTC, cuBLAS or cuda-pathfinder raises; None for anything else."""
    name = getattr(exc, "name", None) or ""
    text = str(exc)
    if isinstance(exc, ImportError) and (name.split(".")[0] in ("cupy", "cupy_backends") or "cupy" in text):
        return ("CuPy is not installed (the CUDA side of fusec needs it): "
                + pip_command("cupy", "nvrtc", "cublas", "pathfinder"))
    if isinstance(exc, ImportError) and (name.startswith("cuda") or "cuda.pathfinder" in text):
        return f"cuda-pathfinder is not installed (it finds the CUDA libraries): {pip_command('pathfinder')}"
    low = text.lower()
    if type(exc).__name__ == "DynamicLibNotFoundError" or (isinstance(exc, (OSError, RuntimeError, ImportError))
                                                          and ("libnvrtc" in low or "libcublas" in low)):
        if "cublas" in low:
            return f"cuBLAS/cuBLASLt is not installed (fusec's matrix products need it): {pip_command('cublas')}"
        if "nvrtc" in low:
            return f"NVRTC is not installed (fusec compiles its kernels with it): {pip_command('nvrtc')}"
        return f"a CUDA library is missing ({_why(exc)}): {pip_command('cupy', 'nvrtc', 'cublas')}"
    return None


def require_compiler() -> None:
    """ToolchainError naming the pip command unless CuPy and NVRTC load (compiling needs no GPU)."""
    try:
        nvrtc_info()
    except Exception as e:  # noqa: BLE001
        why = explain_missing(e)
        if why is None:
            why = f"NVRTC cannot be used ({_why(e)}): {pip_command('nvrtc')}"
        raise ToolchainError(why) from e


def gpu_missing_reason(with_fix: bool = True) -> str | None:
    """Why no GPU is usable here, in a few words (CuPy missing, no driver, no device); None with one.
    ``with_fix``: name the pip command when CuPy is missing."""
    if installed_cupy() is None or not _importable("cupy"):
        fix = ": " + pip_command("cupy", "nvrtc", "cublas", "pathfinder") if with_fix else ""
        return f"no GPU usable (CuPy is not installed{fix})"
    from fusec import device

    if device.gpu_available():
        return None
    if driver_version() is None:
        return "no GPU found (no CUDA driver: libcuda.so.1 is not on this machine)"
    return "no GPU found (CuPy sees no CUDA device)"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError, AttributeError):  # a module entry set to None (hidden) or broken
        return False


def require_gpu(what: str) -> None:
    """ToolchainError saying exactly why ``what`` cannot run here: no CuPy, no driver or no device."""
    why = gpu_missing_reason()
    if why is not None:
        raise ToolchainError(f"{what} needs a GPU: {why}")
