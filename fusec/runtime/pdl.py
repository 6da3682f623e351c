"""Kernel launches with programmatic stream serialization (programmatic dependent launch, PDL,
sm_90+): the kernel may be scheduled while the kernel before it in the stream still runs, and
waits for it with ``griddepcontrol.wait`` (templates/common.cuh ``fc_pdl_wait``) after loading
what no earlier kernel writes. Captured into a CUDA graph, the dependency becomes a programmatic
edge, so the graph replay overlaps the kernels too.

CuPy's ``RawKernel`` takes no launch attributes, so these launches go through NVIDIA's own driver
binding (``cuda-bindings``: ``cuLaunchKernelEx``), on the function CuPy loaded. The parameters are
packed once, at plan load, into a ``void*[]`` that lives as long as the launch: a launch costs one
binding call.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class PdlUnavailable(RuntimeError):
    """cuda-bindings is missing or too old; the plan then launches plainly (same results)."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as e:  # the cuda12/cuda13 extras install it; a bare CuPy install may lack it
        raise PdlUnavailable(f"cuda-bindings is not installed ({e})") from None
    return driver


def available() -> bool:
    try:
        _driver()
        return True
    except PdlUnavailable:
        return False


class PdlLaunch:
    """One kernel launch with the programmatic-serialization attribute, over fixed arguments."""

    def __init__(self, function_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], smem: int,
                 args: tuple[Any, ...]):
        drv = _driver()
        self._drv = drv
        # each argument's value in its own buffer, and the array of their addresses (kernelParams)
        self._values = [np.array([a], dtype=np.asarray(a).dtype) for a in args]
        self._params = np.array([v.ctypes.data for v in self._values], dtype=np.uint64)
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg = drv.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (int(x) for x in grid)
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = (int(x) for x in block)
        cfg.sharedMemBytes = int(smem)
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        self._cfg = cfg
        self._attr = attr
        self._fn = drv.CUfunction(int(function_ptr))
        self._stream_ptr: int | None = None

    def __call__(self, stream: Any) -> None:
        drv = self._drv
        if stream.ptr != self._stream_ptr:
            self._cfg.hStream = drv.CUstream(int(stream.ptr))
            self._stream_ptr = stream.ptr
        (err,) = drv.cuLaunchKernelEx(self._cfg, self._fn, int(self._params.ctypes.data), 0)
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx failed: {err.name}")
