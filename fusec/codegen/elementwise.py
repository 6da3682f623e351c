"""The elementwise expression language of fused kernels and its CUDA emission table.

An expression is a small tree of ``In`` (kernel operand i), ``Const`` and ``Apply`` (an IR op of
kind ELEMENTWISE/BROADCAST). ``emit`` turns it into SSA C statements over compute values: fp32
for float dtypes, ``long long``/``int``/``bool`` otherwise. After each fp16/bf16 op the value is
rounded to its storage precision, because the reference stores each intermediate in that dtype;
a fused kernel then differs from the unfused one only by where values live, not by rounding.

The table ``CUDA_EXPR`` is keyed by ``Op`` (DESIGN.md §3: one table per concern).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from fusec import ops as O
from fusec.codegen.render import CCode, Ident, cint, compute_ctype, float_lit
from fusec.dtypes import DType
from fusec.ops import FusionKind, Op


@dataclasses.dataclass(frozen=True)
class In:
    index: int


@dataclasses.dataclass(frozen=True)
class Const:
    value: float | int | bool
    dtype: DType


@dataclasses.dataclass(frozen=True)
class Apply:
    op: Op
    args: tuple[Expr, ...]
    attrs: Any = O.NoAttrs()


Expr = In | Const | Apply


def _fmt(template: str) -> Callable[..., str]:
    return lambda args, dts, attrs, out: template.format(*args)


def _by_type(float_form: str, int_form: str) -> Callable[..., str]:
    return lambda args, dts, attrs, out: (float_form if dts[0].is_float else int_form).format(*args)


def _cast(args: Sequence[str], dts: Sequence[DType], attrs: O.CastAttrs, out: DType) -> str:
    src, dst = dts[0], attrs.to
    if dst == DType.BOOL:
        return f"({args[0]} != 0)"
    if src == DType.BOOL:
        return f"({args[0]} ? 1 : 0)" if not dst.is_float else f"({args[0]} ? 1.0f : 0.0f)"
    # float -> int truncates toward zero, like numpy's astype; int -> float rounds to nearest.
    return f"(({compute_ctype(dst)})({args[0]}))"


def _isinf(args: Sequence[str], dts: Sequence[DType], attrs: O.IsInfAttrs, out: DType) -> str:
    if not dts[0].is_float:
        return "false"
    parts = []
    if attrs.detect_positive:
        parts.append(f"({args[0]} == __int_as_float(0x7f800000))")
    if attrs.detect_negative:
        parts.append(f"({args[0]} == -__int_as_float(0x7f800000))")
    return "(" + " || ".join(parts) + ")" if parts else "false"


def _gelu(args: Sequence[str], dts: Sequence[DType], attrs: O.GeluAttrs, out: DType) -> str:
    if attrs.approximate == "tanh":
        return f"fc_gelu_tanh({args[0]})"
    # a half result takes the polynomial erfc (common.cuh: 4e-6 relative, a hundredth of its rounding step)
    return f"fc_gelu_erf16({args[0]})" if out in (DType.F16, DType.BF16) else f"fc_gelu_erf({args[0]})"


def _pow(args: Sequence[str], dts: Sequence[DType], attrs: Any, out: DType) -> str:
    if dts[0].is_float:
        return f"powf({args[0]}, (float)({args[1]}))"
    return f"(({compute_ctype(dts[0])})pow((double)({args[0]}), (double)({args[1]})))"


def _sign(args: Sequence[str], dts: Sequence[DType], attrs: Any, out: DType) -> str:
    x = args[0]
    if dts[0].is_float:  # +-0 and NaN come back unchanged, as numpy's sign gives them
        return f"({x} > 0.0f ? 1.0f : ({x} < 0.0f ? -1.0f : {x}))"
    return f"(({compute_ctype(out)})(({x} > 0) - ({x} < 0)))"


def _mod(args: Sequence[str], dts: Sequence[DType], attrs: O.ModAttrs, out: DType) -> str:
    a, b = args
    if dts[0].is_float:
        r = f"fmodf({a}, {b})"
        if attrs.fmod:
            return r
        # the divisor's sign: a non-zero remainder of the other sign moves by one divisor
        return f"(({r} != 0.0f && (({r} < 0.0f) != ({b} < 0.0f))) ? {r} + {b} : {r})"
    ct = compute_ctype(out)
    r = f"({a} % {b})"
    if not attrs.fmod:
        r = f"(({r} != 0 && (({r} < 0) != ({b} < 0))) ? {r} + {b} : {r})"
    return f"({b} == 0 ? ({ct})0 : ({ct}){r})"  # integer remainder by zero: 0, as the reference


def _bit_shift(args: Sequence[str], dts: Sequence[DType], attrs: O.BitShiftAttrs, out: DType) -> str:
    a, b = args
    ct = compute_ctype(out)
    bits = 8 * out.itemsize
    unsigned = "unsigned long long" if bits == 64 else "unsigned int"
    if attrs.left:  # through the unsigned type: bits moved past the top are dropped, no UB
        shifted = f"({ct})(({unsigned}){a} << {b})"
        fill = f"({ct})0"
    else:  # >> of a signed C integer is arithmetic in CUDA
        shifted = f"({a} >> {b})"
        fill = f"({a} < 0 ? ({ct})-1 : ({ct})0)"
    return f"(({b} < 0 || {b} >= {bits}) ? {fill} : {shifted})"


CUDA_EXPR: dict[Op, Callable[..., str]] = {
    Op.NEG: _fmt("(-{0})"),
    Op.ABS: _by_type("fabsf({0})", "({0} < 0 ? -{0} : {0})"),
    Op.EXP: _fmt("expf({0})"),
    Op.LOG: _fmt("logf({0})"),
    Op.SQRT: _fmt("sqrtf({0})"),
    Op.RECIPROCAL: _fmt("(1.0f / {0})"),
    Op.ERF: _fmt("erff({0})"),
    Op.TANH: _fmt("tanhf({0})"),
    Op.SIGMOID: _fmt("fc_sigmoid({0})"),
    Op.RELU: _by_type("fc_max({0}, 0.0f)", "({0} > 0 ? {0} : 0)"),
    Op.COS: _fmt("cosf({0})"),
    Op.SIN: _fmt("sinf({0})"),
    Op.NOT: _fmt("(!{0})"),
    Op.ISNAN: lambda a, d, at, o: f"({a[0]} != {a[0]})" if d[0].is_float else "false",
    Op.ISINF: _isinf,
    Op.CAST: _cast,
    Op.GELU: _gelu,
    Op.SILU: _fmt("({0} * fc_sigmoid({0}))"),
    Op.FLOOR: _fmt("floorf({0})"),
    Op.CEIL: _fmt("ceilf({0})"),
    Op.ROUND: _fmt("rintf({0})"),  # round half to even (the default rounding mode)
    Op.SIGN: _sign,
    Op.BITWISE_NOT: _fmt("(~{0})"),
    Op.ADD: _fmt("({0} + {1})"),
    Op.SUB: _fmt("({0} - {1})"),
    Op.MUL: _fmt("({0} * {1})"),
    # integer division truncates toward zero in C, as the reference defines it
    Op.DIV: _fmt("({0} / {1})"),
    Op.POW: _pow,
    Op.MAX: _fmt("fc_max({0}, {1})"),
    Op.MIN: _fmt("fc_min({0}, {1})"),
    Op.EQUAL: _fmt("({0} == {1})"),
    Op.LESS: _fmt("({0} < {1})"),
    Op.LESS_EQUAL: _fmt("({0} <= {1})"),
    Op.GREATER: _fmt("({0} > {1})"),
    Op.GREATER_EQUAL: _fmt("({0} >= {1})"),
    Op.AND: _fmt("({0} && {1})"),
    Op.OR: _fmt("({0} || {1})"),
    Op.XOR: _fmt("({0} != {1})"),
    Op.MOD: _mod,
    Op.BITWISE_AND: _fmt("({0} & {1})"),
    Op.BITWISE_OR: _fmt("({0} | {1})"),
    Op.BITWISE_XOR: _fmt("({0} ^ {1})"),
    Op.BIT_SHIFT: _bit_shift,
    Op.WHERE: _fmt("({0} ? {1} : {2})"),
}


def dtype_of(e: Expr, in_dtypes: Sequence[DType]) -> DType:
    """Storage dtype of an expression's value (the IR's dtype rule applied to scalars)."""
    if isinstance(e, In):
        return in_dtypes[e.index]
    if isinstance(e, Const):
        return e.dtype
    arg_types = [((), dtype_of(a, in_dtypes)) for a in e.args]
    return O.infer(e.op, e.attrs, arg_types)[0][1]


# IEEE bit patterns of the fp32 constants a literal cannot spell (NVRTC has no math.h macros here)
_NONFINITE = {"inf": "__int_as_float(0x7f800000)", "-inf": "__int_as_float((int)0xff800000)",
              "nan": "__int_as_float(0x7fc00000)"}


def _const_code(c: Const) -> str:
    if c.dtype.is_float:
        # the reference holds the constant in its storage dtype: round it the same way
        v = float(c.dtype.np.type(c.value))
        if not math.isfinite(v):
            return _NONFINITE["nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")]
        return float_lit(v, "constant")
    if c.dtype == DType.BOOL:
        return "true" if bool(c.value) else "false"
    v = cint(int(c.value), -(2**63), 2**63 - 1, "integer constant")
    return f"{v}LL" if c.dtype == DType.I64 else f"{v}"


def emit(expr: Expr, operands: Sequence[tuple[Ident, DType]], prefix: str = "t") -> tuple[list[CCode], Ident, DType]:
    """SSA statements computing ``expr``; ``operands[i]`` is (compute-value variable, dtype) of In(i).

    Returns (statements, result variable, result dtype). Shared subtrees are emitted once.
    """
    lines, results = emit_all((expr,), operands, prefix)
    return lines, results[0][0], results[0][1]


def emit_all(exprs: Sequence[Expr], operands: Sequence[tuple[Ident, DType]],
             prefix: str = "t") -> tuple[list[CCode], list[tuple[Ident, DType]]]:
    """SSA statements computing every expression of ``exprs`` (a multi-output kernel's), subtrees they share emitted
    once; returns the statements and each expression's (result variable, dtype)."""
    in_dtypes = [d for _, d in operands]
    lines: list[CCode] = []
    memo: dict[Expr, tuple[Ident, DType]] = {}

    def go(e: Expr) -> tuple[Ident, DType]:
        if e in memo:
            return memo[e]
        if isinstance(e, In):
            if not 0 <= e.index < len(operands):
                raise ValueError(f"expression uses operand {e.index}, kernel has {len(operands)}")
            res = operands[e.index]
        elif isinstance(e, Const):
            name = Ident(f"{prefix}{len(lines)}")
            lines.append(CCode(f"const {compute_ctype(e.dtype)} {name} = {_const_code(e)};"))
            res = (name, e.dtype)
        elif isinstance(e, Apply):
            info = O.OP_INFO.get(e.op)
            if info is None or info.kind not in (FusionKind.ELEMENTWISE, FusionKind.BROADCAST) or e.op not in CUDA_EXPR:
                raise ValueError(f"op {e.op.value} is not an elementwise op")
            args = [go(a) for a in e.args]
            out = dtype_of(e, in_dtypes)
            code = CUDA_EXPR[e.op]([a for a, _ in args], [d for _, d in args], e.attrs, out)
            if out == DType.F16:
                code = f"fc_round_f16({code})"
            elif out == DType.BF16:
                code = f"fc_round_bf16({code})"
            name = Ident(f"{prefix}{len(lines)}")
            lines.append(CCode(f"const {compute_ctype(out)} {name} = {code};"))
            res = (name, out)
        else:
            raise TypeError(f"not an expression node: {type(e).__name__}")
        memo[e] = res
        return res

    results = [go(e) for e in exprs]
    return lines, results


def single_op(op: Op, n_inputs: int, attrs: Any = None) -> Expr:
    """The expression of one IR op applied to operands 0..n-1 (the unfused case)."""
    return Apply(op, tuple(In(i) for i in range(n_inputs)), attrs if attrs is not None else O.NoAttrs())
