"""Packed quantized weights (fusec/quant.py, fusec/quant_gguf.py, fusec/quantize.py) and QMATMUL.

The GGUF repacking is checked bit for bit against ``gguf.quants.dequantize`` (the format's
definition) for every type kept packed, on odd shapes, with valid random blocks and with fully
random bytes (NaN/inf scales included). QMATMUL's reference is checked against x @ W^T of the
dequantized weight, its type rule against malformed operands, and bad GGUF data gives one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import IRError, Node, Value, verify
from fusec.ops import Op, QMatMulAttrs
from fusec.quant import FORMATS, QWeight, get_format, operand_types, pack_codes, unpack_codes
from fusec.quant_gguf import PACKED, random_blocks, repack
from fusec.quantize import quantize_weight

gguf = pytest.importorskip("gguf")

# odd row counts, several blocks per row, K-quant super-blocks of 256
SHAPES = {32: [(1, 32), (3, 96), (7, 576)], 256: [(1, 256), (5, 512), (3, 768)]}


@pytest.mark.parametrize("type_name", list(PACKED))
def test_repack_is_bit_exact_against_gguf(type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    qtype = gguf.GGMLQuantizationType[type_name]
    for n, k in SHAPES[PACKED[type_name][1]]:
        raw = random_blocks(type_name, n, k, rng)
        qw = repack(raw, type_name, n, k, "w")
        ref = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32)
        got = qw.dequantize()
        assert got.dtype == np.float32 and got.shape == (n, k)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), type_name  # bit for bit
        noise = rng.integers(0, 256, size=raw.shape, dtype=np.uint8)  # any bytes: NaN/inf scales too
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(repack(noise, type_name, n, k, "w").dequantize(),
                                          gguf.quants.dequantize(noise, qtype).reshape(n, k))
        rows = rng.permutation(n)  # rows permute freely (GGUF q/k un-permutation)
        np.testing.assert_array_equal(qw.rows(rows).dequantize(), got[rows])
        mid = qw.dequantize(n // 2, n)  # a block of rows at a time (the reference's way)
        np.testing.assert_array_equal(mid, got[n // 2:])


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_codes_round_trips(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(-128, 128, size=(3, 96), dtype=np.int8) if bits == 8 else \
        rng.integers(0, 1 << bits, size=(3, 96), dtype=np.uint8)
    packed = pack_codes(q, bits)
    assert len(packed) == (2 if bits in (5, 6) else 1)
    assert packed[0].nbytes == (q.size if bits == 8 else q.size // 2)  # one 16-byte run per 32 weights
    np.testing.assert_array_equal(unpack_codes(packed[0], packed[1] if len(packed) > 1 else None, bits, 96), q)
    if bits == 4:  # byte j of a 32-weight chunk holds w[j] (low nibble) and w[j + 16] (high)
        assert packed[0][0, 0] == (q[0, 0] | (q[0, 16] << 4))


def _qgraph(qw: QWeight, lead: tuple[int, ...], dt: DType = DType.F32):
    b = GraphBuilder("q")
    x = b.input("x", (*lead, qw.k), dt)
    cs = [b.const(a, name=f"w.{r}") for r, a in zip(qw.roles, qw.arrays)]
    b.output(b.emit(Op.QMATMUL, x, *cs, format=qw.format, n=qw.n, k=qw.k, group=qw.group), "y")
    return b.build()


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_1"])
def test_qmatmul_reference_is_x_times_dequantized_weight(type_name):
    rng = np.random.default_rng(1)
    n, k = 13, 512
    qw = repack(random_blocks(type_name, n, k, rng), type_name, n, k, "w")
    g = _qgraph(qw, (2, 3))
    verify(g)
    x = rng.standard_normal((2, 3, k)).astype(np.float32)
    y = reference.run(g, {"x": x})["y"]
    np.testing.assert_allclose(y, x @ qw.dequantize().T, rtol=1e-5, atol=2e-5)
    assert y.shape == (2, 3, n)
    # bf16 activations: fp32 math, the result rounded to bf16 (as every float op's reference)
    gb = _qgraph(qw, (2, 3), DType.BF16)
    yb = reference.run(gb, {"x": x.astype(DType.BF16.np)})["y"]
    assert yb.dtype == DType.BF16.np
    np.testing.assert_allclose(yb.astype(np.float32), x.astype(DType.BF16.np).astype(np.float32) @ qw.dequantize().T,
                               rtol=1e-2, atol=1e-3)


def test_qmatmul_type_rule_names_the_bad_operand():
    rng = np.random.default_rng(2)
    qw = repack(random_blocks("Q4_K", 4, 256, rng), "Q4_K", 4, 256, "w")
    g = _qgraph(qw, (1,))
    mm = g.nodes[0]
    # scales of the wrong shape
    bad = list(mm.inputs)
    bad[2] = Value("w.scale", (4, 2), DType.F16, np.zeros((4, 2), np.float16))
    g.nodes[0] = Node(Op.QMATMUL, bad, mm.outputs, mm.attrs)
    g.constants[1] = bad[2]
    with pytest.raises(IRError, match=r"operand 'scale' must be f16\[4,1\], got f16\[4,2\]"):
        verify(g)
    with pytest.raises(ValueError, match="group size 48 must be a multiple of 16 that divides K=256"):
        QMatMulAttrs("uint4", 4, 256, 48)
    with pytest.raises(ValueError, match="q4_k has groups of 32 weights"):
        QMatMulAttrs("q4_k", 4, 256, 64)
    with pytest.raises(ValueError, match="K=80 must be a multiple of 32"):
        QMatMulAttrs("int8", 4, 80, 16)
    with pytest.raises(ValueError, match="unknown quantized format 'q3_k'"):
        QMatMulAttrs("q3_k", 4, 256, 16)


def test_repack_bad_input_is_one_line():
    rng = np.random.default_rng(3)
    raw = random_blocks("Q4_K", 2, 512, rng)
    with pytest.raises(ModelError, match=r"^w \(Q4_K\): 575 bytes, expected 576 for \[2, 512\] \(a truncated") as e:
        repack(raw.reshape(-1)[:-1], "Q4_K", 2, 512, "w")
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match=r"GGUF type IQ4_XS is not kept packed"):
        repack(raw, "IQ4_XS", 2, 512, "w")
    with pytest.raises(ModelError, match="rows of 500 weights are not whole 256-weight blocks"):
        repack(raw, "Q4_K", 2, 500, "w")
    with pytest.raises(ModelError, match="576 bytes, expected 864"):  # a shape claiming more rows than the bytes hold
        repack(raw, "Q4_K", 3, 512, "w")


def test_operand_layout_is_16_byte_friendly():
    """Every packed operand's rows start 16-byte aligned when K is a multiple of 256 (codes rows
    are K/2 bytes: one 16-byte load per 32 weights), and bits per weight are what the format costs."""
    for fmt in FORMATS.values():
        group = fmt.group or 128
        for role, shape, dt in operand_types(fmt, 8, 4096, group):
            if role == "codes":
                assert shape[1] * dt.itemsize % 16 == 0
    assert get_format("q4_k").bits_per_weight(32) == pytest.approx(4.625)  # 4 + d, dmin (16/256 each) + sc, m (8/32 each)
    assert get_format("q4_0").bits_per_weight(32) == pytest.approx(4.5)
    assert get_format("q8_0").bits_per_weight(32) == pytest.approx(8.5)
    assert get_format("q6_k").bits_per_weight(16) == pytest.approx(6.5625)


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 32), ("int4", 128)])
def test_rtn_quantizer_error_is_bounded(method, group):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((24, 256)).astype(np.float32) * 0.05
    w[3] = 0.0  # a constant row: scale 1, exact zeros
    qw = quantize_weight(w, method, group or 128)
    d = qw.dequantize()
    assert np.array_equal(d[3], np.zeros(256, np.float32))
    if method == "int8":
        step = np.abs(w).max(axis=1, keepdims=True) / 127
    else:
        g = w.reshape(24, -1, group)
        step = np.repeat((np.maximum(g.max(-1), 0) - np.minimum(g.min(-1), 0)) / 15, group, axis=1)
    assert (np.abs(d - w) <= step * 0.5 * 1.01 + 1e-7).all()  # round to nearest: half a step (fp16 scale)
    with pytest.raises(ValueError, match="w: K=80 is not a multiple of 32"):
        quantize_weight(np.zeros((2, 80), np.float32), method, group or 128, "w")
    bad = w.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_weight(bad, method, group or 128)


def test_qgather_reads_dequantized_rows():
    from fusec.errors import InputError

    rng = np.random.default_rng(7)
    qw = repack(random_blocks("Q6_K", 40, 256, rng), "Q6_K", 40, 256, "emb")
    b = GraphBuilder("g")
    ids = b.input("ids", (2, 3), DType.I64)
    cs = [b.const(a, name=f"emb.{r}") for r, a in zip(qw.roles, qw.arrays)]
    b.output(b.emit(Op.QGATHER, ids, *cs, format="q6_k", n=40, k=256, group=16), "x")
    g = b.build()
    verify(g)
    feeds = np.array([[0, 39, -1], [5, 5, -40]])
    got = reference.run(g, {"ids": feeds})["x"]
    np.testing.assert_array_equal(got, qw.dequantize()[feeds])  # negative ids count from the end
    with pytest.raises(InputError, match=r"qgather: index out of range \[-40, 40\)"):
        reference.run(g, {"ids": np.array([[0, 40, 1], [0, 0, 0]])})
