"""Decode-step kernels (cache_write, kv_attention + combine, sample) on the CPU: ``decode_specs``
is a grid of dtypes and shapes that test_templates renders and compiles with NVRTC for sm_80 and
sm_90 (with the other templates' specs); here bad specs are refused and the lowering of the
three ops emits the launches it should (no GPU needed)."""

from __future__ import annotations

import dataclasses

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


def heads_parts(B: int, Hq: int, Hkv: int, Sq: int, T: int, D: int, dt: DType, norm: bool,
                w_dtype: DType = DType.F32) -> tuple[S.HeadRopeSpec, ...]:
    """The (q, k, v) head_rope parts of an attention prologue over one merged QKV row [B, S, (Hq + 2 Hkv) D]
    (each part's pointer starts at its heads), cos/sin [B, S, D], fp32 norm weights."""
    W = (Hq + 2 * Hkv) * D
    xs, cs, cache = (Sq * W, D, W), (Sq * D, D), (Hkv * T * D, T * D, D)
    kw = dict(norm=True, w_dtype=w_dtype) if norm else {}
    return (S.HeadRopeSpec(B, Hq, Sq, D, dt, xs, (Hq * Sq * D, Sq * D, D), cs, dt, **kw),
            S.HeadRopeSpec(B, Hkv, Sq, D, dt, xs, cache, cs, dt, cache_len=T, **kw),
            S.HeadRopeSpec(B, Hkv, Sq, D, dt, xs, cache, cs, dt, cache_len=T, rotate=False))


def decode_specs() -> list[tuple[str, object]]:
    """One spec per interesting (template, config); test_templates checks every template is covered."""
    out: list[tuple[str, object]] = []
    for dt in FLOATS:
        for B, Hq, Hkv, Sq, T, D in [(1, 16, 8, 1, 4096, 128), (32, 16, 8, 1, 4096, 128), (3, 9, 3, 1, 77, 64),
                                     (2, 8, 1, 3, 100, 256), (2, 6, 6, 1, 33, 80), (2, 4, 2, 7, 64, 32)]:
            sp = kv_attention_spec(B, Hq, Hkv, Sq, T, D, dt, 0.1)
            out.append((f"kvattn-{dt.value}-B{B}-H{Hq}/{Hkv}-S{Sq}-T{T}-D{D}-x{sp.splits}", sp))
        out.append((f"kvattn-{dt.value}-single", S.KVAttentionSpec(2, 4, 2, 1, 50, 64, dt, 0.1, 1, I32, 64)))
        out.append((f"kvattn-{dt.value}-prefetch", kv_attention_spec(1, 16, 8, 1, 4096, 128, dt, 0.1, prefetch=True)))
        out.append((f"kvattn-{dt.value}-cluster", kv_attention_spec(1, 16, 8, 1, 271, 128, dt, 0.1, prefetch=True,
                                                                   cluster=True)))
        out.append((f"kvattn-{dt.value}-cluster-window-S3",
                    kv_attention_spec(2, 8, 2, 3, 100, 64, dt, 0.1, window=20, cluster=True)))
        out.append((f"kvattn-{dt.value}-prefetch-window-S3",
                    kv_attention_spec(2, 8, 2, 3, 100, 64, dt, 0.1, window=20, prefetch=True)))
        out.append((f"kvattn-{dt.value}-256t", S.KVAttentionSpec(2, 16, 8, 1, 512, 64, dt, 0.1, 4, I64, 256)))
        for tag, (B, Hq, Hkv, Sq, T, D), norm, kw in [  # the head_rope group as the prologue (rope_attention)
                ("cluster", (1, 16, 8, 1, 271, 128), True, dict(prefetch=True, cluster=True)),
                ("split", (8, 16, 8, 1, 271, 128), True, dict(prefetch=True, split_keys=64)),
                ("window-S3", (3, 8, 2, 3, 100, 64), True, dict(window=20)),
                ("plain-rope", (2, 4, 4, 1, 64, 64), False, {})]:
            out.append((f"kvattn-{dt.value}-heads-{tag}", kv_attention_spec(
                B, Hq, Hkv, Sq, T, D, dt, 0.1, heads=heads_parts(B, Hq, Hkv, Sq, T, D, dt, norm), **kw)))
        out.append((f"cachew-{dt.value}-kv", S.cache_write_spec((4, 8, 4096, 128), (4, 8, 1, 128), 2, dt)))
        out.append((f"cachew-{dt.value}-prefill", S.cache_write_spec((2, 3, 50, 72), (2, 3, 9, 72), 2, dt, I32)))
        out.append((f"cachew-{dt.value}-novec", S.cache_write_spec((2, 5, 3), (2, 2, 3), 1, dt, vectorize=False)))
        out.append((f"cachew-{dt.value}-rows", S.cache_write_spec((32, 8, 256, 128), (1, 8, 128, 128), 2, dt,
                                                                  rows_dtype=I64)))
        out.append((f"sample-{dt.value}-row", S.SampleSpec(8, 151936, dt)))
        out.append((f"sample-{dt.value}-row-odd", S.SampleSpec(3, 1001, dt, I32, I32, I32)))
        split = sample_spec(1, 151936, dt)
        out.append((f"sample-{dt.value}-split{split.chunks}", split))
        out.append((f"samplep-{dt.value}-split{split.chunks}", split.part()))
        wide = sample_spec(8, 50000, dt, I32, I32)
        out.append((f"samplep-{dt.value}-8x50000", wide.part()))
    out.append(("cachew-i64-tokens", S.cache_write_spec((8, 4096), (8, 1), 1, I64)))
    out.append(("cachew-i32-tokens", S.cache_write_spec((8, 4096), (8, 1), 1, I32)))
    return out


def test_kv_attention_vector_loads_and_params() -> None:
    sp = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.088)
    r, src = K.prepare(sp)
    assert r.params == ("q", "k", "v", "pos", "part", "sync", "out") and sp.splits > 1  # merged in-kernel
    assert "ld.global.nc.v4.u32" in src and "atomicAdd" in src
    assert "kv <= chunk" in src  # a context within one chunk: its block writes out, no merge (GPU-tested)
    assert r.grid == (sp.splits, 8, 1)  # one tile: the GQA group's 2 query heads share a block
    assert sp.sync_ints(1) == 8  # one counter per (b, tile, kv head)
    single = S.KVAttentionSpec(1, 16, 8, 1, 64, 128, BF16, 0.088)
    assert K.prepare(single)[0].params == ("q", "k", "v", "pos", "out") and single.part_floats == 0


def test_kv_attention_splits_fill_the_gpu() -> None:
    one = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1)
    eight = kv_attention_spec(8, 16, 8, 1, 4096, 128, BF16, 0.1)
    many = kv_attention_spec(32, 16, 8, 1, 4096, 128, BF16, 0.1)
    assert (one.splits, eight.splits, many.splits) == (64, 8, 2)  # <= one wave of 4 x 132 blocks (64: the cap)
    wide = kv_attention_spec(32, 16, 8, 1, 4096, 128, BF16, 0.1, target_blocks=8 * 132)
    assert wide.splits == 4  # the first form's wave of 8 blocks an SM (FUSEC_KV_WAVE_BLOCKS=8)
    assert kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, max_splits=1000).splits == 66  # 528 blocks / 8
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
    with pytest.raises(ValueError, match="float"):
        S.SampleSpec(1, 10, I64)
    with pytest.raises(ValueError, match="seed"):
        S.SampleSpec(1, 10, F32, seed_dtype=F32)
    with pytest.raises(ValueError, match="top_k"):
        S.SampleSpec(1, 10, F32, top_k_dtype=BOOL)
    with pytest.raises(ValueError, match="65535 chunks"):  # the pairs merged: one a tile or warp of the LM head
        S.SampleSpec(1, 1000, F32, chunks=65536)
    with pytest.raises(ValueError, match="256 tokens"):  # the sampler's own first step
        S.SampleSpec(1, 1000, F32, chunks=8).part()
    with pytest.raises(ValueError, match="at least 2"):
        S.SampleSpec(4, 1000, F32).part()
    with pytest.raises(ValueError, match="splits"):
        S.KVAttentionSpec(1, 2, 2, 1, 1 << 20, 64, F16, 0.1, splits=2000)


def test_sample_kernels_read_every_setting_per_row() -> None:
    """Nothing about sampling is compiled in: one kernel per shape serves greedy, plain and cut rows."""
    _, row = K.prepare(S.SampleSpec(2, 1000, F32))
    body = row.split('extern "C"')[1]
    for setting in ("temperature[b]", "top_k[b]", "top_p[b]", "seed[b]", "counter[b]"):
        assert setting in body
    assert "hist[" in body and "fc_sample_cut(" in body and "best_in[" not in body
    cuh = row.split('extern "C"')[0]
    assert "0x9E3779B97F4A7C15" in cuh and "0x8CB92BA72F3D8DD7" in cuh and "-logf(-logf(u))" in cuh
    _, merged = K.prepare(sample_spec(1, 151936, F32))
    assert "best_in[" in merged.split('extern "C"')[1]
    _, part = K.prepare(sample_spec(1, 151936, F32).part())
    body = part.split('extern "C"')[1]
    assert "fc_sample_cut(" in body and "hist[" not in body  # a cut row is left to the row kernel


# ---- lowering ---------------------------------------------------------------------------------

def _ctx(offsets: dict[str, int]) -> Context:
    return Context("sm_90", offsets, "f32", None)


def _lower_kv(ctx: Context, node: Node, label: str) -> None:
    """Kernel selection records the attention's form (for ctx's arch, as a compile for it would), then the lowering."""
    from fusec.lower import sm90_or_later
    from fusec.passes import select_kernels
    from fusec.passes.base import PassOptions

    node.kernel = select_kernels._select(node, PassOptions(clusters=sm90_or_later(ctx.arch)), {})
    LOWER[O.Op.KV_ATTENTION](ctx, node, label)


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


def test_lower_kv_attention_split_merges_in_one_launch() -> None:
    q, k, v = Value("q", (1, 16, 1, 128), BF16), Value("k", (1, 8, 4096, 128), BF16), Value("v", (1, 8, 4096, 128), BF16)
    pos, out = Value("pos", (1,), I64), Value("o", (1, 16, 1, 128), BF16)
    node = Node(O.Op.KV_ATTENTION, [q, k, v, pos], [out], O.KVAttentionAttrs(0.088), name="attn")
    ctx = _ctx({"q": 0, "k": 1 << 20, "v": 16 << 20, "pos": 32 << 20, "o": 33 << 20})
    ctx.arena_base = 64 << 20
    ctx.sync_base = 4096
    _lower_kv(ctx, node, "#1 kv_attention")
    assert len(ctx.launches) == 1  # the last block of each head merges the splits' partials
    args = ctx.launches[0]["args"]
    assert args[4] == ["ptr", "arena", 64 << 20] and ctx.scratch_bytes >= 16 * 130 * 4 * 2  # the partials
    assert args[5] == ["ptr", "state", 4096] and ctx.sync_bytes >= 8 * 4  # one counter per kv head
    assert args[6] == ["ptr", "arena", 33 << 20]


def _prefetch_case(writer: str) -> bool:
    """Lower a cache write (``writer``: "pos" at rows pos[b], "rows" row-indexed, "other_pos" from
    other positions, "pos_too" that also rewrites pos, "none": a kernel writing elsewhere), then the
    attention over the cache: whether the attention loads old rows before its PDL wait."""
    q, kc = Value("q", (2, 4, 1, 64), BF16), Value("kc", (2, 2, 64, 64), BF16)
    k, v = Value("k", (2, 2, 64, 64), BF16), Value("v", (2, 2, 64, 64), BF16)
    new, pos, pos2, rows = Value("kn", (2, 2, 1, 64), BF16), Value("pos", (2,), I64), Value("p2", (2,), I64), \
        Value("rows", (2,), I64)
    offs = {"q": 0, "kc": 1 << 20, "k": 1 << 20, "v": 2 << 20, "kn": 3 << 20, "pos": 4 << 20, "p2": (4 << 20) + 256,
            "rows": (4 << 20) + 512, "o": 5 << 20}
    ctx = _ctx(offs)
    ins = {"pos": [kc, new, pos], "rows": [kc, new, pos, rows], "other_pos": [kc, new, pos2],
           "pos_too": [kc, new, pos], "none": [Value("x", (2, 2, 64, 64), BF16), new, pos]}[writer]
    offs["x"] = 6 << 20
    wnode = Node(O.Op.CACHE_WRITE, ins, [Value("x", (2, 2, 64, 64), BF16) if writer == "none" else k],
                 O.CacheWriteAttrs(2), name="w")
    LOWER[O.Op.CACHE_WRITE](ctx, wnode, "#0 cache_write")
    if writer == "pos_too":  # the same task also writes the positions (a made-up writer)
        ctx.tasks[-1].writes += (ctx.region(pos),)
    node = Node(O.Op.KV_ATTENTION, [q, k, v, pos], [Value("o", (2, 4, 1, 64), BF16)], O.KVAttentionAttrs(0.125))
    ctx.arena_base, ctx.sync_base = 8 << 20, 4096
    _lower_kv(ctx, node, "#1 kv_attention")
    return "#define KV_LD fc_ldcg16" in ctx.blobs[f"source/m{len(ctx.modules) - 1}"].decode()


def test_kv_attention_loads_old_rows_before_the_wait_only_where_the_program_allows(monkeypatch) -> None:  # noqa: ANN001
    """The rows below pos[b] are read before the PDL wait only when the kernel before writes the
    cache at rows pos[b] + s from the same positions, or not at all, and leaves pos alone."""
    assert _prefetch_case("pos") and _prefetch_case("none")
    assert not _prefetch_case("rows")  # a join's row-indexed write may rewrite any row
    assert not _prefetch_case("other_pos")
    assert not _prefetch_case("pos_too")
    monkeypatch.setenv("FUSEC_KV_PREFETCH", "0")
    assert not _prefetch_case("pos")


def test_a_generation_plan_prefetches_old_rows_in_decode_not_in_its_join_entry() -> None:
    """Compiled for sm_90 (head_dim 64: the decode attention writes the caches in its head_rope
    prologue): each decode attention loads the rows older than the step before its wait (the QKV
    product, the task before it, writes no cache) and merges its splits through a cluster; the join
    entry's (a row-indexed cache write before it may rewrite any row) loads nothing before its wait."""
    import dataclasses

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-pf", hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=64, intermediate_size=256, num_layers=2)
    gm = GenModel(cfg, SharedWeights(RandomWeights(7)), None, (), cfg.name)
    plan = compile_generation(gm, batch=4, max_seq_len=48, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90", join=2)
    man = plan.manifest
    mods = {m["id"]: m for m in man["modules"]}

    def attention_sources(entry: str) -> list[tuple[str, str]]:
        ls = man["entries"][entry]["launches"]
        out = []
        for i, L in enumerate(ls):
            mod = mods[man["kernels"][L["kernel"]]["module"]] if "kernel" in L else None
            if mod is not None and mod["template"] == "kv_attention.cu.jinja":
                out.append((ls[i - 1]["label"], plan._blobs[mod["source"]].decode()))
        return out

    decode, join = attention_sources("decode"), attention_sources("join")
    assert len(decode) == 2 and len(join) == 2
    assert all("norm_gemm" in before for before, _ in decode), [b for b, _ in decode]
    assert all("fc_pdl_wait_after(dep)" in src and "__cluster_dims__" in src for _, src in decode)
    assert all("fc_pdl_wait_after(dep)" not in src and "fc_pdl_wait();" in src for _, src in join)


def test_kv_attention_cluster_merge_takes_the_short_caches_on_sm90_only() -> None:
    """A cluster merge where the split count fits twice the cluster size (then at most 8 splits),
    never on sm_80; its kernel takes no partials. A long cache keeps its blocks: clusters of 8, a context in the first
    merged there, a longer one through global memory (FUSEC_KV_CLUSTER_LEVELS=1: always through it, no cluster)."""
    short = kv_attention_spec(1, 16, 8, 1, 271, 128, BF16, 0.1, cluster=True)
    assert short.cluster and short.splits == S.KV_MAX_CLUSTER and not short.global_merge and short.part_floats == 0
    assert kv_attention_spec(1, 16, 8, 1, 271, 128, BF16, 0.1).splits > S.KV_MAX_CLUSTER  # what it cut
    long = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, cluster=True)
    flat = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1)
    assert long.cluster and long.splits == flat.splits == 64 and long.cluster_size == S.KV_MAX_CLUSTER
    assert long.global_merge and flat.global_merge and long.part_floats == flat.part_floats > 0
    assert not kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, cluster=True, cluster_levels=1).cluster
    # 8 keys a key group (a 4,240-row cache's half-capacity chunks): no clusters (two waves of 189-register blocks)
    u8 = kv_attention_spec(1, 16, 8, 1, 4240, 128, BF16, 0.1, prefetch=True, cluster=True)
    u4 = kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, prefetch=True, cluster=True)
    assert (u8.unroll, u8.cluster, u8.splits) == (8, False, 64) and (u4.unroll, u4.cluster, u4.splits) == (0, True, 64)
    # a global merge's kernel runs a context of at most solo_keys keys in one block; a cluster's merges it there
    assert kv_attention_spec(1, 16, 8, 1, 4240, 128, BF16, 0.1, prefetch=True, cluster=True, solo_keys=128).solo_keys == 128
    assert kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, prefetch=True, cluster=True, solo_keys=128).solo_keys == 0
    assert kv_attention_spec(1, 16, 8, 1, 40, 128, BF16, 0.1, max_splits=1, solo_keys=128).solo_keys == 0  # one split
    assert kv_attention_spec(1, 16, 8, 4, 4096, 128, BF16, 0.1, solo_keys=128).solo_keys == 0  # decode steps only
    src = K.prepare(kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1, solo_keys=128))[1]
    assert "kv <= 128 ? ((kv + GRAN - 1) / GRAN) * GRAN" in src
    assert "kv <= 128" not in K.prepare(kv_attention_spec(1, 16, 8, 1, 4096, 128, BF16, 0.1))[1]
    odd = kv_attention_spec(1, 16, 8, 1, 33 * 32, 128, BF16, 0.1, cluster=True)  # 33 splits: whole clusters
    assert odd.cluster and odd.splits == 32
    assert not kv_attention_spec(256, 16, 8, 1, 271, 128, BF16, 0.1, cluster=True).cluster  # one split a head
    for bad in (9, 20):
        with pytest.raises(ValueError, match="cluster"):
            S.KVAttentionSpec(1, 16, 8, 1, 4096, 128, BF16, 0.1, bad, cluster=True)
    q, k, v = Value("q", (1, 16, 1, 128), BF16), Value("k", (1, 8, 271, 128), BF16), Value("v", (1, 8, 271, 128), BF16)
    pos, out = Value("pos", (1,), I64), Value("o", (1, 16, 1, 128), BF16)
    node = Node(O.Op.KV_ATTENTION, [q, k, v, pos], [out], O.KVAttentionAttrs(0.088), name="attn")
    for arch, want in (("sm_90", True), ("sm_80", False)):
        ctx = Context(arch, {"q": 0, "k": 1 << 20, "v": 2 << 20, "pos": 3 << 20, "o": 4 << 20}, "f32", None)
        ctx.arena_base, ctx.sync_base = 8 << 20, 4096
        _lower_kv(ctx, node, "#1 kv_attention")
        src = ctx.blobs["source/m0"].decode()
        assert ("__cluster_dims__" in src) == want, arch
        assert len(ctx.launches[0]["args"]) == (5 if want else 7)  # no partials, no counters
    # a long cache on sm_90: clusters, and the partials and counters of the merge over them
    q4, k4, v4 = Value("q", (1, 16, 1, 128), BF16), Value("k", (1, 8, 4096, 128), BF16), Value("v", (1, 8, 4096, 128), BF16)
    node = Node(O.Op.KV_ATTENTION, [q4, k4, v4, pos], [out], O.KVAttentionAttrs(0.088), name="attn")
    ctx = Context("sm_90", {"q": 0, "k": 1 << 20, "v": 20 << 20, "pos": 40 << 20, "o": 41 << 20}, "f32", None)
    ctx.arena_base, ctx.sync_base = 48 << 20, 4096
    _lower_kv(ctx, node, "#1 kv_attention")
    src = ctx.blobs["source/m0"].decode()
    assert "__cluster_dims__(CL, 1, 1)" in src and "#define CL 8" in src and "#define SPLITS 64" in src
    assert len(ctx.launches[0]["args"]) == 7


def test_lower_kv_attention_refuses_bad_shapes() -> None:
    q, k, v = Value("q", (1, 4, 1, 72 + 4), F16), Value("k", (1, 4, 64, 76), F16), Value("v", (1, 4, 64, 76), F16)
    pos, out = Value("pos", (1,), I64), Value("o", (1, 4, 1, 76), F16)
    node = Node(O.Op.KV_ATTENTION, [q, k, v, pos], [out], O.KVAttentionAttrs(0.1), name="attn76")
    ctx = _ctx({"q": 0, "k": 4096, "v": 65536, "pos": 1 << 20, "o": 2 << 20})
    with pytest.raises(LoweringError, match="attn76.*\\[1, 4, 1, 76\\]"):
        _lower_kv(ctx, node, "#1")


def _sample_node(B: int, V: int, dt: DType) -> tuple[Node, dict[str, int]]:
    names = ("lg", "seed", "ctr", "temp", "topk", "topp")
    ins = [Value("lg", (B, V), dt), Value("seed", (B,), I64), Value("ctr", (B,), I64), Value("temp", (B,), F32),
           Value("topk", (B,), I64), Value("topp", (B,), F32)]
    out = Value("ids", (B,), I64)
    base = (B * V * dt.itemsize + 255) // 256 * 256
    offsets = {n: (0 if n == "lg" else base + 256 * i) for i, n in enumerate(names)}
    offsets["ids"] = base + 256 * len(names)
    return Node(O.Op.SAMPLE, ins, [out], O.NoAttrs()), offsets


def test_lower_sample() -> None:
    node, offsets = _sample_node(2, 1000, F32)
    ctx = _ctx(offsets)
    LOWER[O.Op.SAMPLE](ctx, node, "#2 sample")
    assert len(ctx.launches) == 1 and ctx.launches[0]["grid"] == [2, 1, 1]
    assert [a[2] for a in ctx.launches[0]["args"]] == [offsets[n] for n in ("lg", "seed", "ctr", "temp", "topk",
                                                                             "topp", "ids")]


def test_lower_sample_splits_uncut_rows_over_blocks() -> None:
    node, offsets = _sample_node(1, 151936, BF16)
    ctx = _ctx(offsets)
    ctx.arena_base = 2 << 20
    LOWER[O.Op.SAMPLE](ctx, node, "#3 sample")
    assert len(ctx.launches) == 2 and ctx.launches[0]["grid"][0] >= 32 and ctx.launches[1]["grid"] == [1, 1, 1]
    part = ["ptr", "arena", 2 << 20]
    assert ctx.launches[0]["args"][-1] == ctx.launches[1]["args"][6] == part
    assert ctx.launches[1]["args"][7] == ["ptr", "arena", offsets["ids"]]


def test_lower_sample_refuses_half_precision_settings() -> None:
    node, offsets = _sample_node(2, 1000, F32)
    ins = list(node.inputs)
    ins[3] = Value("temp", (2,), BF16)
    node = Node(O.Op.SAMPLE, ins, list(node.outputs), O.NoAttrs())
    with pytest.raises(LoweringError, match="temperature/top_p must be float32"):
        LOWER[O.Op.SAMPLE](_ctx(offsets), node, "#4 sample")


def test_cache_write_with_rows_takes_its_destination_rows() -> None:
    sp = S.cache_write_spec((32, 8, 256, 128), (2, 8, 128, 128), 2, BF16, rows_dtype=I64)
    r, src = K.prepare(sp)
    assert r.params == ("new", "pos", "rows", "out") and sp.N == 2 and sp.numel_new == 2 * 8 * 128 * 128
    assert "rows[b]" in src
    plain = S.cache_write_spec((32, 8, 256, 128), (32, 8, 1, 128), 2, BF16)
    assert K.prepare(plain)[0].params == ("new", "pos", "out") and plain.N == 0
    with pytest.raises(ValueError, match="does not fit"):
        S.cache_write_spec((32, 8, 256, 128), (2, 8, 128, 128), 2, BF16)  # 2 rows into 32 without rows


def test_wide_batches_take_splits_of_at_least_64_cache_rows(monkeypatch) -> None:  # noqa: ANN001
    """Where the batch's heads alone fill a quarter of the SMs, a split covers at least 64 rows of the
    cache's capacity (Qwen3 heads, a 271-row cache: batch 8 takes 4 splits, batch 1 keeps 8); long
    caches keep their splits; the knob's 32 gives the granule's choice everywhere, and the plan's
    lowering reads it."""
    from fusec.codegen.build_decode import kv_attention_spec
    from fusec.dtypes import DType

    def splits(b: int, t: int, keys: int = 64) -> int:
        return kv_attention_spec(b, 16, 8, 1, t, 128, DType.BF16, 0.088, prefetch=True, cluster=True,
                                 split_keys=keys).splits

    assert (splits(1, 271), splits(8, 271), splits(8, 271, 32)) == (8, 4, 8)
    assert splits(1, 4096) == splits(1, 4096, 32) == 64 and splits(32, 4096) == splits(32, 4096, 32)
    assert splits(8, 64) == 1 and splits(8, 64, 32) == 2
    from fusec.compiler import compile_generation
    from fusec.errors import InputError

    monkeypatch.setenv("FUSEC_KV_SPLIT_KEYS", "0")
    with pytest.raises(InputError, match="FUSEC_KV_SPLIT_KEYS"):
        compile_generation("llama-tiny", batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90")


def test_the_plans_attention_sizes_its_splits_to_the_waves_knob(monkeypatch) -> None:  # noqa: ANN001
    """The lowering sizes a full-context step's splits for FUSEC_KV_WAVE_BLOCKS blocks an SM (4 by default): a wide
    batch (128 rows, 2 kv heads, 32-key splits allowed) takes 2 splits, and 4 with the first form's 8."""
    from fusec.compiler import compile_generation

    monkeypatch.setenv("FUSEC_KV_SPLIT_KEYS", "32")

    def grids() -> list:
        plan = compile_generation("llama-tiny", batch=128, max_seq_len=128, prefill_len=8, dtype="bf16", eos_ids=[],
                                  arch="sm_90")
        return [L["grid"] for L in plan.manifest["entries"]["decode"]["launches"] if "attention" in L["label"]]

    default = grids()
    monkeypatch.setenv("FUSEC_KV_WAVE_BLOCKS", "8")
    wide = grids()
    assert default and {g[0] for g in default} == {2} and {g[0] for g in wide} == {4}, (default, wide)


def test_key_groups_load_a_half_capacity_chunk_whole_before_the_wait(monkeypatch) -> None:  # noqa: ANN001
    """The unroll rule: 8 keys a group where a chunk at half the cache's capacity is more than the 4 a
    group loads and at most 8 (Qwen3 heads, 271-row cache: batch 8's 4 splits), else the layout's (batch 1's
    8 splits, long caches, the Llama-1B heads' 2); only where the older rows load before the wait. The
    knob forces a value, and the plan's lowering reads it."""
    from fusec.codegen.build_decode import kv_attention_spec, kv_layout
    from fusec.dtypes import DType

    def unroll(b: int, hq: int, t: int, d: int, prefetch: bool = True, forced: int = 0) -> int:
        sp = kv_attention_spec(b, hq, 8, 1, t, d, DType.BF16, 0.088, prefetch=prefetch, cluster=True, split_keys=64,
                               unroll=forced)
        return kv_layout(sp, sp.threads)["unroll"]

    assert (unroll(8, 16, 271, 128), unroll(1, 16, 271, 128)) == (8, 4)
    assert unroll(8, 16, 271, 128, prefetch=False) == 4 and unroll(8, 16, 271, 128, forced=4) == 4
    assert unroll(32, 16, 4096, 128) == unroll(1, 16, 4096, 128) == 4 and unroll(1, 32, 175, 64) == 2
    import dataclasses

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-u", num_heads=8, num_kv_heads=8, head_dim=128,
                              hidden_size=128, intermediate_size=256, num_layers=1, max_positions=512)

    def unrolls(forced: str | None) -> set[str]:
        if forced is not None:
            monkeypatch.setenv("FUSEC_KV_UNROLL", forced)
        gm = GenModel(cfg, SharedWeights(RandomWeights(7)), None, (), cfg.name)
        plan = compile_generation(gm, batch=8, max_seq_len=271, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90")
        mods = {m["id"]: m for m in plan.manifest["modules"]}
        srcs = [plan._blobs[mods[plan.manifest["kernels"][L["kernel"]]["module"]]["source"]].decode()
                for L in plan.manifest["entries"]["decode"]["launches"] if "kernel" in L]
        return {line.split()[-1] for s in srcs if "kv_attention" in s or "KV_BOUNDS" in s
                for line in s.splitlines() if line.startswith("#define U ")}

    # batch 8, 8 kv heads, 271-row cache: 4 splits of 64 keys at half capacity
    assert unrolls(None) == {"8"} and unrolls("4") == {"4"}


def test_a_cluster_merge_pushes_the_partials_into_rank_0() -> None:
    """A cluster merge (sm_90): every block stores its partials into rank 0's shared memory and counts itself in on its
    mbarrier, released after the block's stores; rank 0 alone waits and merges. The cluster's barrier only in halves
    (an arrive at the start, a wait before the first store into rank 0), none at the end."""
    from fusec.codegen.build_decode import kv_attention_spec
    from fusec.dtypes import DType

    sp = kv_attention_spec(1, 16, 8, 1, 271, 128, DType.BF16, 0.088, prefetch=True, cluster=True)
    src = K.prepare(sp)[1]
    body = src.split('extern "C"')[1]
    assert sp.cluster and "__cluster_dims__" in src
    assert "fc_mbar_arrive_cluster(fc_cluster_addr(&pu_bar, 0))" in body and "fc_mbar_wait<true>(&pu_bar, 0)" in body
    assert "fc_cluster_sync();" not in body
    assert body.index("fc_cluster_arrive_relaxed();") < body.index("fc_pdl_wait") < body.index("fc_cluster_wait();")


@pytest.mark.parametrize("hq,hkv,d,dt", [(16, 4, 256, BF16), (8, 1, 256, F32), (32, 4, 128, F32)])
def test_a_cluster_merge_leaves_its_rows_room_in_shared_memory(hq: int, hkv: int, d: int, dt) -> None:  # noqa: ANN001
    """Rank 0 holds every split's partials (8 splits of [rows, D] floats) beside the key groups' and the prologue's
    rows: the layout takes fewer query rows a tile where all of that would pass 48 KB of static shared memory (these
    shapes at 8 splits did: ptxas refused 49,544-55,688 bytes), and the kernel builds."""
    import re

    from fusec.codegen.build_decode import kv_attention_spec, kv_layout

    for heads in ((), heads_parts(1, hq, hkv, 1, 271, d, dt, True)):
        sp = kv_attention_spec(1, hq, hkv, 1, 271, d, dt, 0.1, prefetch=True, cluster=True, heads=heads)
        assert sp.cluster and sp.splits == 8
        lay = kv_layout(sp, sp.threads)
        assert lay["rows"] < min(hq // hkv, 32 // (lay["vec"] * lay["nv"]))  # fewer than the layout's own choice
        log = K.build(sp, "sm_90").binary.log
        assert int(re.search(r"(\d+) bytes smem", log).group(1)) <= 48 * 1024


@pytest.mark.parametrize("hq,hkv,d,dt,splits", [(32, 4, 128, F32, 1024), (16, 2, 64, F32, 1024), (16, 8, 128, BF16, 64)])
def test_a_global_merge_keeps_every_splits_weights_in_shared_memory(hq: int, hkv: int, d: int, dt, splits: int) -> None:  # noqa: ANN001
    """The merging block (a split merge without a cluster) holds each split's (max, sum) of each of its rows in shared
    memory, and its loads of the splits' partials are independent (no load waits on the one before it, as a loop of
    dependent loads over 64 splits did: 22.4 us of a 4,096-key batch-1 attention against 12.2 now, H200). The layout
    takes fewer query rows a tile where 1,024 splits' weights would pass 48 KB of static shared memory, and the kernel
    builds."""
    import re

    from fusec.codegen.build_decode import kv_layout

    sp = S.KVAttentionSpec(1, hq, hkv, 1, S.KV_CHUNK_GRANULE * splits, d, dt, 0.1, splits)
    lay = kv_layout(sp, sp.threads)
    rows = min(hq // hkv, 32 // (lay["vec"] * lay["nv"]))
    if splits == 1024:
        assert lay["rows"] < rows  # the merge's arrays took room from the query rows
    else:
        assert lay["rows"] == rows
    src = K.prepare(sp)[1]
    assert "__shared__ float mg_m[R][SPLITS], mg_l[R][SPLITS], mg_L[R];" in src and sp.global_merge
    # the merge's loads are not volatile asm: the compiler keeps them in flight together
    assert "m = __ldcg(ml);" in src and "const float4 v = __ldcg(po + " in src and "asm volatile(\"ld.global.cg.f32" not in src
    log = K.build(sp, "sm_80").binary.log
    assert int(re.search(r"(\d+) bytes smem", log).group(1)) <= 48 * 1024


def test_a_plans_long_cache_attention_takes_clusters_unless_the_knob_says_one_level(monkeypatch) -> None:  # noqa: ANN001
    """A batch-1 plan whose cache passes 512 rows (more than 16 splits) on sm_90: clusters of 8 (a short context merges
    in the first cluster), with the global merge's partials for a longer one; FUSEC_KV_CLUSTER_LEVELS=1 gives the
    global merge alone (no cluster dims); FUSEC_KV_SOLO_KEYS reaches the kernel. The plan's lowering reads both."""
    import dataclasses

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("llama-tiny"), max_positions=1024)
    gm = GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)

    def attention() -> tuple[list, str]:
        plan = compile_generation(gm, batch=1, max_seq_len=1024, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90")
        launch = next(L for L in plan.manifest["entries"]["decode"]["launches"] if "attention" in L["label"])
        src = next(bytes(v).decode() for k, v in plan.blobs().items()
                   if k.startswith("source/") and "fc_kvattn" in bytes(v).decode())
        return launch["grid"], src

    grid, src = attention()
    assert grid[0] % S.KV_MAX_CLUSTER == 0 and grid[0] > 2 * S.KV_MAX_CLUSTER, grid
    assert "__cluster_dims__(CL, 1, 1)" in src and f"#define CL {S.KV_MAX_CLUSTER}" in src and "((kv + GRAN - 1) / GRAN) * GRAN" not in src
    monkeypatch.setenv("FUSEC_KV_CLUSTER_LEVELS", "1")
    monkeypatch.setenv("FUSEC_KV_SOLO_KEYS", "96")
    grid1, src1 = attention()
    assert "__cluster_dims__" not in src1 and "#define CL 1 " in src1 and "kv <= 96 ?" in src1, grid1


def test_the_lowering_builds_the_attention_kernel_selection_recorded(monkeypatch) -> None:  # noqa: ANN001
    """Kernel selection decides the decode attention's form once (splits, cluster merge, keys a group, solo
    context, older rows before the wait: ``build_decode.kv_form``) and records it on the node; the lowering
    builds that kernel, whatever the FUSEC_KV_* knobs say by the time it runs."""
    from fusec.passes import select_kernels
    from fusec.passes.base import PassOptions

    def node_over(t: int) -> Node:
        q, k, v = Value("q", (1, 16, 1, 128), BF16), Value("k", (1, 8, t, 128), BF16), Value("v", (1, 8, t, 128), BF16)
        n = Node(O.Op.KV_ATTENTION, [q, k, v, Value("pos", (1,), I64)], [Value("o", (1, 16, 1, 128), BF16)],
                 O.KVAttentionAttrs(0.088), name=f"attn{t}")
        n.kernel = select_kernels._select(n, PassOptions(clusters=True), {})
        return n

    def lowered(n: Node) -> str:
        ctx = Context("sm_90", {"q": 0, "k": 1 << 20, "v": 20 << 20, "pos": 40 << 20, "o": 41 << 20}, "f32", None)
        ctx.arena_base, ctx.sync_base = 48 << 20, 4096
        LOWER[O.Op.KV_ATTENTION](ctx, n, "#1 kv_attention")
        return ctx.blobs["source/m0"].decode()

    long, short = node_over(4240), node_over(271)  # 8 keys a group, a solo context, no cluster; a cluster merge
    for n, t in ((long, 4240), (short, 271)):
        want = kv_attention_spec(1, 16, 8, 1, t, 128, BF16, 0.088, prefetch=True, cluster=True, solo_keys=128)
        assert dict(n.kernel.params) == {"splits": want.splits, "cluster": want.cluster, "unroll": want.unroll,
                                         "solo_keys": want.solo_keys, "prefetch": True}
    assert dict(long.kernel.params)["solo_keys"] == 128 and dict(short.kernel.params)["cluster"]
    monkeypatch.setenv("FUSEC_KV_SOLO_KEYS", "0")  # after selection: the records hold
    monkeypatch.setenv("FUSEC_KV_CLUSTER", "0")
    assert "kv <= 128" in lowered(long) and "__cluster_dims__(CL, 1, 1)" in lowered(short)
    again = node_over(4240), node_over(271)  # selected again: the knobs' forms
    assert dict(again[0].kernel.params)["solo_keys"] == 0 and not dict(again[1].kernel.params)["cluster"]
    assert "kv <= 128" not in lowered(again[0]) and "__cluster_dims__" not in lowered(again[1])


def test_every_decode_attention_of_a_plan_is_the_recorded_form(monkeypatch) -> None:  # noqa: ANN001
    """A form the rule would not pick, put into the record: every decode attention of a compiled plan runs it, the
    fused ones (head_rope prologue) and the join entry's alike: the lowering decides nothing."""
    import dataclasses

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights
    from fusec.passes import select_kernels

    seen = []

    def form(attn, options):  # noqa: ANN001, ANN202
        seen.append(attn.inputs[0].shape)
        return (("splits", 3), ("cluster", False), ("unroll", 2), ("solo_keys", 0), ("prefetch", False))  # 3 of 32 rows

    monkeypatch.setattr(select_kernels, "_kv_params", form)
    cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-pf", hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=64, intermediate_size=256, num_layers=2)  # head_dim 64: the fused form
    gm = GenModel(cfg, SharedWeights(RandomWeights(7)), None, (), cfg.name)
    plan = compile_generation(gm, batch=2, max_seq_len=96, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90",
                              join=1)
    man = plan.manifest
    mods = {m["id"]: m for m in man["modules"]}
    srcs = [plan._blobs[mods[man["kernels"][L["kernel"]]["module"]]["source"]].decode()
            for e in ("decode", "join") for L in man["entries"][e]["launches"] if "kernel" in L
            and mods[man["kernels"][L["kernel"]]["module"]]["template"] == "kv_attention.cu.jinja"]
    assert seen and len(srcs) >= 2 * man["generation"]["num_layers"]
    assert any("xq" in src for src in srcs)  # the fused form (its head_rope prologue) among them
    for src in srcs:
        assert "#define SPLITS 3" in src and "#define U 2" in src and "#define CL 1" in src
        assert "fc_pdl_wait_after(dep)" not in src  # no older rows before the wait: the record says so


@pytest.mark.parametrize("trigger", ["wait", "prologue", "merged", "end"])
def test_the_attention_lets_the_next_kernel_launch_where_its_record_says(trigger: str, monkeypatch) -> None:  # noqa: ANN001
    """FUSEC_KV_TRIGGER places the decode attention's PDL trigger: right after its own wait (the default, unrecorded),
    once its q rows are in (the prologue's), once its key groups are merged (before any merge of splits), or nowhere
    (the kernel's exit). Kernel selection records a placement other than the default, the plan's attention carries
    it, and it builds for sm_90 and sm_80."""
    from fusec.compiler import compile_generation

    monkeypatch.setenv("FUSEC_KV_TRIGGER", trigger)
    plan = compile_generation("llama-tiny", batch=1, max_seq_len=128, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    (src,) = {plan.blob(m["source"]).decode() for m in plan.manifest["modules"] if m["entry"].startswith("fc_kvattn")}
    body = src.split('extern "C"')[1]
    uses = body.count("fc_pdl_trigger();")
    assert uses == (0 if trigger == "end" else 1)
    if trigger == "wait":
        assert body.index("fc_pdl_wait") < body.index("fc_pdl_trigger();") < body.index("FC_TRACE_PHASE(1)")
    if trigger == "prologue":
        assert body.index("FC_TRACE_PHASE(1)") < body.index("fc_pdl_trigger();") < body.index("FC_TRACE_PHASE(2)")
    if trigger == "merged":
        assert body.index("FC_TRACE_PHASE(2)") < body.index("fc_pdl_trigger();") < body.index("FC_TRACE_PHASE(3)")
    from fusec.codegen.build_decode import kv_form

    assert kv_form(1, 16, 8, 1, 271, 128, DType.BF16, clusters=True).get("trigger", "wait") == trigger
    assert ("trigger" in kv_form(1, 16, 8, 1, 271, 128, DType.BF16)) == (trigger != "wait")
    sp = kv_attention_spec(1, 16, 8, 1, 271, 128, DType.BF16, 0.088, prefetch=True, cluster=True)
    sp = dataclasses.replace(sp, trigger=trigger)
    assert ("trigger=" in repr(sp)) == (trigger != "wait")  # the default keeps the kernels' names
    for arch in ("sm_90", "sm_80"):
        assert K.build(dataclasses.replace(sp, cluster=arch == "sm_90"), arch).binary.cubin
    with pytest.raises(ValueError, match="trigger"):
        dataclasses.replace(sp, trigger="early")


@pytest.mark.parametrize("cap", [0, 1, 2, 3])
def test_kv_max_splits_caps_the_splits_and_takes_clusters_from_two(cap, monkeypatch):
    """FUSEC_KV_MAX_SPLITS caps the rule's split count (0: the rule's own: 6 at the 7B int4 step's 32 kv heads in a
    176-row cache); 1 is one block a head without a cluster, 2 and up merge in a cluster; the plan's attention takes
    the capped count."""
    from fusec.codegen.build_decode import kv_form
    from fusec.compiler import compile_generation

    monkeypatch.setenv("FUSEC_KV_MAX_SPLITS", str(cap))
    f = kv_form(1, 32, 32, 1, 176, 128, DType.BF16, clusters=True)
    assert (f["splits"], f["cluster"]) == ((6, True) if cap == 0 else (cap, cap > 1))
    plan = compile_generation("llama-tiny", batch=1, max_seq_len=128, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    (grid,) = {tuple(L["grid"]) for L in plan.manifest["entries"]["decode"]["launches"]
               if "kernel" in L and plan.manifest["kernels"][L["kernel"]]["entry"].startswith("fc_kvattn")}
    assert grid[0] == (4 if cap == 0 else cap)  # splits are the grid's x (the rule: a 128-row cache's 4 granules)


@pytest.mark.parametrize("knob", ["0", "1", "auto"])
def test_kv_mma_knob_puts_the_key_loop_on_tensor_cores_where_it_applies(knob, monkeypatch):
    """FUSEC_KV_MMA: kernel selection's decode attention form takes the tensor-core key loop for fp16/bf16 at head_dim
    64 or 128 (never fp32 or 256): everywhere with 1, nowhere with 0, and by the rule (auto) at decode steps of at
    least 4 q heads a kv head. The plan's attention (a tiny Qwen3 at GQA 4, head_dim 64) then runs mma steps, one merge
    group a warp, and the form builds without spilling for sm_80 and sm_90."""
    import re

    from fusec.codegen.build_decode import kv_form
    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    monkeypatch.setenv("FUSEC_KV_MMA", knob)
    on = knob != "0"
    assert kv_form(1, 16, 8, 1, 271, 128, DType.BF16, clusters=True).get("mma", False) is (knob == "1")  # GQA 2
    assert kv_form(8, 32, 8, 1, 271, 64, DType.F16).get("mma", False) is on  # GQA 4
    assert kv_form(1, 32, 8, 2, 271, 64, DType.F16).get("mma", False) is (knob == "1")  # two query rows a step
    assert "mma" not in kv_form(1, 32, 8, 1, 271, 128, DType.F32)
    assert "mma" not in kv_form(1, 32, 8, 1, 99, 256, DType.BF16)
    cfg = dataclasses.replace(get_config("qwen3-tiny"), head_dim=64, num_heads=8, num_kv_heads=2)
    gm = GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)
    plan = compile_generation(gm, batch=1, max_seq_len=128, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90")
    (src,) = {bytes(plan.blob(m["source"])).decode() for m in plan.manifest["modules"]
              if m["entry"].startswith("fc_kvattn")}
    warp_groups = re.search(r"#define NGM (\d+)", src)[1] == str(int(re.search(r"#define NT (\d+)", src)[1]) // 32)
    assert ("fc_mma_k8(cf, pa" in src and warp_groups) is on  # the merge's groups: a warp each
    if knob == "1":
        for d, dt, heads in ((128, DType.BF16, True), (64, DType.F16, False)):
            parts = heads_parts(1, 16, 8, 1, 271, d, dt, True) if heads else ()
            sp = kv_attention_spec(1, 16, 8, 1, 271, d, dt, 0.1, prefetch=True, cluster=heads, heads=parts, mma=True)
            assert sp.mma and kv_layout(sp, sp.threads)["ng"] == sp.threads // 32
            for arch in ("sm_80", "sm_90"):
                if sp.cluster and arch == "sm_80":
                    continue
                log = K.build(sp, arch).binary.log
                assert re.search(r"(\d+) bytes spill stores", log).group(1) == "0", log
