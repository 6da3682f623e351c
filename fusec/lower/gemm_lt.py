"""The ``cublaslt`` kernel choice: a fused GEMM epilogue computed inside the matrix product.

A fused ``gemm_epilogue`` node whose epilogue is ``[+ bias[N]] [relu | gelu_tanh]`` or
``[+ bias[N]] + residual[M, N]`` (``fusec.lower.choices`` recognizes the chain) becomes one
cuBLASLt call (``fusec.runtime.cublaslt``) instead of cuBLAS followed by one elementwise kernel:
the bias and activation through cuBLASLt's epilogues (BIAS, RELU, RELU_BIAS, GELU, GELU_BIAS),
the residual as C with beta = 1 (D = A @ B + residual, C and D may be the same buffer). The
product never goes through memory in the storage dtype: cuBLASLt applies everything to the fp32
result and rounds once, where the separate kernel rounds the product first (so the two agree to
the storage dtype's rounding, not bit for bit).

What cuBLASLt cannot compute exactly is not offered (``lt_epilogue`` is None): the erf GELU
(cuBLASLt's GELU is the tanh approximation), SiLU, and an activation followed by a residual
(cuBLASLt adds C before the activation). Rows of A, B and C must be 16-byte multiples (``pad_gemm``
pads odd N), so that cuBLASLt has its vectorized algorithms.
"""

from __future__ import annotations

from typing import Any

from fusec.codegen import specs as S
from fusec.dtypes import DType
from fusec.ir import Value

VARIANT = "cublaslt"
_ACT = {"none": "", "relu": "relu", "gelu_tanh": "gelu"}


def lt_epilogue(e: S.Epilogue) -> str | None:
    """The cuBLASLt epilogue (``fusec.runtime.cublaslt.EPILOGUES``) computing ``e``, or None."""
    if e.activation not in _ACT or (e.residual and e.activation != "none"):
        return None
    act = _ACT[e.activation]
    if e.bias:
        return f"{act}_bias" if act else "bias"
    return act or "default"


def applies(e: S.Epilogue, dtype: Any, n: int, k: int) -> bool:
    """cuBLASLt computes this epilogue exactly, on rows of 16-byte multiples."""
    return (lt_epilogue(e) is not None and dtype in S.FLOATS
            and (n * dtype.itemsize) % 16 == 0 and (k * dtype.itemsize) % 16 == 0)


def emit(ctx: Any, cp: Any, a: Value, b: Value, out: Value, bias: Value | None, residual: Value | None,
         label: str) -> None:
    """One "gemm" launch record with the cuBLASLt fields (``ctx``: ``fusec.lower.Context``; ``cp``:
    the node's ``fusec.lower.choices.ChoicePoint``; the values are the node's outer operands)."""
    epi = lt_epilogue(cp.epilogue)
    assert epi is not None, "emit() is only called where applies() said yes"
    m, n, k = cp.m, cp.n, cp.k
    fields: dict[str, Any] = {
        "m": m, "n": n, "k": k, "batch": 1, "lda": k, "ldb": k if cp.trans_b else n, "ldc": n,
        "stride_a": 0, "stride_b": 0, "stride_c": m * n, "trans_a": False, "trans_b": cp.trans_b,
        "dtype": a.dtype.value, "epilogue": epi,
        "compute": ("tf32" if cp.precision == "tf32" else ctx.compute) if a.dtype == DType.F32 else "f32"}
    if bias is not None:
        fields["bias"] = list(ctx.addr(bias))
    if residual is not None:
        fields["c_in"] = list(ctx.addr(residual))
        fields["beta"] = 1.0
    ctx.gemm(fields, a, b, out, f"{label} cublaslt[{epi}{'+res' if residual is not None else ''}]",
             tuple(v for v in (bias, residual) if v is not None))
    ctx.count("cublaslt_epilogue")
