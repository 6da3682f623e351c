"""cuBLAS matrix products on raw arena pointers, with nothing allocated per call.

fusec binds the five cuBLAS entry points it needs through ctypes rather than CuPy's binding:
CuPy's refuses any cuBLAS call during stream capture (so GEMMs could not enter a CUDA graph)
and re-points the handle at CuPy's current stream on every call. Here the stream is explicit.

The plan owns one cuBLAS handle with a fixed workspace (``cublasSetWorkspace_v2``), so GEMMs
never allocate during a run and are safe to capture. Launch records describe row-major
products; ``GemmCall`` converts them once, at load, into the column-major call cuBLAS takes
(C^T = B^T A^T).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import numpy as np

# cudaDataType and cublasComputeType_t values (cuda's library_types.h / cublas_api.h).
CUDA_TYPE = {"f32": 0, "f16": 2, "bf16": 14}
COMPUTE = {"f32": 68, "tf32": 77}  # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20

_vp, _i, _ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(_vp)]
    lib.cublasDestroy_v2.argtypes = [_vp]
    lib.cublasSetStream_v2.argtypes = [_vp, _vp]
    lib.cublasSetWorkspace_v2.argtypes = [_vp, _vp, ctypes.c_size_t]
    lib.cublasGemmStridedBatchedEx.argtypes = [
        _vp, _i, _i, _i, _i, _i, _vp, _vp, _i, _i, _ll, _vp, _i, _i, _ll, _vp, _vp, _i, _i, _ll, _i, _i, _i]
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {rc}")


class Handle:
    """A cuBLAS handle owned by one plan, with its own preallocated workspace."""

    def __init__(self) -> None:
        import cupy

        h = _vp()
        _check(_lib().cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.ptr = h.value
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        _check(_lib().cublasSetWorkspace_v2(self.ptr, self.workspace.data.ptr, WORKSPACE_BYTES), "cublasSetWorkspace")
        self._stream: int | None = None
        self._lt = 0  # cuBLASLt handle (fusec.runtime.cublaslt), made with the first epilogue GEMM's

    def lt(self) -> int:
        """The plan's cuBLASLt handle; it shares this handle's workspace (GEMMs run in stream order)."""
        if not self._lt:
            from fusec.runtime import cublaslt

            self._lt = cublaslt.create_handle()
        return self._lt

    def set_stream(self, stream_ptr: int) -> None:
        if stream_ptr != self._stream:
            _check(_lib().cublasSetStream_v2(self.ptr, stream_ptr), "cublasSetStream")
            self._stream = stream_ptr

    def close(self) -> None:
        if self._lt:
            from fusec.runtime import cublaslt

            cublaslt.destroy_handle(self._lt)
            self._lt = 0
        if self.ptr:
            _lib().cublasDestroy_v2(self.ptr)
            self.ptr = 0

    def __del__(self) -> None:  # A/B experiments create many executors: release each handle
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


@dataclasses.dataclass
class GemmCall:
    """One strided-batched GEMM: C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b], row-major.

    Pointers are absolute device addresses resolved at load; ``trans_b`` means B is stored
    [N, K] (e.g. an nn.Linear weight), and cuBLAS reads it transposed (no copy).

    ``epilogue`` (a ``fusec.runtime.cublaslt.EPILOGUES`` name), ``bias`` ([N] vector) and ``c_in``
    (an [M, N] matrix read as C while the result goes to ``c``; with ``beta`` = 1 a residual) make
    the call a cuBLASLt product with its epilogue fused (``fusec.runtime.cublaslt``).
    """

    m: int
    n: int
    k: int
    batch: int
    a: int
    b: int
    c: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    trans_a: bool
    trans_b: bool
    dtype: str
    compute: str
    alpha: float = 1.0
    beta: float = 0.0
    epilogue: str | None = None
    bias: int | None = None
    c_in: int | None = None
    _scalars: np.ndarray | None = None
    _lt: Any = None

    def __post_init__(self) -> None:
        # alpha/beta live in host memory for the lifetime of the call (host pointer mode);
        # under graph capture cuBLAS reads them at capture time.
        self._scalars = np.array([self.alpha, self.beta], dtype=np.float32)

    def __call__(self, handle: Handle, stream_ptr: int) -> None:
        assert self._scalars is not None
        if self.epilogue is not None or self.c_in is not None:
            self._call_lt(handle, stream_ptr)
            return
        t = CUDA_TYPE[self.dtype]
        ap = self._scalars.ctypes.data
        handle.set_stream(stream_ptr)
        # row-major C = A @ B  <=>  column-major C^T = B^T @ A^T: swap operands, swap m/n.
        rc = _lib().cublasGemmStridedBatchedEx(
            handle.ptr,
            _OP_T if self.trans_b else _OP_N, _OP_T if self.trans_a else _OP_N,
            self.n, self.m, self.k,
            ap, self.b, t, self.ldb, self.stride_b,
            self.a, t, self.lda, self.stride_a,
            ap + 4, self.c, t, self.ldc, self.stride_c,
            self.batch, COMPUTE[self.compute], _GEMM_DEFAULT)
        _check(rc, f"cublasGemmStridedBatchedEx(m={self.m}, n={self.n}, k={self.k}, batch={self.batch}, {self.dtype})")

    def _call_lt(self, handle: Handle, stream_ptr: int) -> None:
        # prepared at the first call: the executor makes it outside capture (warm-up or eager run)
        if self._lt is None:
            from fusec.runtime.cublaslt import LtMatmul

            self._lt = LtMatmul(self, handle.lt(), handle.workspace.data.ptr, WORKSPACE_BYTES)
        self._lt(stream_ptr)
