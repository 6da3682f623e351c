"""cuBLAS matrix products on raw arena pointers, with nothing allocated per call.

The plan owns one cuBLAS handle with a fixed workspace (set through ``cublasSetWorkspace_v2``,
which CuPy's binding does not expose), so GEMMs are safe to capture into a CUDA graph and never
allocate during a run. Launch records describe row-major products; ``GemmCall`` converts them
once, at load, into the column-major call cuBLAS takes (C^T = B^T A^T).
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import numpy as np

# cudaDataType and cublasComputeType_t values (cuda's library_types.h / cublas_api.h).
CUDA_TYPE = {"f32": 0, "f16": 2, "bf16": 14}
COMPUTE = {"f32": 68, "tf32": 77}  # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32
_OP_N, _OP_T = 0, 1
_GEMM_DEFAULT = -1
WORKSPACE_BYTES = 32 << 20


def _cublas_lib() -> ctypes.CDLL:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    return ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)


class Handle:
    """A cuBLAS handle owned by one plan, with its own preallocated workspace."""

    def __init__(self) -> None:
        import cupy
        from cupy_backends.cuda.libs import cublas

        self._cublas = cublas
        self.ptr = cublas.create()
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=cupy.uint8)
        rc = _cublas_lib().cublasSetWorkspace_v2(ctypes.c_void_p(self.ptr), ctypes.c_void_p(self.workspace.data.ptr),
                                                 ctypes.c_size_t(WORKSPACE_BYTES))
        if rc != 0:
            raise RuntimeError(f"cublasSetWorkspace_v2 failed with status {rc}")
        self._stream = -1

    def set_stream(self, stream_ptr: int) -> None:
        if stream_ptr != self._stream:
            self._cublas.setStream(self.ptr, stream_ptr)
            self._stream = stream_ptr

    def close(self) -> None:
        if self.ptr:
            self._cublas.destroy(self.ptr)
            self.ptr = 0


@dataclasses.dataclass
class GemmCall:
    """One strided-batched GEMM: C[b] = alpha * op(A[b]) @ op(B[b]) + beta * C[b], row-major.

    Pointers are absolute device addresses resolved at load; ``trans_b`` means B is stored
    [N, K] (e.g. an nn.Linear weight), and cuBLAS reads it transposed (no copy).
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
    _scalars: Any = None

    def __post_init__(self) -> None:
        # alpha/beta live in host memory for the lifetime of the call (host pointer mode);
        # under graph capture cuBLAS reads them at capture time.
        self._scalars = np.array([self.alpha, self.beta], dtype=np.float32)

    def __call__(self, handle: Handle) -> None:
        from cupy_backends.cuda.libs import cublas

        t = CUDA_TYPE[self.dtype]
        ap = self._scalars.ctypes.data
        # row-major C = A @ B  <=>  column-major C^T = B^T @ A^T: swap operands, swap m/n.
        cublas.gemmStridedBatchedEx(
            handle.ptr,
            _OP_T if self.trans_b else _OP_N, _OP_T if self.trans_a else _OP_N,
            self.n, self.m, self.k,
            ap, self.b, t, self.ldb, self.stride_b,
            self.a, t, self.lda, self.stride_a,
            ap + 4, self.c, t, self.ldc, self.stride_c,
            self.batch, COMPUTE[self.compute], _GEMM_DEFAULT)
