"""Weight-only quantized formats: one packed layout that every source repacks into, and its
exact meaning (the dequantization the numpy reference runs and the kernels compute).

Every format describes a weight W [N, K] (row n = output feature, k contiguous) as integer codes
``q`` of ``bits`` bits and per-group affine parameters, groups of ``group`` consecutive k:

    W[n, k] = s[n, g] * float(q[n, k] - z[n, g]) + o[n, g]        (g = k // group, fp32 math)

- ``s``: the group's scale: ``scale[n, k // super_block]`` (fp16/fp32), times the group's integer
  ``sub_scale[n, g]`` for the K-quants (u8 6-bit scales of Q4_K/Q5_K, i8 of Q6_K); both factors
  are exact in fp32, so the product is too;
- ``z``: a constant of the format (8 for Q4_0, 32 for Q6_K...) or a per-group ``zero[n, g]`` (u8);
- ``o``: none, ``+min[n, g]`` (Q4_1/Q5_1), or ``-(dmin[n, k // super_block] * mins[n, g])`` (the
  K-quants' mins);

computed in that order, without a fused multiply-add, which is exactly what ``gguf`` computes
for the GGUF types (``gguf.quants.dequantize``: bit-identical results, tests/test_quant.py).

**The packed layout** (what the IR's ``QMATMUL`` takes after the activations, in this order, all
rows [N, ...] so that merging products along N is a concatenation and rows permute freely):

==============  ====================  ==========================================================
operand         shape, dtype          meaning
==============  ====================  ==========================================================
``codes``       [N, K/2] u8           bits 4..6: the low 4 bits; per 32-weight chunk 16 bytes,
                                      byte j = w[j] | w[j + 16] << 4 (one 16-byte load = 32 weights)
                [N, K] i8 / u8        bits 8: one code per byte (i8 for the signed formats)
``high``        [N, K/32 * hb] u32    bits 5/6 (hb = bits - 4): per chunk hb words of code bits 4..,
                                      hb bits a weight, byte-aligned with the code words (below)
``scale``       [N, K/sb] f16/f32     sb = ``super_block`` (= group outside the K-quants)
``sub_scale``   [N, K/group] u8/i8    K-quants only
``zero``        [N, K/group] u8       formats with per-group zero points only
``min``         [N, K/group] f16/f32  offset "min" only
``dmin, mins``  [N, K/sb] f16,        offset "kmin" only
                [N, K/group] u8
==============  ====================  ==========================================================

**The high bits** of 5- and 6-bit codes sit where a code word's byte needs them. Code word i (i = 0..3:
bytes 4i..4i+3 of a chunk's codes) holds weights 4i + b (low nibble of byte b) and 16 + 4i + b (high
nibble). With m = 4 / hb code words a high word, word i // m of the chunk's hb words holds, for t = i % m,
in its byte b the high bits (code bits 4..) of weight 4i + b from bit ``4 + hb*t`` and those of weight
16 + 4i + b from bit ``hb*t``. So one shift and one mask put a code word's high bits under its nibbles
(``(h >> hb t) & 0x30303030`` for a 6-bit word's low nibbles, ``(h << (4 - hb t)) & 0x30303030`` for its
high ones), for dp4a's 4 bytes and for the tensor-core form's byte pairs alike. Bit planes (bit j of plane p = bit 4 + p
of w[j]) had cost the kernels a spread of every bit: the 6-bit tensor-core form took 106 instructions a
chunk against 4-bit's 47 (benchmarks/RESULTS.md, forty-first session).

K must be a multiple of 32 (the kernels' chunk); the group a multiple of 16 dividing K.
Sources: ``fusec.quant_gguf`` (GGUF blocks), the ONNX importer (MatMulNBits, QDQ), and
``fusec.quantize`` (fusec's own round-to-nearest quantizer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fusec.dtypes import DType

CHUNK = 32  # weights per kernel chunk: 16 bytes of 4-bit codes


@dataclasses.dataclass(frozen=True)
class QFormat:
    name: str
    bits: int  # 4, 5, 6 or 8
    signed: bool  # 8-bit codes stored as i8 (the others are unsigned)
    zero: int | None  # the constant zero point; None: a per-group ``zero`` operand
    offset: str  # "none", "min" (+min[g]) or "kmin" (-(dmin[sb] * mins[g]))
    sub_scale: DType | None  # K-quants: per-group integer multiplier of the super-block scale
    super_block: int  # weights per ``scale`` entry; 0: one per group
    group: int  # the format's own group size; 0: any (the op's attribute)
    gguf: str | None = None  # the GGUF type name it holds

    @property
    def high_words(self) -> int:
        return max(0, self.bits - 4) if self.bits < 8 else 0

    @property
    def scale_only(self) -> bool:
        """W = s * (q - z) with a constant z: a group's scale is its only number (no offset, no zero operand)."""
        return self.offset == "none" and self.zero is not None

    def bits_per_weight(self, group: int, scale_bytes: int = 2) -> float:
        """Bytes the packed layout reads per weight, as bits (codes + scales + the rest)."""
        g = self.group or group
        sb = self.super_block or g
        b = self.bits + scale_bytes * 8 / sb
        b += (8 / g if self.sub_scale is not None else 0) + (8 / g if self.zero is None else 0)
        b += {"none": 0.0, "min": scale_bytes * 8 / g, "kmin": 16 / sb + 8 / g}[self.offset]
        return b


FORMATS: dict[str, QFormat] = {f.name: f for f in (
    QFormat("q8_0", 8, True, 0, "none", None, 0, 32, "Q8_0"),
    QFormat("q4_0", 4, False, 8, "none", None, 0, 32, "Q4_0"),
    QFormat("q4_1", 4, False, 0, "min", None, 0, 32, "Q4_1"),
    QFormat("q5_0", 5, False, 16, "none", None, 0, 32, "Q5_0"),
    QFormat("q5_1", 5, False, 0, "min", None, 0, 32, "Q5_1"),
    QFormat("q4_k", 4, False, 0, "kmin", DType.U8, 256, 32, "Q4_K"),
    QFormat("q5_k", 5, False, 0, "kmin", DType.U8, 256, 32, "Q5_K"),
    QFormat("q6_k", 6, False, 32, "none", DType.I8, 256, 16, "Q6_K"),
    # ONNX (MatMulNBits, QDQ) and fusec's own quantizer: any group
    QFormat("int8", 8, True, 0, "none", None, 0, 0),  # symmetric int8 (fusec --quantize int8: group = K)
    QFormat("uint8", 8, False, None, "none", None, 0, 0),  # u8 codes, per-group u8 zero points
    QFormat("int4", 4, False, 8, "none", None, 0, 0),  # symmetric int4 stored +8 (fusec --quantize int4)
    QFormat("uint4", 4, False, None, "none", None, 0, 0),  # u4 codes, per-group u8 zero points
)}
SCALE_DTYPES = (DType.F16, DType.F32)


def get_format(name: str) -> QFormat:
    f = FORMATS.get(name)
    if f is None:
        raise ValueError(f"unknown quantized format {name!r} (known: {', '.join(FORMATS)})")
    return f


def check_layout(fmt: QFormat, n: int, k: int, group: int) -> None:
    """ValueError naming what is wrong with an (N, K, group) of ``fmt``."""
    if n <= 0 or k <= 0:
        raise ValueError(f"{fmt.name}: N and K must be positive, got N={n}, K={k}")
    if fmt.group and group != fmt.group:
        raise ValueError(f"{fmt.name} has groups of {fmt.group} weights, got group {group}")
    if group <= 0 or group % 16 or k % group:
        raise ValueError(f"{fmt.name}: the group size {group} must be a multiple of 16 that divides K={k}")
    if k % CHUNK:
        raise ValueError(f"{fmt.name}: K={k} must be a multiple of {CHUNK}")
    if fmt.super_block and k % fmt.super_block:
        raise ValueError(f"{fmt.name}: K={k} must be a multiple of its {fmt.super_block}-weight super-block")


def operand_types(fmt: QFormat, n: int, k: int, group: int,
                  scale_dtype: DType = DType.F16) -> list[tuple[str, tuple[int, ...], DType]]:
    """The packed operands (role, shape, dtype) of a [N, K] weight, in the op's input order."""
    check_layout(fmt, n, k, group)
    sb = fmt.super_block or group
    out: list[tuple[str, tuple[int, ...], DType]] = []
    if fmt.bits == 8:
        out.append(("codes", (n, k), DType.I8 if fmt.signed else DType.U8))
    else:
        out.append(("codes", (n, k // 2), DType.U8))
        if fmt.high_words:
            out.append(("high", (n, k // CHUNK * fmt.high_words), DType.U32))
    out.append(("scale", (n, k // sb), scale_dtype))
    if fmt.sub_scale is not None:
        out.append(("sub_scale", (n, k // group), fmt.sub_scale))
    if fmt.zero is None:
        out.append(("zero", (n, k // group), DType.U8))
    if fmt.offset == "min":
        out.append(("min", (n, k // group), scale_dtype))
    elif fmt.offset == "kmin":
        out += [("dmin", (n, k // sb), scale_dtype), ("mins", (n, k // group), DType.U8)]
    return out


def check_operands(fmt: QFormat, n: int, k: int, group: int, types: Sequence[tuple[tuple[int, ...], DType]]) -> None:
    """ValueError naming the first operand whose shape or dtype is not what the layout needs."""
    scale_dt = types[1 + (1 if fmt.high_words else 0)][1] if len(types) > 1 + bool(fmt.high_words) else DType.F16
    if scale_dt not in SCALE_DTYPES:
        raise ValueError(f"{fmt.name}: scales must be f16 or f32, got {scale_dt.value}")
    if fmt.gguf is not None and scale_dt != DType.F16:
        raise ValueError(f"{fmt.name}: GGUF scales are f16, got {scale_dt.value}")
    want = operand_types(fmt, n, k, group, scale_dt)
    if len(types) != len(want):
        raise ValueError(f"{fmt.name} takes {len(want)} packed operands ({', '.join(r for r, _, _ in want)}), "
                         f"got {len(types)}")
    for (role, shape, dt), (got_shape, got_dt) in zip(want, types):
        if tuple(got_shape) != shape or got_dt != dt:
            raise ValueError(f"{fmt.name} operand {role!r} must be {dt.value}[{','.join(map(str, shape))}], "
                             f"got {got_dt.value}[{','.join(map(str, got_shape))}]")


@dataclasses.dataclass(frozen=True, eq=False)
class QWeight:
    """A packed [N, K] weight: its format, group, and operands (``operand_types`` order)."""

    format: str
    n: int
    k: int
    group: int
    arrays: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        fmt = get_format(self.format)
        check_operands(fmt, self.n, self.k, self.group,
                       [(a.shape, DType.from_np(a.dtype)) for a in self.arrays])

    @property
    def fmt(self) -> QFormat:
        return FORMATS[self.format]

    @property
    def roles(self) -> list[str]:
        return [r for r, _, _ in operand_types(self.fmt, self.n, self.k, self.group, self.scale_dtype)]

    @property
    def scale_dtype(self) -> DType:
        return DType.from_np(self.arrays[1 + (1 if self.fmt.high_words else 0)].dtype)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def rows(self, order: np.ndarray) -> QWeight:
        """The same weight with its rows taken in ``order`` (a permutation or selection of N)."""
        return QWeight(self.format, len(order), self.k, self.group, tuple(np.ascontiguousarray(a[order])
                                                                        for a in self.arrays))

    def dequantize(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        return dequantize(self.fmt, self.k, self.group, self.arrays, start, stop)


# ---- codes: canonical packing -------------------------------------------------------------------

def _high_shifts(hb: int) -> np.ndarray:
    """[2 nibbles][m] bit offsets inside a high word's byte (see the module docstring), m = 4 // hb."""
    m = 4 // hb
    return np.array([[4 + hb * t for t in range(m)], [hb * t for t in range(m)]], np.uint8)


def pack_codes(q: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Integer codes q [N, K] (values in [0, 2**bits), or i8 for 8-bit signed) -> (codes[, high])."""
    if bits == 8:
        return (np.ascontiguousarray(q),)
    n, k = q.shape
    q = q.astype(np.uint8, copy=False)
    low = (q & np.uint8(0x0F)).reshape(n, k // CHUNK, 2, CHUNK // 2)
    codes = (low[:, :, 0, :] | (low[:, :, 1, :] << np.uint8(4))).reshape(n, k // 2)
    if bits == 4:
        return (np.ascontiguousarray(codes),)
    hb = bits - 4
    m = 4 // hb
    # [row, chunk, nibble, high word j, t, byte b]: weight 16 * nibble + 4 * (j * m + t) + b
    h = (q >> np.uint8(4)).reshape(n, k // CHUNK, 2, hb, m, 4)
    h = np.bitwise_or.reduce(h << _high_shifts(hb).reshape(1, 1, 2, 1, m, 1), axis=(2, 4))  # [row, chunk, j, b]
    high = np.ascontiguousarray(h).view("<u4").reshape(n, k // CHUNK * hb).astype(np.uint32)
    return np.ascontiguousarray(codes), high


def unpack_codes(codes: np.ndarray, high: np.ndarray | None, bits: int, k: int) -> np.ndarray:
    """(codes[, high]) -> integer codes [N, K] (u8, or i8 for signed 8-bit codes)."""
    if bits == 8:
        return codes
    n = codes.shape[0]
    c = codes.reshape(n, k // CHUNK, 1, CHUNK // 2)
    q = (c >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    q = q.reshape(n, k // CHUNK, CHUNK)
    if high is not None and bits > 4:
        hb = bits - 4
        m = 4 // hb
        h = np.ascontiguousarray(high).astype("<u4").view(np.uint8).reshape(n, k // CHUNK, 1, hb, 1, 4)
        hi = (h >> _high_shifts(hb).reshape(1, 1, 2, 1, m, 1)) & np.uint8((1 << hb) - 1)  # [row, chunk, nib, j, t, b]
        q |= hi.reshape(n, k // CHUNK, CHUNK) << np.uint8(4)
    return q.reshape(n, k)


# ---- dequantization: the format's meaning ---------------------------------------------------------

def dequantize(fmt: QFormat, k: int, group: int, arrays: Sequence[np.ndarray], start: int = 0,
               stop: int | None = None) -> np.ndarray:
    """W[start:stop] as fp32 [rows, K], exactly as the module docstring defines it."""
    it = iter(arrays)
    codes = next(it)[start:stop]
    high = next(it)[start:stop] if fmt.high_words else None
    scale = next(it)[start:stop]
    sub = next(it)[start:stop] if fmt.sub_scale is not None else None
    zero = next(it)[start:stop] if fmt.zero is None else None
    n = codes.shape[0]
    ng = k // group
    sb = fmt.super_block or group
    s = scale.astype(np.float32)
    if sb != group:
        s = np.repeat(s, sb // group, axis=1)
    if sub is not None:
        s = s * sub.astype(np.float32)
    q = unpack_codes(codes, high, fmt.bits, k).reshape(n, ng, group)
    if zero is not None:
        qz = (q.astype(np.int16) - zero.astype(np.int16)[:, :, None]).astype(np.float32)
    elif fmt.zero:
        qz = (q.astype(np.int16) - np.int16(fmt.zero)).astype(np.float32)
    else:
        qz = q.astype(np.float32)
    w = s[:, :, None] * qz
    if fmt.offset == "min":
        w += next(it)[start:stop].astype(np.float32)[:, :, None]
    elif fmt.offset == "kmin":
        dmin, mins = next(it)[start:stop].astype(np.float32), next(it)[start:stop]
        if sb != group:
            dmin = np.repeat(dmin, sb // group, axis=1)
        w -= (dmin * mins.astype(np.float32))[:, :, None]
    return w.reshape(n, k)


def matmul(x: np.ndarray, fmt: QFormat, k: int, group: int, arrays: Sequence[np.ndarray],
           rows_per_step: int = 0) -> np.ndarray:
    """fp32 x[.., K] @ W^T, W dequantized a block of rows at a time (the reference never holds a
    whole large weight in fp32: at most ``rows_per_step`` rows, default ~4M weights)."""
    n = arrays[0].shape[0]
    step = rows_per_step or max(1, (1 << 22) // k)
    x2 = x.reshape(-1, k)
    out = np.empty((x2.shape[0], n), np.float32)
    for r in range(0, n, step):
        w = dequantize(fmt, k, group, arrays, r, min(n, r + step))
        out[:, r:r + w.shape[0]] = (w @ x2.T).T  # W's rows contiguous: BLAS's fast path (x @ w.T was ~100x slower at M = 1)
    return out.reshape(*x.shape[:-1], n)


def dp4a_blocks(x: np.ndarray) -> np.ndarray:
    """x as the dp4a quantized GEMV represents it (templates/qgemv_dp4a_x.jinja), each 32 consecutive values of a row
    with their own unit d, returned as d * xq in fp32, so the kernel's product is dp4a_blocks(x) @ W^T up to fp32
    accumulation (the same fp32 operations, each rounded, as the kernel's): xq = rint(x * iq), the exact product
    rounded once (the kernel's FMA), for iq = fl(fl(1 / max|x|) * 32767), so |xq| <= 32767; d = max|x| * fl(1 / 32767).
    A block whose max|x| is below the smallest normal fp32 number is zeros. The kernel splits xq into a signed high
    and an unsigned low byte, xq = 256 * x1 + x0. The step, max|x| / 32767, is finer than bf16's for all but a block's
    smallest values; one int8 digit (max|x| / 127) changed SmolLM2-135M's greedy answers."""
    xf = np.asarray(x, np.float32)
    b = xf.reshape(*xf.shape[:-1], xf.shape[-1] // 32, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    live = amax >= np.finfo(np.float32).tiny
    f = np.float32
    with np.errstate(divide="ignore"):
        iq = np.where(live, (f(1.0) / amax) * f(32767.0), f(0.0)).astype(np.float32)
    xq = np.rint(b.astype(np.float64) * iq.astype(np.float64))  # exact in float64 (24 x 24 bits), rounded once
    d = np.where(live, amax * (f(1.0) / f(32767.0)), f(0.0)).astype(np.float32)
    return (xq.astype(np.float32) * d).astype(np.float32).reshape(xf.shape)


def from_affine(q: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, bits: int) -> QWeight:
    """The packed form of W[n, k] = scale[n, g] * (q[n, k] - zero[n, g]) (ONNX's DequantizeLinear,
    MatMulNBits) for integer codes q [N, K] of ``bits`` (4 or 8, signed or unsigned by q's dtype)
    and scale/zero [N, G] (zero None: 0); G divides K. Signed codes are shifted to unsigned
    (q + 2**(bits-1), zero likewise) where that keeps q - zero exact. ValueError when the layout
    cannot hold it (K not a multiple of 32, a group not a multiple of 16)."""
    n, k = q.shape
    ng = scale.shape[1]
    if k % ng:
        raise ValueError(f"{ng} groups do not divide K={k}")
    group = k // ng
    sdt = scale.dtype if scale.dtype in (np.float16, np.float32) else np.dtype(np.float32)
    s = np.ascontiguousarray(scale.astype(sdt))
    signed = q.dtype.kind == "i"
    half = 1 << (bits - 1)
    z = np.zeros((n, ng), np.int16) if zero is None else zero.astype(np.int16)
    if bits == 8 and signed and not z.any():
        fmt, codes, zarr = "int8", q.astype(np.int8), None
    elif bits == 8:
        off = half if signed else 0
        fmt, codes, zarr = "uint8", (q.astype(np.int16) + off).astype(np.uint8), (z + off).astype(np.uint8)
    elif bits == 4:
        off = half if signed else 0
        codes = (q.astype(np.int16) + off).astype(np.uint8)
        zs = z + off
        fmt, zarr = ("int4", None) if (zs == half).all() else ("uint4", zs.astype(np.uint8))
    else:
        raise ValueError(f"{bits}-bit codes are not supported (4 and 8 are)")
    check_layout(FORMATS[fmt], n, k, group)
    arrays = pack_codes(codes, bits) + (s,) + ((np.ascontiguousarray(zarr),) if zarr is not None else ())
    return QWeight(fmt, n, k, group, arrays)
