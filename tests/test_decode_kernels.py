"""Decode-step kernels (cache_write, kv_attention + combine, sample) on the CPU: ``decode_specs``
is a grid of dtypes and shapes that test_templates renders and compiles with NVRTC for sm_80 and
sm_90 (with the other templates' specs); here bad specs are refused and the lowering of the
three ops emits the launches it should (no GPU needed)."""

from __future__ import annotations

import pytest

from fusec import ops as O
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_decode import kv_attention_spec, kv_layout, sample_spec
from fusec.dtypes import DType
from fusec.ir import Node, Value
from fusec.lower import Context, LoweringError
from fusec.lower.nodes import LOWER

F16, BF16, F32, I64, I32, BOOL = DType.F16, DType.BF16, DType.F32, DType.I64, DType.I32, DType.BOOL
FLOATS = [F32, F16, BF16]


def decode_specs() -> list[tuple[str, object]]:
    """One spec per interesting (template, config); test_templates checks every template is covered."""
    out: list[tuple[str, object]] = []
    for dt in FLOATS:
        for B, Hq, Hkv, Sq, T, D in [(1, 16, 8, 1, 4096, 128), (32, 16, 8, 1, 4096, 128), (3, 9, 3, 1, 77, 64),
                                     (2, 8, 1, 3, 100, 256), (2, 6, 6, 1, 33, 80), (2, 4, 2, 7, 64, 32)]:
            sp = kv_attention_spec(B, Hq, Hkv, Sq, T, D, dt, 0.1)
            out.append((f"kvattn-{dt.value}-B{B}-H{Hq}/{Hkv}-S{Sq}-T{T}-D{D}-x{sp.splits}", sp))
            if sp.splits > 1:
                out.append((f"kvcomb-{dt.value}-B{B}-H{Hq}-S{Sq}-T{T}-D{D}", sp.combine()))
                out.append((f"kvcombw-{dt.value}-B{B}-H{Hq}-S{Sq}-T{T}-D{D}", sp.combine(wide=True)))
        out.append((f"kvattn-{dt.value}-single", S.KVAttentionSpec(2, 4, 2, 1, 50, 64, dt, 0.1, 1, I32, 64)))
        out.append((f"kvattn-{dt.value}-256t", S.KVAttentionSpec(2, 16, 8, 1, 512, 64, dt, 0.1, 4, I64, 256)))
        out.append((f"cachew-{dt.value}-kv", S.cache_write_spec((4, 8, 4096, 128), (4, 8, 1, 128), 2, dt)))
        out.append((f"cachew-{dt.value}-prefill", S.cache_write_spec((2, 3, 50, 72), (2, 3, 9, 72), 2, dt, I32)))
        out.append((f"cachew-{dt.value}-novec", S.cache_write_spec((2, 5, 3), (2, 2, 3), 1, dt, vectorize=False)))
        out.append((f"sample-{dt.value}-greedy", S.SampleSpec(8, 151936, dt)))
        out.append((f"sample-{dt.value}-greedy-odd", S.SampleSpec(3, 1001, dt)))
        out.append((f"sample-{dt.value}-topk-topp", S.SampleSpec(4, 151936, dt, 0.7, 50, 0.9)))
        out.append((f"sample-{dt.value}-topk-topp-compact", S.SampleSpec(4, 151936, dt, 0.7, 50, 0.9, compact=True)))
        out.append((f"sample-{dt.value}-topp-compact", S.SampleSpec(2, 5000, dt, 0.7, 0, 0.9, compact=True)))
        out.append((f"sample-{dt.value}-topp", S.SampleSpec(2, 1000, dt, 1.0, 0, 0.5, I32, I32)))
        out.append((f"sample-{dt.value}-topk", S.SampleSpec(2, 999, dt, 1.5, 7)))
        out.append((f"sample-{dt.value}-plain", S.SampleSpec(2, 32000, dt, 0.8)))
        split = sample_spec(1, 151936, dt)
        out.append((f"sample-{dt.value}-greedy-split{split.chunks}", split))
        out.append((f"sample-{dt.value}-plain-split", sample_spec(8, 50000, dt, 1.0, 0, 1.0, I32, I32)))
        out.append((f"samplec-{split.chunks}", split.combine()))
    out.append(("cachew-i64-tokens", S.cache_write_spec((8, 4096), (8, 1), 1, I64)))
    out.append(("cachew-i32-tokens", S.cache_write_spec((8, 4096), (8, 1), 1, I32)))
    return out


def test_kv_attention_vector_loads_and_params() -> None:
    sp = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.088)
    r, src = K.prepare(sp)
    assert r.params == ("q", "k", "v", "pos", "part") and sp.splits > 1
    assert "ld.global.nc.v4.u32" in src
    assert r.grid == (sp.splits, 8, 1)  # one tile: the GQA group's 2 query heads share a block
    assert K.prepare(sp.combine())[0].params == ("pos", "part", "out")
    single = S.KVAttentionSpec(1, 16, 8, 1, 64, 128, BF16, 0.088)
    assert K.prepare(single)[0].params == ("q", "k", "v", "pos", "out") and single.part_floats == 0


def test_kv_attention_splits_fill_the_gpu() -> None:
    one = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1)
    eight = kv_attention_spec(8, 16, 8, 1, 4096, 128, BF16, 0.1)
    many = kv_attention_spec(32, 16, 8, 1, 4096, 128, BF16, 0.1)
    assert (one.splits, eight.splits, many.splits) == (64, 16, 4)  # <= one wave of 8 x 132 blocks
    assert kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, max_splits=1000).splits == 128
    short = kv_attention_spec(1, 16, 8, 1, 64, 128, BF16, 0.1)
    assert short.splits == 2  # never more splits than 32-key chunks
    lay = kv_layout(kv_attention_spec(1, 32, 1, 1, 256, 128, BF16, 0.1))
    assert lay["tiles"] * lay["rows"] >= 32  # MQA with 32 query heads: several row tiles


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="multiple of Hkv"):
        S.KVAttentionSpec(1, 6, 4, 1, 8, 64, F16, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        S.KVAttentionSpec(1, 2, 2, 1, 8, 72 + 2, F16, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        S.KVAttentionSpec(1, 2, 2, 1, 8, 512, F16, 0.1)
    with pytest.raises(ValueError, match="float"):
        S.KVAttentionSpec(1, 2, 2, 1, 8, 64, I64, 0.1)
    with pytest.raises(ValueError, match="splits"):
        S.KVAttentionSpec(1, 2, 2, 1, 64, 64, F16, 0.1, splits=3)
    with pytest.raises(ValueError, match="scale"):
        S.KVAttentionSpec(1, 2, 2, 1, 64, 64, F16, float("nan"))
    with pytest.raises(ValueError, match="positions"):
        S.KVAttentionSpec(1, 2, 2, 1, 64, 64, F16, 0.1, pos_dtype=F32)
    with pytest.raises(ValueError, match="threads"):
        S.KVAttentionSpec(1, 2, 2, 1, 64, 64, F16, 0.1, threads=100)
    with pytest.raises(ValueError, match="at least 2"):
        S.KVCombineSpec(1, 2, 1, 64, 64, F16, 1)
    with pytest.raises(ValueError, match="do not fit"):
        S.CacheWriteSpec(1, 1, 4, 5, 8, F16)
    with pytest.raises(ValueError, match="vec"):
        S.CacheWriteSpec(1, 1, 4, 1, 12, F16, vec=8)
    with pytest.raises(ValueError, match="16 bytes"):
        S.CacheWriteSpec(1, 1, 4, 1, 16, F32, vec=8)
    with pytest.raises(ValueError, match="dtype"):
        S.CacheWriteSpec(1, 1, 4, 1, 16, BOOL)
    with pytest.raises(ValueError, match="does not fit"):
        S.cache_write_spec((2, 3, 8, 4), (2, 4, 1, 4), 2, F16)
    with pytest.raises(ValueError, match="axis"):
        S.cache_write_spec((2, 8, 4), (2, 8, 4), 0, F16)
    with pytest.raises(ValueError, match="top_p"):
        S.SampleSpec(1, 10, F32, 1.0, 0, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        S.SampleSpec(1, 10, F32, 1.0, 0, 1.5)
    with pytest.raises(ValueError, match="temperature"):
        S.SampleSpec(1, 10, F32, -1.0)
    with pytest.raises(ValueError, match="temperature"):
        S.SampleSpec(1, 10, F32, float("inf"))
    with pytest.raises(ValueError, match="top_k"):
        S.SampleSpec(1, 10, F32, 1.0, -1)
    with pytest.raises(ValueError, match="float"):
        S.SampleSpec(1, 10, I64)
    with pytest.raises(ValueError, match="seed"):
        S.SampleSpec(1, 10, F32, seed_dtype=F32)
    with pytest.raises(ValueError, match="split a row"):
        S.SampleSpec(1, 10000, F32, 1.0, 5, chunks=4)
    with pytest.raises(ValueError, match="256 tokens"):
        S.SampleSpec(1, 1000, F32, chunks=8)
    with pytest.raises(ValueError, match="at least 2"):
        S.SampleCombineSpec(4, 1)
    with pytest.raises(ValueError, match="compact"):
        S.SampleSpec(1, 1000, F32, 1.0, compact=True)
    with pytest.raises(ValueError, match="splits"):
        S.KVCombineSpec(1, 2, 1, 1 << 20, 64, F16, 2000)


def test_sample_variants_render_what_they_need() -> None:
    _, greedy = K.prepare(S.SampleSpec(2, 1000, F32))
    body = greedy.split('extern "C"')[1]
    assert "fc_mix64(" not in body and "hist[" not in body
    r, full = K.prepare(S.SampleSpec(2, 1000, F32, 0.7, 10, 0.9))
    assert r.shared_mem == 0 and "fc_dyn" not in full
    r, compact = K.prepare(S.SampleSpec(2, 1000, F32, 0.7, 10, 0.9, compact=True))
    assert r.shared_mem == 8192 * 8 and "fc_dyn" in compact  # candidates gathered in dynamic shared memory
    assert "0x9E3779B97F4A7C15" in full and "0xD1B54A32D192ED03" in full and "0x8CB92BA72F3D8DD7" in full
    assert "-logf(-logf(u))" in full
    _, kfull = K.prepare(S.SampleSpec(2, 1000, F32, 0.7, 1000, 1.0))  # top_k >= V: no cut
    assert "hist[" not in kfull.split('extern "C"')[1]


# ---- lowering ---------------------------------------------------------------------------------

def _ctx(offsets: dict[str, int]) -> Context:
    return Context("sm_90", offsets, "f32", None)


def test_lower_cache_write_in_place() -> None:
    cache, new, pos = Value("kc", (2, 8, 64, 128), BF16), Value("kn", (2, 8, 1, 128), BF16), Value("pos", (2,), I64)
    out = Value("kc2", (2, 8, 64, 128), BF16)
    node = Node(O.Op.CACHE_WRITE, [cache, new, pos], [out], O.CacheWriteAttrs(2), name="write")
    ctx = _ctx({"kc": 0, "kn": 1 << 20, "pos": 2 << 20, "kc2": 0})
    LOWER[O.Op.CACHE_WRITE](ctx, node, "#0 cache_write")
    assert len(ctx.launches) == 1
    assert [a[2] for a in ctx.launches[0]["args"]] == [1 << 20, 2 << 20, 0]
    assert "#define VEC 8\n" in ctx.blobs["source/m0"].decode()
    bad = _ctx({"kc": 0, "kn": 1 << 20, "pos": 2 << 20, "kc2": 4 << 20})
    with pytest.raises(LoweringError, match="in place.*'write'|'write'.*in place"):
        LOWER[O.Op.CACHE_WRITE](bad, node, "#0 cache_write")


def test_lower_cache_write_unaligned_new_is_scalar() -> None:
    cache, new, pos = Value("t", (2, 64), I64), Value("n", (2, 1), I64), Value("pos", (2,), I64)
    out = Value("t2", (2, 64), I64)
    node = Node(O.Op.CACHE_WRITE, [cache, new, pos], [out], O.CacheWriteAttrs(1))
    ctx = _ctx({"t": 0, "n": 1032, "pos": 2048, "t2": 0})
    LOWER[O.Op.CACHE_WRITE](ctx, node, "#0")
    assert len(ctx.launches) == 1 and "#define VEC 1\n" in ctx.blobs["source/m0"].decode()


def test_lower_kv_attention_split_and_combine() -> None:
    q, k, v = Value("q", (1, 16, 1, 128), BF16), Value("k", (1, 8, 4096, 128), BF16), Value("v", (1, 8, 4096, 128), BF16)
    pos, out = Value("pos", (1,), I64), Value("o", (1, 16, 1, 128), BF16)
    node = Node(O.Op.KV_ATTENTION, [q, k, v, pos], [out], O.KVAttentionAttrs(0.088), name="attn")
    ctx = _ctx({"q": 0, "k": 1 << 20, "v": 16 << 20, "pos": 32 << 20, "o": 33 << 20})
    ctx.arena_base = 64 << 20
    LOWER[O.Op.KV_ATTENTION](ctx, node, "#1 kv_attention")
    assert len(ctx.launches) == 2
    part = ctx.launches[0]["args"][-1]
    assert part == ["ptr", "arena", 64 << 20] and ctx.launches[1]["args"][1] == part
    assert ctx.scratch_bytes >= 16 * 130 * 4 * 2
    assert ctx.launches[1]["args"][2] == ["ptr", "arena", 33 << 20]


def test_lower_kv_attention_refuses_bad_shapes() -> None:
    q, k, v = Value("q", (1, 4, 1, 72 + 4), F16), Value("k", (1, 4, 64, 76), F16), Value("v", (1, 4, 64, 76), F16)
    pos, out = Value("pos", (1,), I64), Value("o", (1, 4, 1, 76), F16)
    node = Node(O.Op.KV_ATTENTION, [q, k, v, pos], [out], O.KVAttentionAttrs(0.1), name="attn76")
    ctx = _ctx({"q": 0, "k": 4096, "v": 65536, "pos": 1 << 20, "o": 2 << 20})
    with pytest.raises(LoweringError, match="attn76.*\\[1, 4, 1, 76\\]"):
        LOWER[O.Op.KV_ATTENTION](ctx, node, "#1")


def test_lower_sample() -> None:
    logits, seed, ctr = Value("lg", (2, 1000), F32), Value("seed", (1,), I64), Value("ctr", (2,), I64)
    out = Value("ids", (2,), I64)
    node = Node(O.Op.SAMPLE, [logits, seed, ctr], [out], O.SampleAttrs(0.7, 40, 0.95))
    ctx = _ctx({"lg": 0, "seed": 8192, "ctr": 8448, "ids": 8704})
    LOWER[O.Op.SAMPLE](ctx, node, "#2 sample")
    assert len(ctx.launches) == 1 and ctx.launches[0]["grid"] == [1, 2, 1]


def test_lower_greedy_splits_rows_over_blocks() -> None:
    logits, seed, ctr = Value("lg", (1, 151936), BF16), Value("seed", (1,), I64), Value("ctr", (1,), I64)
    out = Value("ids", (1,), I64)
    node = Node(O.Op.SAMPLE, [logits, seed, ctr], [out], O.SampleAttrs())
    ctx = _ctx({"lg": 0, "seed": 1 << 20, "ctr": (1 << 20) + 256, "ids": (1 << 20) + 512})
    ctx.arena_base = 2 << 20
    LOWER[O.Op.SAMPLE](ctx, node, "#3 sample")
    assert len(ctx.launches) == 2 and ctx.launches[0]["grid"][0] >= 32
    assert ctx.launches[0]["args"][-1] == ctx.launches[1]["args"][0] == ["ptr", "arena", 2 << 20]
    assert ctx.launches[1]["args"][1] == ["ptr", "arena", (1 << 20) + 512]
