"""Is there a GPU fusec can use? CuPy imports without one (and without a driver), so ask it."""

from __future__ import annotations


def gpu_available() -> bool:
    """True when CuPy sees at least one CUDA device. Never raises: no CuPy, no driver, a driver
    too old for the runtime, or any other failure all mean "no GPU" here."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:
        return False


def describe() -> str:
    """One line about device 0 (name, compute capability, memory), or why there is none."""
    if not gpu_available():
        return "no GPU found (CuPy sees no CUDA device)"
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        mem_gib = props["totalGlobalMem"] / 2**30
        count = cupy.cuda.runtime.getDeviceCount()
        more = f" (+{count - 1} more)" if count > 1 else ""
        return f"{name}, sm_{props['major']}{props['minor']}, {mem_gib:.1f} GiB{more}"
    except Exception as e:  # a description must never be the thing that fails
        return f"CUDA device present, properties unavailable ({type(e).__name__})"


def gpu_arch() -> str | None:
    """``sm_XX`` of the current CUDA device, or None when there is no usable GPU."""
    if not gpu_available():
        return None
    try:
        import cupy

        return "sm_" + str(cupy.cuda.Device().compute_capability)
    except Exception:
        return None
