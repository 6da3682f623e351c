"""Quantized weights of ONNX models kept packed: com.microsoft ``MatMulNBits`` and the QDQ pattern
``DequantizeLinear(constant weight) -> MatMul``, each imported as one ``QMATMUL`` (``fusec.quant``).

- **MatMulNBits** (onnxruntime-genai's int4 models; onnxruntime's ``matmul_nbits_quantizer``):
  Y = A @ W with W [K, N] stored as B uint8 [N, K / block_size, block_size * bits / 8] (4 bits:
  element 2j in the low nibble of byte j, 2j + 1 in the high one), ``scales`` [N, K / block_size]
  (or flat), optional ``zero_points`` (uint8, packed 4-bit pairs or bytes; default 2**(bits-1)),
  an optional ``g_idx`` (accepted only when it is the plain block order) and ``bias`` [N]:
  W[k, n] = scales[n, k / bs] * (q[n, k] - zero[n, k / bs]). bits 4 or 8.
- **QDQ**: ``DequantizeLinear`` of a constant 2-D integer weight x [K, N] (int8/uint8, int4/uint4)
  with a per-tensor scale, a per-column (axis 1) scale, or blocks along K (axis 0, ``block_size``
  dividing K), read by a ``MatMul`` as its B. The DequantizeLinear handler registers what it
  dequantized (``note_dequantized``) and still emits the decomposition (other readers use it); the
  MatMul handler asks ``qdq_matmul`` first, so the weight is recognized at import, before
  constant folding could turn it into fp32. The unused decomposition is dropped with the dead nodes.

A weight whose layout fusec's packed form cannot hold (K not a multiple of 32, a group not a
multiple of 16) is dequantized at import instead (MatMulNBits) or left to the decomposition (QDQ).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, domain_handler
from fusec.ir import Value
from fusec.ops import Op
from fusec.quant import QWeight, from_affine

_FLOATS = (np.dtype(np.float32), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class Dequantized:
    """A DequantizeLinear of a constant weight: x [K, N] integers, scale/zero [N, G] per group of K."""

    x: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    bits: int
    name: str


def _qmatmul(cx: NodeCtx, a: Sym, qw: QWeight, base: str, final: bool) -> Sym:
    consts = [Const(arr, weight=True, name=f"{base}.{role}") for role, arr in zip(qw.roles, qw.arrays)]
    return cx.emit(Op.QMATMUL, a, *consts, final=final, format=qw.format, n=qw.n, k=qw.k, group=qw.group)


# ---- MatMulNBits ----------------------------------------------------------------------------------

def _int_attr(cx: NodeCtx, name: str) -> int:
    v = cx.attr(name)
    if not isinstance(v, int) or v <= 0:
        raise cx.fail(f"attribute {name!r} must be a positive integer, got {v!r}")
    return v


def _const_input(cx: NodeCtx, i: int, what: str) -> np.ndarray:
    s = cx.x(i)
    if not isinstance(s, Const):
        raise cx.fail(f"{what} (input {i}) must be a constant (an initializer); packed weights are not computed")
    return s.array


@domain_handler("com.microsoft", "MatMulNBits")
def _matmul_nbits(cx: NodeCtx) -> list[Sym | None]:
    k, n, bits, bs = (_int_attr(cx, a) for a in ("K", "N", "bits", "block_size"))
    a = cx.x(0)
    if bits not in (4, 8):
        raise cx.fail(f"bits={bits} is not supported (4 and 8 are)")
    if bs < 16 or bs & (bs - 1):
        raise cx.fail(f"block_size {bs} must be a power of two >= 16")
    if k % bs:
        raise cx.fail(f"block_size {bs} does not divide K={k}")
    if not a.shape or a.shape[-1] != k:
        raise cx.fail(f"A of shape {list(a.shape)} must end in K={k}")
    kb = k // bs
    b = _const_input(cx, 1, "B")
    if b.dtype != np.uint8 or tuple(b.shape) != (n, kb, bs * bits // 8):
        raise cx.fail(f"B is {b.dtype}{list(b.shape)}, expected uint8[{n}, {kb}, {bs * bits // 8}] "
                      f"for N={n}, K={k}, block_size={bs}, bits={bits}")
    scales = _const_input(cx, 2, "scales")
    if scales.dtype.kind != "f" or scales.size != n * kb or scales.shape not in ((n * kb,), (n, kb)):
        raise cx.fail(f"scales are {scales.dtype}{list(scales.shape)}, expected floats [{n}, {kb}] or [{n * kb}]")
    if np_dtype(a).kind != "f":
        raise cx.fail(f"A must be a float tensor, got {np_dtype(a)}")
    zero = None
    if cx.has(3):
        zp = _const_input(cx, 3, "zero_points")
        if zp.dtype.kind == "f":
            raise cx.fail("float zero points are not supported (uint8 zero points are)")
        per = -(-kb * bits // 8)
        if zp.dtype != np.uint8 or zp.size != n * per:
            raise cx.fail(f"zero_points are {zp.dtype}{list(zp.shape)}, expected uint8 [{n}, {per}]")
        zp = zp.reshape(n, per)
        zero = zp if bits == 8 else np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, per * 2)[:, :kb]
    if cx.has(4):
        g_idx = _const_input(cx, 4, "g_idx").reshape(-1)
        if g_idx.size != k or not np.array_equal(g_idx, np.arange(k) // bs):
            raise cx.fail("g_idx reorders the groups (act-order); only the plain block order is supported")
    if bits == 4:
        q = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(n, k)
    else:
        q = b.reshape(n, k)
    if zero is None:  # the default zero point 2**(bits-1): signed codes, zero 0
        q = (q.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
    s = scales.reshape(n, kb)
    name = cx.node.input[1]
    try:
        y = _qmatmul(cx, a, from_affine(q, s, zero, bits), name, final=not cx.has(5))
    except ValueError:  # a layout the packed form cannot hold (K % 32): dequantize here
        zq = np.repeat(zero.astype(np.float32), bs, axis=1) if zero is not None else 0.0
        w = ((q.astype(np.float32) - zq) * np.repeat(s.astype(np.float32), bs, axis=1)).astype(np_dtype(a))
        y = cx.emit(Op.MATMUL, a, Const(np.ascontiguousarray(w.T), weight=True, name=name), final=not cx.has(5))
    if cx.has(5):
        y = cx.emit(Op.ADD, y, cx.x(5), final=True)
    return [y]


# ---- DequantizeLinear -> MatMul --------------------------------------------------------------------

def note_dequantized(cx: NodeCtx, y: Sym, x: Sym, scale: Sym, zp: Sym | None, axis: int, block: int, bits: int) -> None:
    """Remember that ``y`` is x dequantized, when x is a constant 2-D weight [K, N] whose scales
    run per tensor, per column or in blocks along K (what a MatMul over it can keep packed)."""
    if not isinstance(y, Value) or not isinstance(x, Const) or len(x.shape) != 2 or not isinstance(scale, Const) \
            or (zp is not None and not isinstance(zp, Const)) or np_dtype(scale) not in _FLOATS + (DType.BF16.np,):
        return
    k, n = x.shape
    axis = axis + 2 if axis < 0 else axis

    def per_group(p: np.ndarray) -> np.ndarray | None:  # [N, G]
        if p.size == 1:
            return np.full((n, 1), p.reshape(()), p.dtype)
        if block <= 0 and axis == 1 and p.shape == (n,):
            return p.reshape(n, 1)
        if block > 0 and axis == 0 and k % block == 0 and p.shape == (k // block, n):
            return np.ascontiguousarray(p.T)
        return None

    s = per_group(scale.array)
    z = per_group(zp.array) if zp is not None else None
    if s is None or (zp is not None and z is None):
        return
    cx.em.qdq[y] = Dequantized(x.array, s, z, bits, x.name or "weight")


def qdq_matmul(cx: NodeCtx, a: Sym, b: Sym) -> Sym | None:
    """A MatMul(a, b) whose b is a registered dequantized weight, as one QMATMUL (None: not one)."""
    info = cx.em.qdq.get(b) if isinstance(b, Value) else None
    if info is None or isinstance(a, Const) or not a.shape or np_dtype(a) != b.dtype.np:
        return None
    try:
        qw = from_affine(np.ascontiguousarray(info.x.T), info.scale, info.zero, info.bits)
    except ValueError:
        return None  # the decomposition computes it
    return _qmatmul(cx, a, qw, info.name, final=True)
