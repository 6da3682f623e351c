"""The kernels over packed weights without a GPU: templates/quant.cuh's decoding rendered in numpy
(the kernel's math: 32-bit words of codes, bytes picked as the PRMT does, high words per 8-weight
step, w = s * ((2**23 + q) - (2**23 + z)) + o with an FMA) equals the format's reference
dequantization; every format's GEMV and dequantization kernels compile with NVRTC for sm_80 and
sm_90; the lowering picks the GEMV for M <= 16 (epilogue fused) and dequantize + cuBLAS above."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import quant
from fusec.codegen import kernels as K
from fusec.codegen.specs import Epilogue
from fusec.codegen.specs_quant import DP4A_SMEM, QDequantSpec, QGemvSpec, dp4a_fits, dp4a_smem
from fusec.dtypes import DType
from fusec.lower.qgemv_form import TC_MIN_M, gemv_form
from fusec.quant import FORMATS, QWeight, from_affine
from fusec.quant_gguf import PACKED, random_blocks, repack
from fusec.quantize import quantize_weight


def sample_weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> QWeight:
    """A random weight packed in ``fmt`` (GGUF blocks, the RTN quantizer, or random affine codes)."""
    gguf_type = next((t for t, (f, _, _) in PACKED.items() if f == fmt), None)
    if gguf_type is not None:
        return repack(random_blocks(gguf_type, n, k, rng), gguf_type, n, k, "w")
    if fmt == "int8":
        return quantize_weight(rng.standard_normal((n, k)).astype(np.float32), "int8")
    bits = 8 if fmt.endswith("8") else 4
    q = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    if fmt == "int4":
        q = (q.astype(np.int16) - 8).astype(np.int8)
    ng = k // 64
    zero = rng.integers(0, 1 << bits, (n, ng)).astype(np.uint8) if fmt.startswith("uint") else None
    qw = from_affine(q, (rng.random((n, ng)) * 0.01 + 1e-3).astype(np.float16), zero, bits)
    assert qw.format == fmt
    return qw


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fmaf: the product exact in fp64, one rounding of the sum (to fp64, then fp32)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def qb_high(h: np.ndarray, i: int, upper: bool, hb: int) -> np.ndarray:
    """templates/quant.cuh's qb_high: bits 4.. of code word i's codes from a chunk's high words ``h`` [..., hb], at bits
    4.. of each byte under the word's low nibbles or (``upper``) its high ones."""
    w, t = h[..., i // (4 // hb)], hb * (i % (4 // hb))
    return ((w >> np.uint32(t)) << np.uint32(4 if upper else 0)) & np.uint32(((1 << hb) - 1) * 0x10101010)


def kernel_dequant(qw: QWeight) -> np.ndarray:
    """W as templates/quant.cuh computes it (qb_load + qb_w8), from the packed bytes."""
    f = qw.fmt
    it = iter(qw.arrays)
    codes = next(it)
    high = next(it) if f.high_words else None
    scale = next(it).astype(np.float32)
    sub = next(it) if f.sub_scale is not None else None
    zero = next(it) if f.zero is None else None
    minv = next(it).astype(np.float32) if f.offset != "none" else None
    mins = next(it) if f.offset == "kmin" else None
    n, k, group = qw.n, qw.k, qw.group
    sb = f.super_block or group
    words = codes.view(np.uint8).reshape(n, k // 32, -1).view("<u4")  # 4 words a chunk (8 for 8 bits)
    out = np.zeros((n, k), np.float32)
    for c in range(k // 32):
        for s in range(4):
            if f.bits == 8:
                q = words[:, c, (s // 2) * 4 + (s & 1) * 2:(s // 2) * 4 + (s & 1) * 2 + 2]
                if f.signed:
                    q = q ^ np.uint32(0x80808080)
            else:
                pair = words[:, c, (s & 1) * 2:(s & 1) * 2 + 2]
                q = (pair >> np.uint32(0 if s < 2 else 4)) & np.uint32(0x0F0F0F0F)
            byte = np.stack([(q >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], axis=-1).reshape(n, 8)
            if f.bits in (5, 6):  # qb_high: code words 2 (s & 1) and + 1, one shift and a mask each
                hb = f.bits - 4
                h = high.reshape(n, k // 32, hb)[:, c, :]
                hw = np.stack([qb_high(h, i, s >= 2, hb) for i in ((s & 1) * 2, (s & 1) * 2 + 1)], axis=-1)
                byte |= np.stack([(hw >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(4)], axis=-1).reshape(n, 8)
            g = (c * 32 + s * 8) // group
            sg = scale[:, (c * 32 + s * 8) // sb].copy()
            if sub is not None:
                sg *= sub[:, g].astype(np.int8 if f.sub_scale == DType.I8 else np.uint8).astype(np.float32)
            z = f.zero if f.zero is not None else zero[:, g].astype(np.int64)
            z = z + (128 if f.bits == 8 and f.signed else 0)
            qf = (np.float32(8388608) + byte.astype(np.float32)) - (np.float32(8388608) + np.asarray(z, np.float32))[..., None] \
                if np.ndim(z) else (np.float32(8388608) + byte.astype(np.float32)) - np.float32(8388608 + z)
            if f.offset == "none":
                w = sg[:, None] * qf
            else:
                o = minv[:, g] if f.offset == "min" else -(minv[:, (c * 32 + s * 8) // sb] * mins[:, g].astype(np.float32))
                w = _fma(np.broadcast_to(sg[:, None], qf.shape), qf, np.broadcast_to(o[:, None], qf.shape))
            out[:, c * 32 + s * 8:c * 32 + s * 8 + 8] = w
    return out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_kernel_decoding_is_the_formats_dequantization(fmt):
    rng = np.random.default_rng(sum(map(ord, fmt)))
    qw = sample_weight(fmt, 5, 512, rng)
    ref = qw.dequantize()
    got = kernel_dequant(qw)
    if FORMATS[fmt].offset == "none":  # s * (q - z): the same two roundings as the reference
        np.testing.assert_array_equal(got, ref)
    else:  # s * (q - z) + o as one FMA: within an ulp of the magnitudes involved
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-7 * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("bits", [5, 6])
def test_high_words_decode_in_the_tensor_core_forms_lane_view(bits):
    """The high words' layout (fusec.quant) as the tensor-core form's lane c decodes it (templates/qgemv_tc.cu.jinja):
    qb_high's bits of code word c, then pairs of bytes (0, 2) as they are and (1, 3) >> 8, each & 0x00FF00FF, ORed
    into the code nibbles' pairs: every code of random rows, at both 16-bit halves of every pair. (dp4a's view is
    kernel_dequant's, checked against the reference above.)"""
    rng = np.random.default_rng(bits)
    n, k, hb = 5, 96, bits - 4
    q = rng.integers(0, 1 << bits, (n, k)).astype(np.uint8)
    codes, high = quant.pack_codes(q, bits)
    words = codes.reshape(n, k // 32, 4, 4).view("<u4")[..., 0]  # [row, chunk, code word c]
    h = high.reshape(n, k // 32, hb)
    qc = q.reshape(n, k // 32, 32).astype(np.int64)
    lo = np.uint32(0x000F000F)
    for c in range(4):  # lane c reads code word c: 16-bit pairs (weights w, w + 2) at bits 0 and 16
        a = words[:, :, c]
        for st in range(2):  # step 0: low nibbles, 1: high ones
            u, nib = qb_high(h, c, st == 1, hb), a >> np.uint32(4 * st)
            for odd in range(2):
                v = ((nib >> np.uint32(8 * odd)) & lo) | ((u >> np.uint32(8 * odd)) & np.uint32(0x00FF00FF))
                w = 16 * st + 4 * c + odd
                v = v.astype(np.int64)
                assert np.array_equal(v & 0xFFFF, qc[:, :, w]) and np.array_equal(v >> 16, qc[:, :, w + 2]), \
                    (bits, c, st)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_kernels_compile(fmt):
    group = FORMATS[fmt].group or 64
    epi = Epilogue(bias=True, activation="silu", residual=True)
    K.build(QGemvSpec(3, 77, 512, fmt, group, DType.BF16, DType.F16, epi), "sm_90")
    K.build(QDequantSpec(77, 512, fmt, group, DType.F16, DType.F16, row0=16, rows=40), "sm_80")
    K.build(QDequantSpec(77, 512, fmt, group, DType.F32, DType.F16, row0=16, rows=40), "sm_90")


def test_gather_kernel_compiles():
    for arch, dt in (("sm_80", DType.BF16), ("sm_90", DType.F32)):
        K.build(QDequantSpec(49152, 576, "q8_0", 32, dt, DType.F16, ids=7, id_dtype=DType.I32), arch)


def test_the_dequantizing_kernel_stores_whole_lines_through_shared_memory():
    """A chunk's values go to the block's shared memory, and each of the warp's store instructions writes one 16-byte
    piece a lane, lanes adjacent; a lane past the end waits for the kernel before too (it may store a live lane's
    piece)."""
    src = K.build(QDequantSpec(77, 512, "q4_k", 32, DType.BF16, DType.F16), "sm_90").source
    body = src.split('extern "C"')[1]
    assert "fc_stage" in body and body.index("__syncwarp") < body.index("*reinterpret_cast<uint4*>(dst + b)")
    assert body.count("fc_pdl_wait") == 2


def test_every_launch_of_a_packed_decode_step_records_what_it_writes():
    """The program's dependencies come from each launch's written bytes (a kernel's output parameters by name): the
    quantized gather and dequantize kernels name theirs ``out`` (they named it ``W``, and their launches recorded
    the row they write as read: the token's embedding row then had no writer before the first product)."""
    import dataclasses as dc

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomPackedWeights, q4_k_m_types
    from fusec.program import Task, dependencies

    cfg = dc.replace(get_config("llama-tiny"), hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                     head_dim=64, num_layers=2, tie_word_embeddings=False, name="llama-q4km-writes")
    gm = GenModel(cfg, SharedWeights(RandomPackedWeights(q4_k_m_types(2), seed=1, scale=0.02)), None, (), cfg.name)
    plan = compile_generation(gm, batch=1, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90")
    launches = plan.manifest["entries"]["decode"]["launches"]
    assert all(L["writes"] for L in launches if "kernel" in L), [L["label"] for L in launches if not L["writes"]]
    gather = next(i for i, L in enumerate(launches) if "qgather" in L["label"])
    first = next(i for i, L in enumerate(launches) if "qgemv" in L["label"])
    deps = dependencies([Task.from_json(L) for L in launches])
    assert gather in deps[first]  # the first product reads the row the gather wrote


@pytest.mark.parametrize("m,rows,dt,arch,fold", [
    (1, 2, DType.F32, "sm_80", False), (1, 2, DType.F32, "sm_80", True), (16, 1, DType.F16, "sm_90", False),
    (16, 1, DType.F16, "sm_90", True), (8, 4, DType.BF16, "sm_80", False)])
def test_gemv_variants_compile(m, rows, dt, arch, fold):
    K.build(QGemvSpec(m, 4096, 11008, "q4_k", 32, dt, DType.F16, rows=rows, fold=fold), arch)
    K.build(QGemvSpec(m, 100, 4096, "uint4", 128, dt, DType.F32, rows=rows, fold=fold), arch)


def test_gemv_form_folds_at_one_row_only():
    assert gemv_form(1, 4096, 2048, "q8_0", 32, DType.F32) == {"rows": 2, "fold": True}
    assert gemv_form(8, 4096, 2048, "q8_0", 32, DType.F32, glu=True) == {"rows": 2, "fold": False}
    assert gemv_form(9, 4096, 2048, "q4_k", 32, DType.F32)["rows"] == 1  # past 8 rows (fp32 x: the FMA form)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_gemv_form_takes_dp4a_where_it_fits_and_tensor_cores_do_not(fmt, monkeypatch):
    """fp16/bf16 x, x written within the form's shared memory: the dp4a form up to 3 rows, and up to 8 where the
    tensor-core form does not take the product (FUSEC_QGEMV_FORM=dp4a; a gated product too, the gated unit apart); 8
    warps; at one row of x 8 chunks a round (FUSEC_QGEMV_DP4A_CHUNKS=4: 4) over two weight rows a task below K = 8192, at 2-3 rows 4 over two rows
    below K = 4096, a gated unit's two halves always; from 4 rows one row a task, 2 chunks; 2 blocks an SM
    (FUSEC_QGEMV_DP4A_BLOCKS: its value). fp32 x, M > 8 (tensor cores there), rows too long, or
    FUSEC_QGEMV_FORM=tc/fma: not. (4 rows a
    task, the FILL and WIDE_ROWS rules, are off here: their own tests below.)"""
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_FILL", "0")
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_WIDE_ROWS", "1")
    group = FORMATS[fmt].group or 32
    bits = FORMATS[fmt].bits
    for m, choice in [(m, "auto") for m in range(1, 10)] + [(m, "dp4a") for m in range(4, 10)]:
        monkeypatch.setenv("FUSEC_QGEMV_FORM", choice)
        for dt in (DType.BF16, DType.F16, DType.F32):
            for norm, glu in ((False, False), (True, True)):
                f = gemv_form(m, 16384, 2048, fmt, group, dt, norm, glu)
                tensor = choice == "auto" and m >= TC_MIN_M and dt != DType.F32 \
                    and not (bits == 8 and m == 4)  # the dp4a form over tensor cores at 16384 weight rows
                assert f.get("tc", False) == (tensor and not (m <= 3 and dt != DType.F32)), (m, dt, f)
                wide_ok = m <= 8 and not tensor
                assert f.get("dp4a", False) == (dt != DType.F32 and (m <= 3 or (m >= 4 and wide_ok))), (m, dt, f)
                if not f.get("dp4a"):
                    continue
                assert not f.get("tc") and f["warps"] == 8 and f["blocks"] == 2
                gated = "silu" if glu and m <= 3 else ""  # from 4 rows the gated unit runs apart (skinny.qfits)
                QGemvSpec(m, 16384, 2048, fmt, group, dt, DType.F16, norm=norm, glu=gated, **f)
                if m >= 4:
                    assert (f["rows"], f["chunks"]) == (1, 2), (m, f)  # one row a task, 2 chunks a round
                    assert "dp4a" not in gemv_form(m, 2048, 8192, fmt, group, dt)  # x's digits do not fit
                    continue
                assert (f["rows"], f["chunks"]) == (2, 8 if m == 1 else 4)
                # long rows: one a task, unless a gated unit's two halves
                long = gemv_form(m, 2048, 4096, fmt, group, dt, norm, glu)
                assert long["rows"] == (2 if glu or m == 1 else 1)
                longer = gemv_form(m, 2048, 8192, fmt, group, dt, norm, glu)
                assert not longer.get("dp4a") or longer["rows"] == (2 if glu else 1)
                monkeypatch.setenv("FUSEC_QGEMV_DP4A_CHUNKS", "4")  # 4 chunks a round at one row of x too
                four = gemv_form(m, 2048, 4096, fmt, group, dt, norm, glu)
                assert (four["chunks"], four["rows"]) == (4, 2 if glu else 1)
                monkeypatch.delenv("FUSEC_QGEMV_DP4A_CHUNKS")
                monkeypatch.setenv("FUSEC_QGEMV_DP4A_BLOCKS", "3")
                assert gemv_form(m, 16384, 2048, fmt, group, dt, norm, glu)["blocks"] == 3
                monkeypatch.delenv("FUSEC_QGEMV_DP4A_BLOCKS")
    too_long = next(k for k in range(2048, 1 << 20, 2048) if not dp4a_fits(3, k, False, DType.BF16))
    assert dp4a_smem(3, too_long, False) > DP4A_SMEM >= dp4a_smem(3, too_long - 2048, False)
    assert "dp4a" not in gemv_form(3, 2048, too_long, fmt, group, DType.BF16)
    assert "dp4a" in gemv_form(1, 2048, too_long, fmt, group, DType.BF16)
    for choice in ("tc", "fma"):
        monkeypatch.setenv("FUSEC_QGEMV_FORM", choice)
        for m in (1, 8):
            assert "dp4a" not in gemv_form(m, 16384, 2048, fmt, group, DType.BF16)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9, 16])
@pytest.mark.parametrize("dt", [DType.BF16, DType.F16, DType.F32])
def test_gemv_form_takes_tensor_cores_where_they_fit(fmt, m, dt, monkeypatch):
    """Without the dp4a form: 4- to 8-bit codes, fp16/bf16, from M = 3 to 16 (two tiles of x past 8): the
    tensor-core form, 4 warps a block of 16 rows where two blocks an SM run, 8 from 160 blocks, else
    16, and at least 8 for 8-bit codes (FUSEC_QGEMV_TC_MIN_WARPS=4: 4); anything else, or
    FUSEC_QGEMV_FORM=fma: the FMA form. And with it, from M = 4, but for 8-bit codes at 4 rows over at least
    DP4A_OVER_TC_N weight rows; with FUSEC_QGEMV_FORM=dp4a never."""
    from fusec import knobs
    from fusec.codegen.build_quant import qgemv_tc_geometry
    from fusec.lower.qgemv_form import DP4A_OVER_TC_N, tc_smem_max

    bits = FORMATS[fmt].bits
    fits = 3 <= m <= 16 and dt != DType.F32
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "tc")  # the rule without the dp4a form (the test above)
    group = FORMATS[fmt].group or 32
    for n, warps in ((2048, 16), (2544, 16), (2560, 8), (3072, 8), (4208, 8), (4224, 4), (128256, 4)):
        f = gemv_form(m, n, 2048, fmt, group, dt)
        assert f.get("tc", False) == fits and (not fits or f["warps"] == max(warps, 8 if bits == 8 else 4)), (n, f)
        QGemvSpec(m, n, 2048, fmt, group, dt, DType.F16, **f)  # a spec the rule makes is valid
        monkeypatch.setenv("FUSEC_QGEMV_TC_MIN_WARPS", "4")
        assert not fits or gemv_form(m, n, 2048, fmt, group, dt)["warps"] == warps
        monkeypatch.delenv("FUSEC_QGEMV_TC_MIN_WARPS")
    # rows too long for the tensor-core form's copy of them in shared memory: runs of chunks a warp copies in turn,
    # then, past FUSEC_QGEMV_TC_RUNS runs, the FMA form
    long_k = next(k for k in range(2048, 1 << 20, 2048)
                  if qgemv_tc_geometry(k, group, 16, fmt, 1)["smem"] > tc_smem_max())
    assert gemv_form(m, 2048, long_k, fmt, group, dt).get("passes", 0) == (2 if fits else 0)
    assert "passes" not in gemv_form(m, 2048, long_k - 2048, fmt, group, dt)
    assert gemv_form(m, 2048, long_k - 2048, fmt, group, dt).get("tc", False) == fits
    longer = next(k for k in range(long_k, 1 << 22, 2048)
                  if qgemv_tc_geometry(k, group, 16, fmt, int(knobs.get("FUSEC_QGEMV_TC_RUNS")))["smem"]
                  > tc_smem_max())
    assert "tc" not in gemv_form(m, 2048, longer, fmt, group, dt)
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "fma")
    assert "tc" not in gemv_form(m, 16384, 2048, fmt, group, dt)
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "dp4a")
    assert "tc" not in gemv_form(m, 16384, 2048, fmt, group, dt)
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "auto")
    assert gemv_form(m, 16384, 2048, fmt, group, dt).get("tc", False) == (fits and m > 3 and not (bits == 8 and m == 4))
    assert gemv_form(m, DP4A_OVER_TC_N - 16, 2048, fmt, group, dt).get("tc", False) == (fits and m > 3)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tensor_core_form_compiles(arch):
    epi = Epilogue(bias=True, activation="silu", residual=True)
    for fmt in FORMATS:
        for group in ((FORMATS[fmt].group,) if FORMATS[fmt].group else (16, 128)):
            for dt, m, warps in ((DType.BF16, 8, 8), (DType.F16, 8, 16), (DType.BF16, 16, 4), (DType.F16, 11, 16)):
                ck = K.build(QGemvSpec(m, 301, 512, fmt, group, dt, DType.F16, epi, tc=True, warps=warps), arch)
                assert ck.template == "qgemv_tc.cu.jinja" and ck.binary.spill_bytes == 0, (fmt, group, dt)
                assert ck.grid[0] == 19 and ck.block[0] == 32 * warps and ck.shared_mem > 0


@pytest.mark.parametrize("fmt", ["q8_0", "int8", "uint8"])
@pytest.mark.parametrize("dt", [DType.F16, DType.BF16])
def test_tensor_core_eight_bit_operands_are_bias_plus_code_exactly(fmt, dt):
    """The tensor-core form's 8-bit A operands, as the kernel's source defines them (CODE_MASK, MAGIC, MAGIC_HI),
    over every byte pair: fp16 reads MAGIC | u as 1024 + u; bf16 sums its two operands (the low 7 bits, then bit 7)
    to 256 + u; u is the stored byte, or q + 128 for signed codes; and BIAS is that constant."""
    import re

    import ml_dtypes

    src = K.prepare(QGemvSpec(8, 64, 256, fmt, FORMATS[fmt].group or 32, dt, DType.F16, tc=True, warps=4))[1]
    const = {n: int(v) for n, v in re.findall(r"#define (CODE_MASK|MAGIC|MAGIC_HI) (\d+)u", src)}
    bias = float(re.search(r"#define BIAS (\S+)", src).group(1).rstrip("f"))
    b = np.arange(256, dtype=np.uint32)
    words = b | (b[::-1] << 16)  # bytes 0 and 2 of a code word: every value, each half
    u = (words ^ 0x00800080) if FORMATS[fmt].signed else words  # the codes as unsigned (signed: q + 128)
    np16 = np.float16 if dt == DType.F16 else ml_dtypes.bfloat16

    def halves(w: np.ndarray) -> np.ndarray:
        return np.stack([w & 0xFFFF, w >> 16], -1).astype(np.uint16).view(np16).astype(np.float64)

    total = halves((words & const["CODE_MASK"]) ^ const["MAGIC"])
    if dt == DType.BF16:
        total = total + halves((words & 0x00800080) ^ const["MAGIC_HI"])
    else:
        assert const["MAGIC_HI"] == 0
    want = bias + np.stack([u & 0xFF, (u >> 16) & 0xFF], -1).astype(np.float64)
    assert np.array_equal(total, want), (fmt, dt)
    assert bias == (1024.0 if dt == DType.F16 else 256.0)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tensor_core_gated_epilogue_compiles_and_fuses_unless_its_knob_is_off(arch, monkeypatch):
    """The tensor-core form with a gated unit (8 rows of each half a block: cdiv(F, 8) blocks) compiles without spills
    at Llama-1B's and 7B's gate/up and at a small odd F in runs; fusion gives it the SwiGLU at batch 8 unless
    FUSEC_QGEMV_TC_GATE=0 (one launch fewer a layer), never the norm."""
    for fmt in ("q4_k", "q6_k", "q8_0", "uint4"):
        group = FORMATS[fmt].group or 32
        for n, k, warps, passes in ((16384, 2048, 4, 1), (22016, 4096, 8, 1), (154, 1536, 16, 3)):
            spec = QGemvSpec(8, n, k, fmt, group, DType.BF16, DType.F16, Epilogue(bias=True, residual=True),
                             glu="silu", tc=True, warps=warps, passes=passes)
            ck = K.build(spec, arch)
            assert ck.binary.spill_bytes == 0 and ck.grid[0] == -(-n // 16), (fmt, n)
            assert "#define GLU 1" in ck.source and f"#define F_ {n // 2}" in ck.source
    with pytest.raises(ValueError, match="norm prologue"):
        QGemvSpec(8, 16384, 2048, "q4_k", 32, DType.BF16, DType.F16, norm=True, tc=True, warps=4)
    if arch == "sm_80":
        return
    gated = [L["label"] for L in _packed_decode_launches("bf16", 8)]
    monkeypatch.setenv("FUSEC_QGEMV_TC_GATE", "0")
    labels = [L["label"] for L in _packed_decode_launches("bf16", 8)]
    assert not any("gated_epilogue" in lab for lab in labels)
    assert sum("gated_epilogue" in lab for lab in gated) == 2 and len(gated) == len(labels) - 2, gated
    assert sum(lab.endswith("rmsnorm") for lab in gated) == sum(lab.endswith("rmsnorm") for lab in labels)


def test_tensor_core_high_words_copy_16_bytes_where_aligned():
    """The 5/6-bit codes' high words go in 16-byte copies where every row's and warp's range starts on 16 bytes, else 4
    bytes at a time; the GPU test's shapes (tests/test_quant_gpu.py: K = 1536 for K-quants, 1472 otherwise) take
    both."""
    from fusec.codegen.build_quant import qgemv_tc_geometry

    widths = set()
    for fmt in (f for f in FORMATS if FORMATS[f].high_words):
        k = 1536 if FORMATS[fmt].super_block else 1472
        for warps, passes in ((4, 1), (8, 1), (16, 1), (16, 3), (4, 2), (8, 2)):
            spec = QGemvSpec(8, 301, k, fmt, FORMATS[fmt].group or 32, DType.BF16, DType.F16, tc=True, warps=warps,
                             passes=passes)
            src = K.prepare(spec)[1]
            wide = "qt_copy_rows<16, CPS * HB / 4" in src
            assert wide or "qt_copy_rows<4, CPS * HB / 1" in src, (fmt, warps, passes)
            hb, geo = FORMATS[fmt].high_words, qgemv_tc_geometry(k, spec.group, warps, fmt, passes)
            assert wide == ((k // 32 * hb) % 4 == 0 and (geo["cpw"] * hb) % 4 == 0), (fmt, warps, passes)
            assert geo["hrs"] % 8 == 4  # aligned rows, 8 banks
            widths.add(wide)
    assert widths == {True, False}


def test_tensor_core_scale_table_holds_the_scale_alone_where_the_format_has_nothing_else():
    """Formats without an offset or a zero operand (Q6_K, Q8_0, Q4_0, ...) keep one float a group in the tensor-core
    form's scale table, the others (s, o - s (BIAS + z)); a row's stride is odd where a lane reads one float a row and
    chunk, = 2 mod 4 where it reads 8 bytes (8 rows' reads in different banks); the loop then folds -(BIAS + z) * sum(x)
    in before the scale. So the Llama-1B Q6_K LM head's blocks at 8 rows of x fit 6 an SM (228 KB, 1 KB reserved a
    block) instead of 5."""
    from fusec.codegen.build_quant import qgemv_tc_geometry

    SCALE_ONLY = {"q8_0", "q4_0", "q5_0", "q6_k", "int8", "int4"}  # no offset, no zero operand (fusec.quant's table)
    for fmt, f in FORMATS.items():
        if f.bits not in (4, 5, 6, 8):
            continue
        group = f.group or 32
        for k, warps in ((2048, 4), (2048, 8), (8192, 16), (1472 if not f.super_block else 1536, 16)):
            geo = qgemv_tc_geometry(k, group, warps, fmt)
            assert (geo["tv"] == 1) == (fmt in SCALE_ONLY), fmt
            width, unit = geo["tv"] * geo["cpw"] * geo["gpc"], geo["tv"] * geo["gpc"]
            assert geo["srs"] > width and (geo["srs"] % 2 == 1 if unit == 1 else geo["srs"] % 4 == 2), (fmt, k, geo)
        src = K.prepare(QGemvSpec(8, 301, 2048, fmt, group, DType.BF16, DType.F16, tc=True, warps=4))[1]
        assert (f"#define TV {geo['tv']}" in src) and (("fmaf(ZB, xs" in src) == f.scale_only), fmt
    form = gemv_form(8, 128256, 2048, "q6_k", 16, DType.BF16)
    smem = qgemv_tc_geometry(2048, 16, form["warps"], "q6_k")["smem"]
    assert (228 << 10) // (smem + 1024) == 6, smem


def test_tensor_core_stages_knob_splits_a_runs_copy_into_commit_groups(monkeypatch):
    """FUSEC_QGEMV_TC_STAGES=N puts N stages in the rule's tensor-core form (at most a run's chunks): the source issues
    N commit groups a run and waits for them one at a time, and compiles without spills (sm_90); the default keeps
    one group (the scale table's loads after the copies)."""
    from fusec.codegen.build_quant import qgemv_tc_geometry

    base = gemv_form(8, 16384, 2048, "q4_k", 32, DType.BF16)
    assert base.get("tc") and "stages" not in base
    src = K.prepare(QGemvSpec(8, 16384, 2048, "q4_k", 32, DType.BF16, DType.F16, **base))[1]
    assert src.count("fc_cp_async_commit();") == 1 and "#define STAGES 1" in src
    cpw = qgemv_tc_geometry(2048, 32, base["warps"], "q4_k")["cpw"]
    for n in (2, 4):
        monkeypatch.setenv("FUSEC_QGEMV_TC_STAGES", str(n))
        form = gemv_form(8, 16384, 2048, "q4_k", 32, DType.BF16)
        assert form["stages"] == min(n, cpw), form
        ck = K.build(QGemvSpec(8, 16384, 2048, "q4_k", 32, DType.BF16, DType.F16, **form), "sm_90")
        assert ck.source.count("fc_cp_async_commit();") == n and f"#define STAGES {n}" in ck.source
        assert ck.binary.spill_bytes == 0
    monkeypatch.setenv("FUSEC_QGEMV_TC_STAGES", "4")  # a run of 2 chunks (K = 256, 4 warps) takes 2 stages, not 4
    assert gemv_form(8, 16384, 256, "q4_k", 32, DType.BF16)["stages"] == 2
    with pytest.raises(ValueError, match="stages"):
        QGemvSpec(8, 2048, 2048, "q4_k", 32, DType.BF16, stages=2)  # the FMA form has no stages


def test_tensor_core_form_takes_long_rows_in_runs(monkeypatch):
    """Where a block's copy of its 16 rows is over ``tc_smem_max()`` at 16 warps (Llama-1B's downs, K = 8192, in Q6_K
    and Q4_K, at 8 rows of x; a 7B down, K = 11008, in Q6_K), the rule gives each warp its chunks in runs, copied in
    turn into the same shared memory: the kernel's shared memory is the run's, and it compiles without spills on sm_80
    and sm_90. The o product (K = 2048) takes one. FUSEC_QGEMV_TC_RUN_KB moves the limit: at 144 (the limit before the
    forty-third session) Llama-1B's Q6_K down takes one run, at 64 three."""
    from fusec.codegen.build_quant import qgemv_tc_geometry
    from fusec.lower.qgemv_form import tc_smem_max

    shapes = ((2048, 8192, "q6_k", 16, 2), (2048, 8192, "q4_k", 32, 2), (4096, 11008, "q6_k", 16, 3))
    for n, k, fmt, group, runs in shapes:
        form = gemv_form(8, n, k, fmt, group, DType.BF16)
        assert form.get("tc") and form["warps"] == 16 and form["passes"] == runs, form
        assert qgemv_tc_geometry(k, group, 16, fmt, runs - 1)["smem"] > tc_smem_max()  # one run fewer does not fit
        for arch in ("sm_80", "sm_90"):
            ck = K.build(QGemvSpec(8, n, k, fmt, group, DType.BF16, DType.F16, Epilogue(residual=True), **form), arch)
            assert ck.binary.spill_bytes == 0 and ck.shared_mem == qgemv_tc_geometry(k, group, 16, fmt, runs)["smem"]
            assert ck.shared_mem <= tc_smem_max() and f"#define PASSES {runs}" in ck.source
    assert "passes" not in gemv_form(8, 2048, 2048, "q6_k", 16, DType.BF16)
    with pytest.raises(ValueError, match="passes"):
        QGemvSpec(8, 2048, 8192, "q6_k", 16, DType.BF16, passes=2)  # the FMA form has no runs
    for kb, runs in (("144", 1), ("64", 3)):
        monkeypatch.setenv("FUSEC_QGEMV_TC_RUN_KB", kb)
        form = gemv_form(8, 2048, 8192, "q6_k", 16, DType.BF16)
        assert form.get("passes", 1) == runs and form["warps"] == 16, (kb, form)
        smem = qgemv_tc_geometry(8192, 16, 16, "q6_k", runs)["smem"]
        assert smem <= int(kb) << 10 and (runs == 1 or qgemv_tc_geometry(8192, 16, 16, "q6_k", runs - 1)["smem"]
                                          > int(kb) << 10), (kb, smem)
        ck = K.build(QGemvSpec(8, 2048, 8192, "q6_k", 16, DType.BF16, DType.F16, **form), "sm_90")
        assert ck.binary.spill_bytes == 0 and ck.shared_mem == smem
    monkeypatch.delenv("FUSEC_QGEMV_TC_RUN_KB")
    monkeypatch.setenv("FUSEC_QGEMV_TC_RUNS", "1")  # the lever: one run, so the FMA form, as before
    assert gemv_form(8, 2048, 8192, "q6_k", 16, DType.BF16) == {"rows": 2, "fold": False}


LLAMA_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048),  # 1B: qkv, o, gate/up, down, head
                (12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]  # 7B


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_forms_the_rule_picks_do_not_spill(arch):
    """At batch 8 and 16 the rule's form (tensor cores where they fit; at 16 rows two tiles of x, with fewer chunks
    unrolled and 80 registers a thread at 4 and 8 warps) of every Llama-1B and 7B product in Q4_K, Q6_K and Q8_0, and
    at 16 rows every Llama-1B product but the head in every format the tensor-core form takes (the gate/up gated too),
    compiles without register spills (ptxas -v through NVRTC)."""
    pending = []
    for m in (8, 16):
        for i, (n, k) in enumerate(LLAMA_SHAPES):
            every = m == 16 and i < 4  # the 1B's qkv, o, gate/up, down
            for fmt in [f for f in FORMATS if FORMATS[f].bits > 3] if every else ("q4_k", "q6_k", "q8_0"):
                group = FORMATS[fmt].group or 32
                for glu in ("", "silu") if m == 16 and n in (16384, 22016) else ("",):
                    form = gemv_form(m, n, k, fmt, group, DType.BF16, False, bool(glu))
                    spec = QGemvSpec(m, n, k, fmt, group, DType.BF16, DType.F16, glu=glu, **form)
                    pending.append(((m, n, k, fmt, glu, form), K.build_async(spec, arch)))
    assert sum(bool(w[-1].get("tc")) for w, _ in pending if w[0] == 8) >= 20  # most of them run on tensor cores
    assert all(w[-1].get("tc") for w, _ in pending if w[0] == 16)  # past 8 rows, only that form
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_dp4a_forms_the_rule_picks_compile_without_spills(arch, monkeypatch):
    """At M = 1, 2, 4 and 8 the rule's dp4a form of every Llama-1B and 7B product where it takes it, in every format
    (the 1B shapes; Q4_K and Q6_K on the 7B), plain and with the norm prologue and gated epilogue where K is the
    model's width, compiles without register spills (ptxas -v through NVRTC)."""
    pending = []
    for i, (n, k) in enumerate(LLAMA_SHAPES):
        for fmt in (FORMATS if i < 5 else ("q4_k", "q6_k")):
            group = FORMATS[fmt].group or 128
            for m in (1, 2, 4, 8):
                for norm, glu in ((False, False),) + (((True, True),) if k in (2048, 4096) else ()):
                    form = gemv_form(m, n, k, fmt, group, DType.BF16, norm, glu)
                    wide_ok = not form.get("tc")  # from 4 rows a gated unit runs apart (skinny.qfits)
                    assert bool(form.get("dp4a")) == (dp4a_fits(m, k, norm, DType.BF16) and (m <= 3 or wide_ok)), \
                        (n, k, fmt, m)
                    if not form.get("dp4a"):
                        continue
                    spec = QGemvSpec(m, n, k, fmt, group, DType.BF16, DType.F16, norm=norm,
                                     glu="silu" if glu and m <= 3 else "", **form)
                    pending.append(((n, k, fmt, m, norm), K.build_async(spec, arch)))
    for what, p in pending:
        ck = p.result()
        assert ck.template == "qgemv_dp4a.cu.jinja" and ck.binary.spill_bytes == 0, what


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_dp4a_form_at_4_and_8_rows_compiles_without_spills_in_every_format(arch, monkeypatch):
    """FUSEC_QGEMV_FORM=dp4a gives every product at 4 and 8 rows of x the dp4a form (the tensor-core form takes them
    otherwise): 4 weight rows a task only for 8-bit codes with a constant zero point, one row and 2 chunks for the
    rest, and none of them spills (4 rows a task had spilled 92-2,472 bytes in every format under 8 bits)."""
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "dp4a")
    pending = []
    for fmt in FORMATS:
        group = FORMATS[fmt].group or 128
        for m in (4, 8):
            form = gemv_form(m, 16384, 2048, fmt, group, DType.BF16)
            four = FORMATS[fmt].bits == 8 and FORMATS[fmt].zero is not None
            assert form.get("dp4a") and (form["rows"], form["chunks"]) == ((4, 4) if four else (1, 2)), (fmt, m)
            spec = QGemvSpec(m, 16384, 2048, fmt, group, DType.BF16, DType.F16, **form)
            pending.append(((fmt, m), K.build_async(spec, arch)))
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_dp4a_norm_forms_at_one_row_load_what_fits_in_registers(arch):
    """At one row of x with the norm prologue (and a gated unit), K = 4096, 5120 (Llama-2-13B), 6656 (a thread holds
    4 of x's pieces) and 8192, every format: the rule's dp4a form compiles without register spills, and it loads 8
    chunks a round except where 8 spill (``dp4a_heavy``): fusec's int4 takes 8 at the 7B shape (it took 4, half the
    loads in flight), Q8_0 and Q5_K take 4 from K = 5120, Q4_K from 6656."""
    from fusec.lower.qgemv_form import dp4a_heavy

    pending = []
    for fmt in FORMATS:
        group = FORMATS[fmt].group or 128
        for k, n in ((4096, 22016), (5120, 27648), (6656, 35840), (8192, 28672)):
            if k % (FORMATS[fmt].super_block or group):
                continue
            for glu in (False, True):
                form = gemv_form(1, n, k, fmt, group, DType.BF16, True, glu)
                assert form.get("dp4a") and form["chunks"] == (4 if dp4a_heavy(fmt, k, True) else 8), (fmt, k, glu)
                spec = QGemvSpec(1, n, k, fmt, group, DType.BF16, DType.F16, norm=True, glu="silu" if glu else "",
                                 **form)
                pending.append(((fmt, k, glu), K.build_async(spec, arch)))
    assert not dp4a_heavy("uint4", 4096, True) and dp4a_heavy("q4_k", 8192, True) and dp4a_heavy("q6_k", 4096, True)
    assert dp4a_heavy("q8_0", 5120, True) and dp4a_heavy("q5_k", 5120, True) and not dp4a_heavy("q4_k", 6144, True)
    assert dp4a_heavy("q4_k", 6656, True) and not dp4a_heavy("q4_0", 16384, True) and not dp4a_heavy("q8_0", 4096, True)
    assert dp4a_heavy("q4_k", 5120, True, siblings=True) and not dp4a_heavy("q4_k", 4096, True, siblings=True)
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what


def _byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA's __byte_perm: byte n of the result is byte (sel >> 4n) & 7 of the 8 bytes y:x."""
    b = (x | (y << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(b[(sel >> (4 * n)) & 7] for n in range(4)), "little")


def test_byte_digits_are_the_integer_the_reference_rounds():
    """The dp4a form's digits of x (templates/qgemv_dp4a_x.jinja), emulated in numpy: one FMA of x and
    iq = fl(fl(1 / max|x|) * 32767) with 1.5 * 2^23 (the exact product rounded once, ties to even) leaves xq in its
    float's low bits; the byte permutes gather a signed high and an unsigned low digit, 256 x1 + x0 = xq, |xq| <= 32767;
    the bits' sum less 8 x 0x4B400000 is the sum of xq; and fusec.quant.dp4a_blocks gives d * xq. Over blocks of
    every magnitude and at ties."""
    rng = np.random.default_rng(11)
    f32 = np.float32
    for trial in range(300):
        v = (rng.standard_normal(32) * f32(10.0 ** rng.uniform(-30, 30))).astype(f32)
        if trial % 2:  # ties of the rounding
            amax = np.abs(v).max()
            v[:8] = ((np.round(rng.uniform(-32000, 32000, 8)) + 0.5) * (amax / 32767)).astype(f32)
        amax = np.abs(v).max()
        iq = ((f32(1) / amax).astype(f32) * f32(32767)).astype(f32)
        fma = (v.astype(np.float64) * np.float64(iq) + 12582912.0).astype(f32)  # exact in float64, rounded once
        bits = fma.view(np.uint32).astype(np.int64)
        xq = bits - 0x4B400000
        assert np.array_equal(xq, np.rint(v.astype(np.float64) * np.float64(iq)).astype(np.int64)), trial
        assert np.abs(xq).max() <= 32767, trial
        for h in range(8):  # each word: four values' low digits, and their high digits
            b = [int(t) for t in bits[4 * h:4 * h + 4]]
            lo, hi = _byte_perm(b[0], b[1], 0x5140), _byte_perm(b[2], b[3], 0x5140)
            x0 = np.frombuffer(_byte_perm(lo, hi, 0x5410).to_bytes(4, "little"), np.uint8).astype(np.int64)
            x1 = np.frombuffer(_byte_perm(lo, hi, 0x7632).to_bytes(4, "little"), np.int8).astype(np.int64)
            assert np.array_equal(256 * x1 + x0, xq[4 * h:4 * h + 4]), (trial, h)
        piece = int((bits[:8].sum() - 8 * 0x4B400000) % 2 ** 32)
        assert (piece - 2 ** 32 if piece >= 2 ** 31 else piece) == xq[:8].sum(), trial
        d = f32(amax * f32(1 / 32767))
        assert np.array_equal(quant.dp4a_blocks(v), (xq.astype(f32) * d).astype(f32)), trial
    assert np.array_equal(quant.dp4a_blocks(np.zeros(32, f32)), np.zeros(32, f32))  # a block of zeros: no unit


def test_dp4a_blocks_represent_x_within_half_a_step():
    """dp4a_blocks keeps every value within half its block's step, max|x| / 32767, of x (a step that kept a real model's
    answers, where max|x| / 127 did not), over values spread across many magnitudes."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 256)) * np.exp(rng.uniform(-8, 8, (4, 256)))).astype(np.float32)
    amax = np.repeat(np.abs(x.reshape(4, 8, 32)).max(-1), 32, axis=-1).reshape(4, 256)
    err = np.abs(quant.dp4a_blocks(x) - x)
    assert (err <= amax / 32767 * 0.5 * 1.001).all()
    assert (err > 0).any()  # the blocks' small values are rounded


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dp4a_rounds_by_an_add_and_compiles_for_both_archs(arch, monkeypatch):
    """The dp4a form rounds x's digits with an add of 1.5 * 2^23 (no rintf); it compiles without spills at the
    Llama-1B gate/up (norm + gated unit) and down shapes at 1 row of x and Q8_0's qkv at 8 (the rule without the
    tensor-core form), a bf16 norm rounding two values at a time and an fp16 one a value at a time."""
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "dp4a")
    for fmt, m, n, k, norm, glu, dt in (("q4_k", 1, 16384, 2048, True, True, DType.BF16),
                                        ("q6_k", 1, 2048, 8192, False, False, DType.BF16),
                                        ("q8_0", 8, 3072, 2048, True, False, DType.BF16),
                                        ("q4_k", 1, 3072, 2048, True, False, DType.F16)):
        form = gemv_form(m, n, k, fmt, FORMATS[fmt].group, dt, norm, glu)
        assert form["dp4a"]
        ck = K.build(QGemvSpec(m, n, k, fmt, FORMATS[fmt].group, dt, DType.F16, norm=norm,
                               glu="silu" if glu else "", **form), arch)
        assert ck.binary.spill_bytes == 0 and "0x4B400000" in ck.source and "rintf(__fmul_rn" not in ck.source, (fmt, m)
        # the norm's roundings two at a time in bf16
        assert ("fc_round_bf16x2(n0, n1)" in ck.source) == (norm and dt == DType.BF16), (fmt, m)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dp4a_norm_weights_load_before_the_wait(arch, monkeypatch):
    """With the norm prologue and x one batch of a thread's pieces (M K <= 8192), the rule's dp4a kernels load the
    norm's weights before the PDL wait (in the source, before the wait), on the Llama-1B and 7B norm shapes at 1-3
    rows of x, without spills; FUSEC_QGEMV_DP4A_NORM_EARLY=0 loads them after it."""
    pending = []
    for fmt in ("q4_k", "q6_k", "q8_0", "q4_0"):
        for m in (1, 2, 3):
            for n, k, glu in ((3072, 2048, False), (16384, 2048, True), (6144, 4096, False), (22016, 4096, True)):
                f = gemv_form(m, n, k, fmt, FORMATS[fmt].group, DType.BF16, True, glu)
                assert f["dp4a"] and f["norm_early"], (fmt, m, n, k)
                spec = QGemvSpec(m, n, k, fmt, FORMATS[fmt].group, DType.BF16, DType.F16, norm=True,
                                 glu="silu" if glu else "", **f)
                pending.append(((fmt, m, n, k), K.build_async(spec, arch)))
    for what, p in pending:
        ck = p.result()
        assert ck.binary.spill_bytes == 0, what
        src = ck.source
        assert "gpre[j] = *" in src and src.index("gpre[j] = *") < src.index("fc_pdl_wait_after(dep)"), what
        assert "XP <= XB ? gpre[j]" in src, what  # used where x is one batch (XP <= XB), else loaded beside x
    assert not gemv_form(1, 3072, 2048, "q4_k", 32, DType.BF16)["norm_early"]  # no norm: nothing to load early
    with pytest.raises(ValueError, match="norm_early"):
        QGemvSpec(1, 3072, 2048, "q4_k", 32, DType.BF16, DType.F16, rows=2, dp4a=True, chunks=8, norm_early=True)
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_NORM_EARLY", "0")
    f = gemv_form(1, 3072, 2048, "q4_k", 32, DType.BF16, True)
    assert not f["norm_early"]
    assert "gpre" not in K.build(QGemvSpec(1, 3072, 2048, "q4_k", 32, DType.BF16, DType.F16, norm=True, **f), arch).source


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dp4a_fill_gives_short_rows_four_a_task(arch, monkeypatch):
    """The rule (FUSEC_QGEMV_DP4A_FILL on by default): at one row of x, K = 2048 (a lane takes 2 of a row's chunks a round), products with a
    task for every warp take 4 weight rows a task (gated: two pairs), so a round is 8 chunks a lane; not with too few
    tasks (Llama-1B's qkv), not where 2 rows already fill the round (K = 4096), not a gated unit beside the norm over
    6-bit codes (it spilled), not with FUSEC_QGEMV_DP4A_FILL=0. The filled forms compile without spills."""
    from fusec.codegen.spec_base import SMS

    pending = []
    for fmt in FORMATS:
        g = FORMATS[fmt].group or 128
        for n, k, norm, glu in ((16384, 2048, True, True), (128256, 2048, True, False), (3072, 2048, True, False),
                                (22016, 4096, True, True)):
            f = gemv_form(1, n, k, fmt, g, DType.BF16, norm, glu)
            tasks = n // 2 // 2 if glu else n // 4
            want = 4 if k == 2048 and tasks >= 16 * SMS and not (glu and FORMATS[fmt].bits == 6) else 2
            if not (glu or k < 8 * 1024):
                want = 1
            assert f["rows"] == want, (fmt, n, k, f)
            if want == 4:
                assert gemv_form(2, n, k, fmt, g, DType.BF16, norm, glu)["rows"] == 2  # one row of x only
                pending.append(((fmt, n, k), K.build_async(QGemvSpec(1, n, k, fmt, g, DType.BF16, DType.F16, norm=norm,
                                                                     glu="silu" if glu else "", **f), arch)))
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_FILL", "0")
    assert gemv_form(1, 16384, 2048, "q4_k", 32, DType.BF16, True, True)["rows"] == 2


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dp4a_fill_gives_long_rows_two_a_task_where_fewer_round_trips(arch, monkeypatch):
    """The rule (FUSEC_QGEMV_DP4A_FILL): at one row of x a row of K >= 8192 takes one row a task at 8 chunks a round,
    unless two rows at 4 chunks each make a warp fewer round trips (its tasks times a task's rounds): the 7B downs
    (N 4096, K 11,008: two tasks of two rounds against one task of three) but not Llama-1B's down (N 2048, K 8192: one
    task of one round against one of two), nor N 4096 at K 8192 (2 x 1 against 1 x 2). Those forms compile without
    spills. FUSEC_QGEMV_DP4A_FILL=0: one row."""
    from fusec.codegen.spec_base import SMS

    pending = []
    for fmt in FORMATS:
        g = FORMATS[fmt].group or 128
        for n, k in ((4096, 11008), (2048, 8192), (4096, 8192), (3 * 2 * 8 * SMS, 11008)):
            f = gemv_form(1, n, k, fmt, g, DType.BF16)
            # 4096 x 11008: 2 tasks of 2 rounds a warp, or 1 of 3; 6336 x 11008: 3 tasks of 2 rounds, or 2 of 3
            assert f["rows"] == (2 if (n, k) == (4096, 11008) else 1), (fmt, n, k, f)
            assert f["chunks"] == 8
            if f["rows"] == 2:
                pending.append(((fmt, n, k), K.build_async(QGemvSpec(1, n, k, fmt, g, DType.BF16, DType.F16, **f), arch)))
    assert len(pending) == len(FORMATS)
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_FILL", "0")
    assert gemv_form(1, 4096, 11008, "q4_k", 32, DType.BF16)["rows"] == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dp4a_cluster_knob_and_grid(arch, monkeypatch):
    """The rule (FUSEC_QGEMV_DP4A_CLUSTER=auto): clusters of 2 for the dp4a form at 4-8 rows of x and at one row without
    the norm prologue, none with it at one row nor at 2-3 rows, nor for the tensor-core or FMA forms; ``gated`` adds the
    gated product with the norm at one row; the knob's number everywhere on the dp4a form. The grid is whole clusters (at
    least one, where a product has fewer tasks than a cluster's warps); the kernel declares the cluster only on sm_90
    (sm_80 has none: the same kernel writes every digit in every block) and compiles without spills on the 7B down and
    gate/up shapes. A spec takes 1, 2 or 4, and only on the dp4a form. (8-bit codes at 4-8 rows take the dp4a form
    without the tensor-core form: FUSEC_QGEMV_FORM=dp4a.)"""
    from fusec.codegen.spec_base import SMS

    assert "cluster" not in gemv_form(8, 2048, 2048, "q8_0", 32, DType.BF16)  # the rule's tensor-core form
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "dp4a")
    assert gemv_form(1, 4096, 11008, "q4_k", 32, DType.BF16)["cluster"] == 2
    assert "cluster" not in gemv_form(1, 22016, 4096, "q4_k", 32, DType.BF16, True, True)
    assert "cluster" not in gemv_form(2, 4096, 11008, "q4_k", 32, DType.BF16)
    assert gemv_form(8, 2048, 2048, "q8_0", 32, DType.BF16)["cluster"] == 2
    assert gemv_form(4, 2048, 2048, "q8_0", 32, DType.BF16)["cluster"] == 2
    assert "cluster" not in gemv_form(3, 2048, 2048, "q8_0", 32, DType.BF16)
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_CLUSTER", "gated")  # the rule, and the gated product with the norm
    assert gemv_form(1, 22016, 4096, "q4_k", 32, DType.BF16, True, True)["cluster"] == 2
    assert "cluster" not in gemv_form(1, 12288, 4096, "q4_k", 32, DType.BF16, True, False)
    assert gemv_form(1, 4096, 11008, "q4_k", 32, DType.BF16)["cluster"] == 2
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_CLUSTER", "1")
    assert "cluster" not in gemv_form(8, 2048, 2048, "q8_0", 32, DType.BF16)
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_CLUSTER", "4")
    assert gemv_form(1, 4096, 11008, "q4_k", 32, DType.BF16)["cluster"] == 4
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "auto")
    assert "cluster" not in gemv_form(8, 4096, 2048, "q4_k", 32, DType.BF16)  # tensor cores
    assert "cluster" not in gemv_form(1, 4096, 2048, "q4_k", 32, DType.F32)  # FMA
    for n, k, norm, glu, cl in ((4096, 11008, False, False, 4), (22016, 4096, True, True, 2), (24, 2048, False, False, 4)):
        f = {**gemv_form(1, n, k, "q4_k", 32, DType.BF16, norm, glu), "cluster": cl}
        spec = QGemvSpec(1, n, k, "q4_k", 32, DType.BF16, DType.F16, norm=norm, glu="silu" if glu else "", **f)
        r, src = K.prepare(spec)
        assert r.grid[0] % cl == 0 and r.grid[0] <= max(cl, f["blocks"] * SMS), (n, k, r.grid)
        assert f"> 1\n#define CL_ {cl}" in src and "__cluster_dims__(CL_, 1, 1)" in src
        b = K.build(spec, arch)
        assert b.binary.spill_bytes == 0, (n, k, cl)
        if not norm:  # the cluster's barrier replaces the block's (ptxas counts block barriers): sm_90 only
            assert ("used 0 barriers" in b.binary.log) == (arch == "sm_90"), (n, k, arch, b.binary.log)
    for bad in ({"cluster": 8, "dp4a": True, "rows": 2, "warps": 8}, {"cluster": 2}):
        with pytest.raises(ValueError, match="cluster"):
            QGemvSpec(1, 4096, 2048, "q4_k", 32, DType.BF16, DType.F16, **bad)


LLAMA_SHAPES_1B_NORM = [(3072, 2048, True), (2048, 2048, False), (2048, 8192, False), (128256, 2048, True)]  # qkv, o, down, head


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dp4a_wide_rows_four(arch, monkeypatch):
    """The rule (FUSEC_QGEMV_DP4A_WIDE_ROWS=4 by default): at 4-8 rows of x the dp4a form takes 4 weight rows a
    task, one chunk a round each, for 8-bit codes without zero-point operands (uint8 spilled: it keeps one row); the
    Llama-1B shapes where it fits compile without spills. FUSEC_QGEMV_DP4A_WIDE_ROWS=1: one row, 2 chunks. (There 8-bit
    codes take the dp4a form without the tensor-core form: FUSEC_QGEMV_FORM=dp4a.)"""
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "dp4a")
    pending = []
    for fmt in ("q8_0", "int8", "uint8"):
        g = FORMATS[fmt].group or 128
        for m in (4, 8):
            for n, k, norm in LLAMA_SHAPES_1B_NORM:
                f = gemv_form(m, n, k, fmt, g, DType.BF16, norm)
                if not f.get("dp4a"):
                    continue
                assert (f["rows"], f["chunks"]) == ((1, 2) if fmt == "uint8" else (4, 4)), (fmt, m, n, k)
                spec = QGemvSpec(m, n, k, fmt, g, DType.BF16, DType.F16, norm=norm, **f)
                pending.append(((fmt, m, n, k), K.build_async(spec, arch)))
    assert len(pending) >= 12
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what
    assert gemv_form(1, 3072, 2048, "q8_0", 32, DType.BF16, True)["rows"] == 2  # one row of x: unchanged
    monkeypatch.setenv("FUSEC_QGEMV_DP4A_WIDE_ROWS", "1")
    for m in (4, 8):
        f = gemv_form(m, 3072, 2048, "q8_0", 32, DType.BF16, True)
        assert (f["rows"], f["chunks"]) == (1, 2), f


def test_dp4a_form_refuses_what_it_cannot_take():
    for m, dt, k, warps in ((9, DType.BF16, 2048, 8), (1, DType.F32, 2048, 8), (4, DType.BF16, 16384, 8),
                            (1, DType.BF16, 2048, 2), (1, DType.BF16, 2048, 17)):  # 17: one block an SM only
        with pytest.raises(ValueError, match="dp4a"):
            QGemvSpec(m, 64, k, "q4_k", 32, dt, DType.F16, dp4a=True, warps=warps)
    with pytest.raises(ValueError, match="one form"):
        QGemvSpec(2, 64, 2048, "q4_k", 32, DType.BF16, DType.F16, dp4a=True, tc=True)


def test_tensor_core_form_refuses_what_it_cannot_take():
    for m, fmt, dt, warps in ((16, "q4_k", DType.F32, 8), (9, "int8", DType.F32, 8), (1, "q8_0", DType.F32, 8),
                              (1, "q4_0", DType.F32, 8), (1, "q4_0", DType.BF16, 2)):
        with pytest.raises(ValueError, match="tensor-core"):
            QGemvSpec(m, 64, 256, fmt, FORMATS[fmt].group or 32, dt, DType.F16, tc=True, warps=warps)


def test_specs_refuse_bad_layouts():
    with pytest.raises(ValueError, match="M <= 16"):
        QGemvSpec(17, 8, 256, "q4_k", 32, DType.BF16)
    with pytest.raises(ValueError, match="K=208 must be a multiple of 32"):
        QGemvSpec(1, 8, 208, "int8", 16, DType.BF16)
    with pytest.raises(ValueError, match="rows outside the weight"):
        QDequantSpec(8, 256, "q4_k", 32, DType.BF16, row0=4, rows=8)


def _qgraph(m: int, epilogue: bool, fmt: str = "q4_k"):
    from fusec.builder import GraphBuilder
    from fusec.ops import Op

    rng = np.random.default_rng(6)
    qw = sample_weight(fmt, 96, 512, rng)
    b = GraphBuilder("q")
    x = b.input("x", (m, 512), DType.F32)
    cs = [b.const(a, name=f"w.{r}") for r, a in zip(qw.roles, qw.arrays)]
    y = b.emit(Op.QMATMUL, x, *cs, format=fmt, n=96, k=512, group=qw.group)
    if epilogue:
        y = b.emit(Op.ADD, b.emit(Op.SILU, b.emit(Op.ADD, y, b.const(rng.standard_normal(96).astype(np.float32)))),
                   b.input("res", (m, 96), DType.F32))
    b.output(y, "y")
    return b.build()


def test_lowering_picks_the_gemv_for_decode_and_the_tile_gemm_or_scratch_for_prefill(monkeypatch):
    """Decode rows: the quantized GEMV. Prefill rows: the rule's path (64 rows of this narrow product: scratch);
    FUSEC_QGEMM=tile: the dequantize-in-tile GEMM with the epilogue fused, one launch and no scratch; the scratch
    path (and fp32 x, which the mma does not take, even with FUSEC_QGEMM=tile): the weight dequantized into arena
    scratch, cuBLAS, the epilogue apart."""
    from fusec.compiler import stage

    dec = stage(_qgraph(4, epilogue=True), "bf16", "sm_90", dry_run=True)
    by = dec.lowered.report["by_template"]
    assert by.get("qmatmul:qgemv") == 1 and "cublas_gemm" not in by and dec.lowered.report["launches"] == 1
    monkeypatch.setenv("FUSEC_QGEMM", "tile")
    tile = stage(_qgraph(64, epilogue=True), "bf16", "sm_90", dry_run=True)
    by = tile.lowered.report["by_template"]
    assert by.get("qmatmul:qgemm") == 1 and "cublas_gemm" not in by and "qdequant" not in by, by
    assert tile.lowered.report["launches"] == 1 and tile.lowered.scratch_bytes < 96 * 512 * 2
    import fusec

    for arch, tiling in (("sm_80", ""), ("sm_90", ""), ("sm_90", "8,4,1,4")):  # the whole plan, its kernel sources
        monkeypatch.setenv("FUSEC_QGEMM_TILE", tiling)  # checked as a plan file's are (a cluster's too)
        plan = fusec.compile(_qgraph(64, epilogue=True), dtype="bf16", arch=arch)
        assert [L.get("label", "").split()[-1] for L in plan.manifest["launches"]] == ["qgemm"]
        assert plan.manifest["launches"][0]["grid"][2] == (4 if tiling else 1)  # z: a cluster's blocks
    monkeypatch.delenv("FUSEC_QGEMM_TILE")
    for dtype, knob in (("bf16", "auto"), ("bf16", "scratch"), ("fp32", "tile")):
        monkeypatch.setenv("FUSEC_QGEMM", knob)
        pre = stage(_qgraph(64, epilogue=True), dtype, "sm_90", dry_run=True)
        by = pre.lowered.report["by_template"]
        assert by.get("qmatmul:dequant_gemm") == 1 and by.get("cublas_gemm") == 1 and by.get("qdequant") == 1, by
        assert pre.lowered.scratch_bytes >= 96 * 512 * 2  # the dequantized weight lives in arena scratch
        assert "qmatmul:qgemm" not in by


def test_the_rule_gives_the_tile_gemm_short_prefills_of_wide_products(monkeypatch):
    """The rule (fusec.lower.quant.tile_wins): the dequantize-in-tile GEMM at up to 32 rows for products of at least 64
    weight rows an SM (Llama-1B's gate/up, the 7B's), with or without clusters; the scratch path for the narrower ones
    (qkv, o, down) and past 32 rows; FUSEC_QGEMM=tile and scratch override it."""
    from fusec.lower.quant import choose

    for clusters in (False, True):
        assert choose(32, 16384, 2048, "q4_k", 32, DType.BF16, clusters) == "qgemm"
        assert choose(24, 22016, 4096, "q4_k", 32, DType.F16, clusters) == "qgemm"
        for n, k in ((3072, 2048), (2048, 2048), (2048, 8192)):
            assert choose(32, n, k, "q4_k", 32, DType.BF16, clusters) == "dequant_gemm", (n, k)
    assert choose(33, 16384, 2048, "q4_k", 32, DType.BF16) == "dequant_gemm"
    assert choose(128, 16384, 2048, "q4_k", 32, DType.BF16) == "dequant_gemm"
    assert choose(8, 16384, 2048, "q4_k", 32, DType.BF16) == "qgemv"
    assert choose(16, 16384, 2048, "q4_k", 32, DType.BF16) == "qgemv"  # the tensor-core form, past 8 rows
    assert choose(16, 16384, 2048, "q4_k", 32, DType.F32) == "dequant_gemm"  # it takes fp16/bf16
    monkeypatch.setenv("FUSEC_QGEMV_MAX_ROWS", "8")
    assert choose(16, 16384, 2048, "q4_k", 32, DType.BF16) == "qgemm"
    monkeypatch.delenv("FUSEC_QGEMV_MAX_ROWS")
    monkeypatch.setenv("FUSEC_QGEMM", "tile")
    assert choose(128, 2048, 8192, "q6_k", 16, DType.BF16) == "qgemm"
    assert choose(128, 2048, 8192, "q6_k", 16, DType.F32) == "dequant_gemm"  # the mma takes fp16/bf16
    monkeypatch.setenv("FUSEC_QGEMM", "scratch")
    assert choose(32, 16384, 2048, "q4_k", 32, DType.BF16) == "dequant_gemm"


def test_a_prefills_packed_product_is_a_kernel_choice_the_ab_measures():
    """A prefill's packed product (with its epilogue) is a choice point keyed by dtype, format, group, shape and
    epilogue: the rule's way first, the other for the A/B (fusec.ab's candidates list it); an explicit choice takes
    either way and the lowering report says it applied; an unknown variant is declined, naming the key; decode rows
    and fp32 x have no such point."""
    import fusec
    from fusec.ab import regions as R
    from fusec.lower.choices import choice_point

    pre, cands = R.candidates(_qgraph(64, epilogue=True), "bf16")
    mine = [c for c in cands if c.kind == "kernel_choice" and c.key.startswith("qmatmul:")]
    assert [c.variant for c in mine] == ["qgemm"] and mine[0].key == "qmatmul:bf16:q4_k:g32:64x96x512:bias+silu+res"
    key = mine[0].key
    for variant, last in (("qgemm", "qgemm"), ("dequant_gemm", "epilogue")):
        p = fusec.compile(_qgraph(64, epilogue=True), dtype="bf16", arch="sm_90", choices={key: variant})
        assert p.manifest["report"]["lowering"]["choices"]["applied"] == {key: variant}
        assert p.manifest["launches"][-1]["label"].split()[-1] == last
    bad = fusec.compile(_qgraph(64, epilogue=True), dtype="bf16", arch="sm_90", choices={key: "gemv"})
    assert "gemv" in bad.manifest["report"]["lowering"]["choices"]["declined"][key]
    from fusec.compiler import stage

    for m, dtype in ((4, "bf16"), (64, "fp32")):
        st = stage(_qgraph(m, epilogue=True), dtype, "sm_90", dry_run=True)
        assert not any(choice_point(n) for n in st.graph.nodes), (m, dtype)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_tile_gemm_compiles_for_every_format(fmt):
    """The dequantize-in-tile GEMM in every format: bf16 on sm_80 and fp16 with bias, SiLU and residual on sm_90, at
    odd M and N, a K whose 64-wide tiles do not divide evenly among the K warps; it dequantizes with the prefill's
    own quant.cuh loads and rounding (qb_load, qb_w8) and loads the weights before its PDL wait."""
    from fusec.codegen.specs_quant import QGemmSpec

    group = FORMATS[fmt].group or 64
    k = 1280 if FORMATS[fmt].super_block else 320
    K.build(QGemmSpec(45, 77, k, fmt, group, DType.BF16, DType.F16, mt=6, rw=1, kw=4), "sm_80")
    src = K.build(QGemmSpec(130, 77, k, fmt, group, DType.F16, DType.F16, Epilogue(True, "silu", True), mt=16,
                            rw=2, kw=2), "sm_90").source
    body = src.split('extern "C"')[1]
    assert "qb_w8" in src and "qb_load" in src and "fc_ldsm_b_nk2" in src
    assert body.index("qg_load(pr, row_live, sl + SL * d") < body.index("fc_pdl_wait()") < body.index("qg_copy_x")


def test_the_tile_gemm_spec_refuses_what_it_cannot_run():
    from fusec.codegen.specs_quant import QGemmSpec

    for bad, what in ((dict(K=544), "multiple of 64"), (dict(dtype=DType.F32), "fp16/bf16"), (dict(mt=17), "mt"),
                      (dict(rw=4, kw=4), "at most 8 warps"), (dict(rw=3), "rw and kw"),
                      (dict(mt=16, rw=2, kw=4), "shared memory")):
        args = dict(M=40, N=64, K=512, fmt="q8_0", group=32, dtype=DType.BF16) | bad
        with pytest.raises(ValueError, match=what):
            QGemmSpec(**args)


def test_the_tile_gemm_tiling_rule(monkeypatch):
    """All of x's rows in one block up to 64. Warps over weight rows while the grid keeps two blocks an SM, else over
    K, shared memory within QGEMM_SMEM_MAX; with clusters (sm_90), where blocks of 64 weight rows number at least the
    SMs, 64 rows a block and K over clusters of 2 where that makes two blocks an SM. FUSEC_QGEMM_TILE overrides it;
    text that is not integers is refused, naming the variable."""
    from fusec.codegen.spec_base import SMS
    from fusec.codegen.specs_quant import QGemmSpec
    from fusec.errors import InputError
    from fusec.lower.quant import QGEMM_SMEM_MAX, qgemm_tiling

    for m in (17, 32, 100, 128, 512):
        for n, k in LLAMA_SHAPES:
            for clusters in (False, True):
                t = qgemm_tiling(m, n, k, clusters)
                assert 8 * t["mt"] >= min(m, 64) and t["rw"] * t["kw"] <= 4
                ys = -(-m // (8 * t["mt"]))
                blocks = -(-n // (16 * t["rw"])) * ys * t["ks"]
                if t["ks"] > 1:
                    assert clusters and t["ks"] == 2 and t["rw"] == 4 and t["kw"] == 1, (m, n, k, t)
                    assert SMS <= blocks // 2 < 2 * SMS <= blocks, (m, n, k, t)  # clusters of 2 make the second wave
                else:
                    assert blocks >= 2 * SMS or t["rw"] == 1, (m, n, k, t)
                assert QGemmSpec(m, n, k, "q4_k", 32, DType.BF16, **t).smem <= QGEMM_SMEM_MAX
    assert {k: v for k, v in qgemm_tiling(32, 2048, 8192).items() if k in "mt rw kw"} == {"mt": 4, "rw": 1, "kw": 4}
    assert qgemm_tiling(32, 22016, 4096)["rw"] == 4  # 344 blocks of 64 rows
    assert qgemm_tiling(32, 16384, 2048)["rw"] == 2  # 256 of 64 would be under two an SM: 512 of 32
    assert qgemm_tiling(32, 2048, 8192, clusters=True) == qgemm_tiling(32, 2048, 8192)  # 32 blocks of 64 rows: no
    assert qgemm_tiling(32, 16384, 2048, clusters=True)["ks"] == 2  # 256 blocks of 64 rows: 512 in clusters of 2
    assert qgemm_tiling(32, 22016, 4096, clusters=True)["ks"] == 1  # 344 already
    monkeypatch.setenv("FUSEC_QGEMM_TILE", "8,2,2,1,3")
    assert qgemm_tiling(32, 2048, 8192) == {"mt": 8, "rw": 2, "kw": 2, "ks": 1, "blocks": 3}
    for bad in ("8,2", "8,2,x", "17,1,1", "16,2,4"):  # not integers; mt over 16; x's ring over the shared memory
        monkeypatch.setenv("FUSEC_QGEMM_TILE", bad)
        with pytest.raises(InputError, match="FUSEC_QGEMM_TILE"):
            qgemm_tiling(32, 2048, 8192)


def test_the_tile_gemm_splits_k_over_a_cluster_on_sm_90_only():
    """ks > 1: the grid's z is the cluster's blocks (__cluster_dims__ on sm_90), which add their partial sums through
    distributed shared memory and wait for each other before leaving; for sm_80 such a spec does not compile, and the
    rule gives it none there."""
    from fusec.codegen.compile import KernelCompileError
    from fusec.codegen.specs_quant import QGemmSpec

    spec = QGemmSpec(45, 77, 1280, "q6_k", 16, DType.BF16, DType.F16, Epilogue(True, "silu", True), mt=6, rw=4,
                     kw=1, ks=4)
    ck = K.build(spec, "sm_90")
    assert ck.grid == (2, 1, 4) and "__cluster_dims__(1, 1, KS_)" in ck.source
    body = ck.source.split('extern "C"')[1]
    assert body.count("fc_cluster_sync()") == 2 and "ld.shared::cluster" in ck.source
    with pytest.raises(KernelCompileError, match="needs sm_90"):
        K.build(spec, "sm_80")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_the_tile_gemm_tilings_the_rule_picks_do_not_spill(arch):
    """At 32 and 512 rows of bf16 x, the rule's tiling of every Llama-1B and 7B product in Q4_K, Q6_K and Q8_0
    (clusters on sm_90) compiles without register spills (ptxas -v through NVRTC)."""
    from fusec.codegen.specs_quant import QGemmSpec
    from fusec.lower.quant import qgemm_tiling

    pending = []
    for m in (32, 512):
        for n, k in LLAMA_SHAPES:
            for fmt, group in (("q4_k", 32), ("q6_k", 16), ("q8_0", 32)):
                spec = QGemmSpec(m, n, k, fmt, group, DType.BF16, DType.F16,
                                 **qgemm_tiling(m, n, k, clusters=arch == "sm_90"))
                pending.append(((m, n, k, fmt), K.build_async(spec, arch)))
    for what, p in pending:
        assert p.result().binary.spill_bytes == 0, what


def test_prefill_dequantizes_large_weights_a_block_of_rows_at_a_time(monkeypatch):
    from fusec.compiler import stage
    from fusec.lower import quant_emit as LQ

    monkeypatch.setattr(LQ, "SCRATCH_BYTES", 32 * 512 * 2)  # 32 rows of the bf16 [96, 512] weight
    monkeypatch.setenv("FUSEC_QGEMM", "scratch")
    st = stage(_qgraph(64, epilogue=False), "bf16", "sm_90")
    gemms = [L for L in st.lowered.launches if L["type"] == "gemm"]
    assert [g["n"] for g in gemms] == [32, 32, 32] and all(g["ldc"] == 96 for g in gemms)
    assert [g["c"][1] - gemms[0]["c"][1] for g in gemms] == [0, 64, 128]  # columns 0, 32, 64 (2 bytes each)
    assert st.lowered.scratch_bytes == 32 * 512 * 2


def _packed_decode_launches(dtype: str, batch: int = 1, **kw) -> list[dict]:  # noqa: ANN003
    import dataclasses as dc

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomPackedWeights, q4_k_m_types

    cfg = dc.replace(get_config("llama-tiny"), hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
                     head_dim=64, num_layers=2, tie_word_embeddings=False, name="llama-q4km-head")
    gm = GenModel(cfg, SharedWeights(RandomPackedWeights(q4_k_m_types(2), seed=1, scale=0.02)), None, (), cfg.name)
    plan = compile_generation(gm, batch=batch, max_seq_len=64, prefill_len=8, dtype=dtype, eos_ids=[], arch="sm_90",
                              **kw)
    return plan.manifest["entries"]["decode"]["launches"]


def test_a_packed_lm_head_samples_from_its_argmax_partials():
    """In bf16 at batch 1 the packed LM head (the dp4a form) writes its warps' argmax partials and the sampler merges
    them (``gemm_sample``): no sampler of its own reads the logits, and the sampler depends on the product. The fp32
    plan (the FMA form: no partials) and a plan without the rule keep the separate sampler."""
    from fusec.program import Task, dependencies

    launches = _packed_decode_launches("bf16")
    labels = [L["label"] for L in launches]
    head = next(i for i, lab in enumerate(labels) if "qgemv+sample scores" in lab)
    apart = lambda labs: [lab for lab in labs if "sample" in lab and "gemm_sample" not in lab]  # noqa: E731
    assert "gemm_sample" in labels[head] and not apart(labels), labels
    sampler = next(i for i, lab in enumerate(labels) if lab.endswith(" sample") and i > head)
    assert head in dependencies([Task.from_json(L) for L in launches])[sampler]
    for kw in ({"dtype": "fp32"}, {"dtype": "bf16", "disabled_fusions": ("gemm_sample",)}):
        labels = [L["label"] for L in _packed_decode_launches(**kw)]
        assert apart(labels) and not any("sample scores" in lab for lab in labels), (kw, labels)


def test_argmax_partials_are_the_dp4a_forms_without_a_gated_unit():
    """QGemvSpec's argmax: the dp4a form's alone (the FMA and tensor-core forms write no partials), not with a gated
    unit; one pair a warp of the grid; it compiles without spills at the LM heads' shapes (Llama-1B's 128,256 x 2048
    in Q6_K, the 7B's 32,000 x 4096 in Q4_K) at 1-3 rows of x, sm_80 and sm_90."""
    with pytest.raises(ValueError, match="argmax"):
        QGemvSpec(1, 4096, 2048, "q4_k", 32, DType.BF16, DType.F16, argmax=True)
    with pytest.raises(ValueError, match="argmax"):
        QGemvSpec(1, 4096, 2048, "q4_k", 32, DType.BF16, DType.F16, argmax=True, dp4a=True, glu="silu")
    pending = []
    for arch in ("sm_80", "sm_90"):
        for n, k, fmt, group in ((128256, 2048, "q6_k", 16), (32000, 4096, "q4_k", 32)):
            for m in (1, 2, 3):
                form = gemv_form(m, n, k, fmt, group, DType.BF16, True, False)
                spec = QGemvSpec(m, n, k, fmt, group, DType.BF16, DType.F16, norm=True, argmax=True, **form)
                pending.append(((arch, n, m), spec, K.build_async(spec, arch)))
    for what, spec, p in pending:
        ck = p.result()
        assert ck.binary.spill_bytes == 0 and ck.params[-4:] == ("seed", "counter", "temperature", "part"), what
        # one pair a warp of the launched grid, for every row of x: what the sampler is told it merges
        assert spec.part_floats == 2 * spec.M * ck.grid[0] * ck.block[0] // 32 == 2 * spec.M * spec.parts, what


def test_dp4a_siblings_compile_without_spills_and_refuse_what_they_cannot_take():
    """Packed siblings (QGemvSpec.siblings): the Llama-1B's, 7B's and Llama-2-13B's q/k (Q4_K) + v (Q6_K) at 1 and 2
    rows of x, in the rule's forms for siblings, compile without spills on sm_80 and sm_90 (the 13B's Q4_K at 8 chunks
    a round spilled 80 bytes beside its Q6_K sibling: ``dp4a_heavy``), each segment's params in turn, the blocks one
    wave at most; the dp4a form's alone, without a gated unit, argmax, clusters or an epilogue, over one K."""
    from fusec.codegen.spec_base import SMS
    from fusec.codegen.specs_quant import QSibling

    pending = []
    for arch in ("sm_80", "sm_90"):
        for n0, n1, k in ((2560, 512, 2048), (8192, 4096, 4096), (10240, 5120, 5120)):
            for m in (1, 2):
                f0 = gemv_form(m, n0, k, "q4_k", 32, DType.BF16, True, siblings=True)
                f1 = gemv_form(m, n1, k, "q6_k", 16, DType.BF16, True, siblings=True)
                spec = QGemvSpec(m, n0, k, "q4_k", 32, DType.BF16, DType.F16, norm=True, **f0,
                                 siblings=(QSibling(n1, "q6_k", 16, DType.F16, f1["rows"], f1["chunks"]),))
                nb = spec.segment_blocks
                assert min(nb) >= 1 and sum(nb) <= spec.blocks * SMS
                if n0 == 8192:  # the 7B's: more than a wave of tasks, the wave shared by weight bytes
                    share = n0 * FORMATS["q4_k"].bits_per_weight(32) / (n1 * FORMATS["q6_k"].bits_per_weight(16))
                    assert sum(nb) >= spec.blocks * SMS - 2 and abs(nb[0] / nb[1] - share) < 0.05, (nb, share)
                pending.append(((arch, n0, m), spec, K.build_async(spec, arch)))
    for what, spec, p in pending:
        ck = p.result()
        assert ck.binary.spill_bytes == 0 and ck.grid[0] == sum(spec.segment_blocks), what
        assert ck.params[-3:] == ("g", "C", "out_1") and "codes_1" in ck.params and "high_1" in ck.params, what
    sib = QSibling(512, "q6_k", 16)
    base = dict(dp4a=True, norm=True, siblings=(sib,))
    for bad in (dict(glu="silu"), dict(argmax=True), dict(cluster=2), dict(epilogue=Epilogue(residual=True)),
                dict(dp4a=False)):
        with pytest.raises(ValueError, match="siblings"):
            QGemvSpec(1, 2560, 2048, "q4_k", 32, DType.BF16, DType.F16, **{**base, **bad})
    with pytest.raises(ValueError):  # a sibling's rows must hold its format's blocks of K
        QGemvSpec(1, 2560, 2048, "q4_k", 32, DType.BF16, DType.F16, **{**base, "siblings": (QSibling(512, "q6_k", 7),)})
