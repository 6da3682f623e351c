"""GGUF quantized blocks -> fusec's packed layout (``fusec.quant``), bit-exactly.

``repack(data, type_name, n, k, what)`` reads a tensor's raw blocks ([N, K / block * type_size]
bytes, as the file stores a [N, K] weight: each row its own run of blocks) and returns a
``QWeight`` whose dequantization equals ``gguf.quants.dequantize`` of the same bytes, bit for bit
(tests/test_quant.py). Blocks are decoded to integer codes and their fields (fp16 scales, 6-bit
sub-scales, mins) with numpy views of the byte array, a slab of rows at a time, so a hostile
file can make it neither read nor write outside the arrays: the byte count is checked against
(N, K, type) first, every index below is a reshape of that checked array.

Types kept packed: ``PACKED`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: every type of a
common Q4_K_M, Q5_K_M, Q6_K or Q8_0 file). Other quantized types are dequantized at load by the
``gguf`` package (``models/gguf.py`` prints one notice naming them).

``random_blocks(type_name, n, k, rng)`` makes valid random blocks (finite, small scales) for tests
and benchmarks, for the types gguf cannot quantize (the K-quants) as well.
"""

from __future__ import annotations

import numpy as np

from fusec.errors import ModelError
from fusec.quant import FORMATS, QWeight, pack_codes

# GGUF type -> (fusec format, weights per block, bytes per block)
PACKED: dict[str, tuple[str, int, int]] = {
    "Q8_0": ("q8_0", 32, 34), "Q4_0": ("q4_0", 32, 18), "Q4_1": ("q4_1", 32, 20), "Q5_0": ("q5_0", 32, 22),
    "Q5_1": ("q5_1", 32, 24), "Q4_K": ("q4_k", 256, 144), "Q5_K": ("q5_k", 256, 176), "Q6_K": ("q6_k", 256, 210),
}
_SLAB_BLOCKS = 1 << 16  # blocks decoded at once (bounds the temporaries to a few MB)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row -> fp16 [rows]."""
    return np.ascontiguousarray(b).view("<f2").reshape(b.shape[0])


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[nb, m * width] bytes -> [nb, m, 2, width]: low nibbles of each run of ``width`` bytes, then high."""
    nb = qs.shape[0]
    return (qs.reshape(nb, -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """[nb, 4] bytes (a little-endian u32 per block) -> [nb, 32] bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> (sc [nb, 8], m [nb, 8]) u8."""
    nb = scales.shape[0]
    s = scales.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode(kind: str, b: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Blocks [nb, type_size] -> (codes [nb, block] (u8, i8 for Q8_0), per-block fields)."""
    nb = b.shape[0]
    if kind == "Q8_0":
        return b[:, 2:].view(np.int8), [_f16(b[:, :2])]
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        q = _nibbles(b[:, head:], 16).reshape(nb, 32)
        return q, [_f16(b[:, :2])] + ([_f16(b[:, 2:4])] if kind == "Q4_1" else [])
    if kind in ("Q5_0", "Q5_1"):
        head = 2 if kind == "Q5_0" else 4
        q = _nibbles(b[:, head + 4:], 16).reshape(nb, 32) | (_qh_bits(b[:, head:head + 4]) << np.uint8(4))
        return q, [_f16(b[:, :2])] + ([_f16(b[:, 2:4])] if kind == "Q5_1" else [])
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scale_min(b[:, 4:16])
        if kind == "Q4_K":
            q = _nibbles(b[:, 16:144], 32).reshape(nb, 256)
        else:  # qh[32] then qs[128]; sub-block i's fifth bit is bit i of qh[l]
            low = _nibbles(b[:, 48:176], 32).reshape(nb, 8, 32)
            qh = b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = (low | ((qh & np.uint8(1)) << np.uint8(4))).reshape(nb, 256)
        return q, [_f16(b[:, :2]), sc, _f16(b[:, 2:4]), mn]
    if kind == "Q6_K":  # ql[128] qh[64] scales[16] (i8) d
        low = _nibbles(b[:, :128], 64).reshape(nb, 2, 4, 32)  # per half: ql[0:32]lo ql[32:64]lo ql[0:32]hi ql[32:64]hi
        qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
        q = (low | ((qh & np.uint8(3)) << np.uint8(4))).reshape(nb, 256)
        return q, [_f16(b[:, 208:210]), b[:, 192:208].view(np.int8)]
    raise AssertionError(kind)


def repack(data: np.ndarray, type_name: str, n: int, k: int, what: str) -> QWeight:
    """The packed form of GGUF tensor ``what`` ([N, K] of ``type_name``) from its raw bytes.
    ModelError (one line, naming ``what``) for a type not kept packed or a byte count that is not
    whole blocks of (N, K)."""
    spec = PACKED.get(type_name)
    if spec is None:
        raise ModelError(f"{what}: GGUF type {type_name} is not kept packed (packed: {', '.join(PACKED)})")
    fmt_name, block, size = spec
    if n <= 0 or k <= 0 or k % block:
        raise ModelError(f"{what} ({type_name}): rows of {k} weights are not whole {block}-weight blocks")
    raw = np.asarray(data).reshape(-1)
    if raw.dtype != np.uint8:
        raise ModelError(f"{what} ({type_name}): block data must be bytes, got {raw.dtype}")
    want = n * (k // block) * size
    if raw.size != want:
        raise ModelError(f"{what} ({type_name}): {raw.size} bytes, expected {want} for [{n}, {k}] "
                         f"(a truncated or padded block)")
    fmt = FORMATS[fmt_name]
    per_row = k // block
    blocks = raw.reshape(n * per_row, size)
    out: list[np.ndarray] | None = None  # the packed operands, filled a slab of rows at a time
    rows = max(1, _SLAB_BLOCKS // per_row)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        codes, got = _decode(type_name, blocks[r0 * per_row:r1 * per_row])
        # the fields come in the layout's operand order: d[, m] / d, sc, dmin, m (K-quants) / d, sc (Q6_K)
        parts = pack_codes(codes.reshape(r1 - r0, k), fmt.bits) + tuple(f.reshape(r1 - r0, -1) for f in got)
        if out is None:
            out = [np.empty((n,) + p.shape[1:], p.dtype) for p in parts]
        for dst, p in zip(out, parts):
            dst[r0:r1] = p
    assert out is not None
    return QWeight(fmt_name, n, k, fmt.group, tuple(out))


def _k_scales_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """(sc [nb, 8], m [nb, 8]) 6-bit values -> Q4_K/Q5_K's 12 bytes (the inverse of _k_scale_min)."""
    lo = (sc[:, :4] | ((sc[:, 4:] >> 4) << 6)).astype(np.uint8)
    mid = (mn[:, :4] | ((mn[:, 4:] >> 4) << 6)).astype(np.uint8)
    hi = ((sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)).astype(np.uint8)
    return np.concatenate([lo, mid, hi], axis=1)


def random_blocks(type_name: str, n: int, k: int, rng: np.random.Generator, scale: float = 2e-3) -> np.ndarray:
    """Random valid blocks of a [N, K] ``type_name`` tensor as raw bytes [N, K / block * size]:
    random codes and sub-scales, small finite fp16 scales (a random fp16 can be inf or NaN), and
    mins that center each group on zero (a model of such weights gives varied outputs)."""
    _, block, size = PACKED[type_name]
    nb = n * k // block
    b = rng.integers(0, 256, size=(nb, size), dtype=np.uint8)

    def f16(lo: float, hi: float) -> np.ndarray:
        return rng.uniform(lo, hi, size=(nb, 1)).astype(np.float16)

    if type_name == "Q6_K":
        b[:, 192:208] = rng.integers(-32, 32, size=(nb, 16), dtype=np.int8).view(np.uint8)
        b[:, 208:210] = f16(scale / 128, scale / 64).view(np.uint8)
    elif type_name in ("Q4_K", "Q5_K"):  # d = dmin, m = sc * (max code / 2): mean ~0
        half = 7.5 if type_name == "Q4_K" else 15.5
        sc = rng.integers(1, int(63 / half) + 1, size=(nb, 8))
        b[:, 0:2] = b[:, 2:4] = f16(scale / 16, scale / 8).view(np.uint8)
        b[:, 4:16] = _k_scales_bytes(sc, np.rint(sc * half).astype(np.int64))
    else:
        d = f16(scale / 2, scale)
        b[:, 0:2] = d.view(np.uint8)
        if type_name in ("Q4_1", "Q5_1"):  # min = -d * (max code / 2)
            b[:, 2:4] = (-d.astype(np.float32) * (7.5 if type_name == "Q4_1" else 15.5)).astype(np.float16).view(np.uint8)
    return b.reshape(n, k // block * size)
