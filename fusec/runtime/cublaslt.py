"""cuBLASLt matrix products with the epilogue inside the GEMM (bias, ReLU, GELU, residual).

A fused ``gemm_epilogue`` node lowered with the ``cublaslt`` variant is one launch record of type
"gemm" with three extra fields: ``epilogue`` (a name of ``EPILOGUES``), ``bias`` ([space, offset]
of an [N] vector, for the *_bias epilogues) and ``c_in`` ([space, offset] of an [M, N] residual
added with ``beta`` = 1 before the epilogue's activation). cuBLASLt then computes, in fp32, one
rounding to the storage dtype at the end:

    D = act(alpha * op(A) @ op(B) + beta * C_in + bias)

CuPy has no cuBLASLt binding (``cupy_backends.cuda.libs`` holds cublas, cusolver, cusparse, ...
but not cublasLt), so, as for cuBLAS (``fusec.runtime.cublas``), the library is bound through
ctypes: ``libcublasLt`` found by ``cuda.pathfinder`` (the nvidia-cublas wheel or the toolkit).
Everything that can be decided before a run is decided once per launch at its first call, which
the executor makes outside any graph capture: the descriptors, the layouts and the algorithm
(``cublasLtMatmulAlgoGetHeuristic`` with the operands' real pointer alignment: up to ``MAX_ALGOS``
candidates, which ``fusec.runtime.lt_pick`` times at load to keep the fastest). A run then makes
one ``cublasLtMatmul`` call on the plan's stream with the plan's fixed workspace: nothing is
allocated, nothing synchronizes, and the call is capturable.

Row-major to column-major: as in ``GemmCall``, row-major D[M, N] = A @ B is column-major
D^T[N, M] = B^T A^T, so cuBLASLt's "A" is fusec's B and its "B" is fusec's A; the bias of length N
runs along the rows of D^T, which is what cuBLASLt's bias epilogues broadcast.

GELU: cuBLASLt's GELU epilogue is the tanh approximation, so only ``gelu_tanh`` maps to it (an
erf GELU keeps cuBLAS and its separate epilogue kernel; see ``fusec.lower.gemm_lt``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

# cublasLtEpilogue_t
EPILOGUES = {"default": 1, "relu": 2, "bias": 4, "relu_bias": 6, "gelu": 32, "gelu_bias": 36}
WITH_BIAS = ("bias", "relu_bias", "gelu_bias")
_CUDA_R_32F = 0
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_LAYOUT_BATCH_COUNT, _LAYOUT_BATCH_STRIDE = 5, 6
_PREF_MAX_WORKSPACE = 1
_PREF_MIN_ALIGN = {"a": 5, "b": 6, "c": 7, "d": 8}
MAX_ALGOS = 8  # heuristic candidates asked for (fusec.runtime.lt_pick times them)

_vp, _i = ctypes.c_void_p, ctypes.c_int


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    from cuda.pathfinder import load_nvidia_dynamic_lib

    lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
    pp = ctypes.POINTER(_vp)
    sigs = {
        "cublasLtCreate": [pp], "cublasLtDestroy": [_vp],
        "cublasLtMatmulDescCreate": [pp, _i, _i], "cublasLtMatmulDescDestroy": [_vp],
        "cublasLtMatmulDescSetAttribute": [_vp, _i, _vp, ctypes.c_size_t],
        "cublasLtMatrixLayoutCreate": [pp, _i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [_vp], "cublasLtMatrixLayoutSetAttribute": [_vp, _i, _vp, ctypes.c_size_t],
        "cublasLtMatmulPreferenceCreate": [pp], "cublasLtMatmulPreferenceDestroy": [_vp],
        "cublasLtMatmulPreferenceSetAttribute": [_vp, _i, _vp, ctypes.c_size_t],
        "cublasLtMatmulAlgoGetHeuristic": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _i, ctypes.POINTER(_Heuristic),
                                           ctypes.POINTER(_i)],
        "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(_Algo), _vp,
                           ctypes.c_size_t, _vp],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {rc}")


def create_handle() -> int:
    h = _vp()
    _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return int(h.value or 0)


def destroy_handle(ptr: int) -> None:
    _lib().cublasLtDestroy(ptr)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One column-major operand as cuBLASLt takes it: stored rows x cols with leading dim ``ld``."""

    rows: int
    cols: int
    ld: int
    stride: int  # elements between batches


@dataclasses.dataclass(frozen=True)
class LtProblem:
    """The column-major problem a row-major ``GemmCall`` is: D^T = op_a(A_lt) @ op_b(B_lt) (+ C, bias)."""

    trans_a: bool  # cuBLASLt's transa (applies to fusec's B)
    trans_b: bool  # cuBLASLt's transb (applies to fusec's A)
    a: Layout  # fusec's B
    b: Layout  # fusec's A
    d: Layout  # C_in and D: [N rows, M cols]


def problem(m: int, n: int, k: int, lda: int, ldb: int, ldc: int, stride_a: int, stride_b: int, stride_c: int,
            trans_a: bool, trans_b: bool) -> LtProblem:
    """Descriptors of the row-major product C[M, N] = op(A) @ op(B) (A [M, K] or [K, M] when
    ``trans_a``; B [K, N] or [N, K] when ``trans_b``) as cuBLASLt's column-major D^T = B^T A^T.
    A row-major [r, c] matrix with leading dim ld is a column-major [c, r] one with the same ld."""
    b_lt = Layout(k if trans_b else n, n if trans_b else k, ldb, stride_b)
    a_lt = Layout(m if trans_a else k, k if trans_a else m, lda, stride_a)
    return LtProblem(trans_b, trans_a, b_lt, a_lt, Layout(n, m, ldc, stride_c))


def _alignment(ptr: int) -> int:
    """The largest power of two (at most 256) dividing ``ptr``: what cuBLASLt may assume of it."""
    a = 256
    while a > 1 and ptr % a:
        a //= 2
    return a


class LtMatmul:
    """One cuBLASLt product with its epilogue, prepared once (descriptors, algorithm); ``__call__``
    only enqueues. ``call`` is the ``fusec.runtime.cublas.GemmCall`` it executes."""

    def __init__(self, call: Any, lt_handle: int, workspace_ptr: int, workspace_bytes: int) -> None:
        from fusec.runtime.cublas import COMPUTE, CUDA_TYPE

        lib = _lib()
        self._lib = lib
        self.handle = lt_handle
        self.workspace_ptr, self.workspace_bytes = workspace_ptr, workspace_bytes
        epi = call.epilogue or "default"
        if epi not in EPILOGUES:
            raise RuntimeError(f"unknown cuBLASLt epilogue {epi!r} (known: {', '.join(EPILOGUES)})")
        if (epi in WITH_BIAS) != (call.bias is not None):
            raise RuntimeError(f"cuBLASLt epilogue {epi!r} {'needs' if epi in WITH_BIAS else 'takes no'} bias pointer")
        self._owned: list[tuple[str, int]] = []
        p = problem(call.m, call.n, call.k, call.lda, call.ldb, call.ldc, call.stride_a, call.stride_b, call.stride_c,
                    call.trans_a, call.trans_b)
        t = CUDA_TYPE[call.dtype]
        desc = _vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE[call.compute], _CUDA_R_32F), "cublasLtMatmulDescCreate")
        self.desc = int(desc.value or 0)
        self._owned.append(("cublasLtMatmulDescDestroy", self.desc))
        self._set(lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_TRANSA, ctypes.c_int32(int(p.trans_a)))
        self._set(lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_TRANSB, ctypes.c_int32(int(p.trans_b)))
        self._set(lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_EPILOGUE, ctypes.c_uint32(EPILOGUES[epi]))
        if call.bias is not None:
            self._set(lib.cublasLtMatmulDescSetAttribute, self.desc, _DESC_BIAS_POINTER, ctypes.c_void_p(call.bias))
        self.layouts = [self._layout(x, t, call.batch) for x in (p.a, p.b, p.d, p.d)]
        # operands in cuBLASLt's order: A = fusec's B, B = fusec's A, C = the residual (or D), D
        self.ptrs = (call.b, call.a, call.c_in if call.c_in is not None else call.c, call.c)
        pref = _vp()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        self._owned.append(("cublasLtMatmulPreferenceDestroy", int(pref.value or 0)))
        self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref.value, _PREF_MAX_WORKSPACE, ctypes.c_uint64(workspace_bytes))
        for key, ptr in zip("abcd", self.ptrs):
            self._set(lib.cublasLtMatmulPreferenceSetAttribute, pref.value, _PREF_MIN_ALIGN[key],
                      ctypes.c_uint32(_alignment(ptr)))
        heur = (_Heuristic * MAX_ALGOS)()
        count = ctypes.c_int(0)
        what = f"cublasLtMatmul(m={call.m}, n={call.n}, k={call.k}, batch={call.batch}, {call.dtype}, epilogue={epi})"
        _check(lib.cublasLtMatmulAlgoGetHeuristic(lt_handle, self.desc, *self.layouts, pref.value, MAX_ALGOS, heur,
                                                  ctypes.byref(count)), what + " heuristic")
        if count.value < 1:
            raise RuntimeError(f"{what}: cuBLASLt has no algorithm for this problem")
        # the heuristic's candidates, best first by its own estimate; fusec.runtime.lt_pick may time
        # them and switch to another (``use``) before the first run
        self.candidates = [heur[i] for i in range(count.value) if heur[i].state == 0]
        if not self.candidates:
            raise RuntimeError(f"{what}: cuBLASLt's heuristic returned no usable algorithm")
        self.algo = _Algo()
        self.algo_index = 0
        self.use(0)
        self.call = call
        self._what = what
        self._scalars = call._scalars  # host alpha, beta (float32), kept alive by the GemmCall
        ap = self._scalars.ctypes.data
        a, b, c, d = self.ptrs
        la, lb, lc, ld = self.layouts
        # every argument but the stream, converted once: an eager run pays only the call
        self._args = tuple(_vp(x) for x in (self.handle, self.desc, ap, a, la, b, lb, ap + 4, c, lc, d, ld)) + (
            ctypes.byref(self.algo), _vp(self.workspace_ptr), ctypes.c_size_t(self.workspace_bytes))
        self._fn = lib.cublasLtMatmul

    def use(self, index: int) -> None:
        """Run with the heuristic's candidate ``index`` from now on (the algorithm struct is
        updated in place: the prepared arguments point at it)."""
        h = self.candidates[index]
        ctypes.memmove(ctypes.addressof(self.algo), ctypes.addressof(h.algo), ctypes.sizeof(_Algo))
        self.algo_index = index
        self.algo_workspace = int(h.workspace_size)

    def algo_bytes(self, index: int) -> bytes:
        return bytes(self.candidates[index].algo)

    def enqueue(self, stream_ptr: int, index: int, d_ptr: int) -> int:
        """One call with candidate ``index`` writing D at ``d_ptr`` (timing on scratch); the
        cuBLAS status, not raised."""
        args = list(self._args)
        args[10] = _vp(d_ptr)
        args[12] = ctypes.byref(self.candidates[index].algo)
        return int(self._fn(*args, stream_ptr))

    def _set(self, fn: Any, obj: Any, attr: int, value: Any) -> None:
        _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"cuBLASLt set attribute {attr}")

    def _layout(self, lay: Layout, t: int, batch: int) -> int:
        h = _vp()
        _check(self._lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), t, lay.rows, lay.cols, lay.ld), "cublasLtMatrixLayoutCreate")
        ptr = int(h.value or 0)
        self._owned.append(("cublasLtMatrixLayoutDestroy", ptr))
        if batch > 1:
            self._set(self._lib.cublasLtMatrixLayoutSetAttribute, ptr, _LAYOUT_BATCH_COUNT, ctypes.c_int32(batch))
            self._set(self._lib.cublasLtMatrixLayoutSetAttribute, ptr, _LAYOUT_BATCH_STRIDE, ctypes.c_int64(lay.stride))
        return ptr

    def __call__(self, stream_ptr: int) -> None:
        rc = self._fn(*self._args, stream_ptr)
        if rc:
            _check(rc, self._what)

    def close(self) -> None:
        owned, self._owned = self._owned, []
        for fn, ptr in reversed(owned):
            if ptr:
                getattr(self._lib, fn)(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass
