"""Builders for the decode-step kernels: KV-cache write, flash-decoding attention over a KV cache
(+ its combine step), and sampling. Also the geometry choices the lowering and the benchmarks
share (``kv_attention_spec``: how many splits of the key range fill the GPU)."""

from __future__ import annotations

import math
from typing import Any

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, idx_type, kernel_name
from fusec.codegen.render import ctype, float_lit
from fusec.codegen.spec_base import SMS
from fusec.dtypes import DType

# A full-context decode step should be one wave of blocks. The kernel takes 95-114 registers a thread for D 128 bf16
# (sm_90: the prefetch, cluster and prologue forms), so 4 blocks of 128 threads fit an SM, not the 8 of its first
# form (64 registers; H100, B 32, ctx 4096: 3 splits 219 us, 5 splits 255, 9 splits 223). Alone on an H200 (Qwen3's
# heads, B 32, cache 4096, benchmarks/bench_decode_kernels.py --only kv, twenty-sixth session): with the cluster
# merge and prefetch 2 splits (512 blocks) took 125.4 us at a 4,096-key context against 153.4 with 4 (the rule at 8
# blocks an SM), and 6.56 against 10.69 at 128 keys; without them 130.1 against 133.6, and at B 8 8 splits 40.1
# against 16's 44.4. FUSEC_KV_WAVE_BLOCKS=8 gives the first form's wave (kernel selection reads it: kv_form).
KV_WAVE_BLOCKS = 4
KV_TARGET_BLOCKS = KV_WAVE_BLOCKS * SMS
# The default combine step loops over the splits per output column: beyond ~64 splits it costs
# more than the extra parallelism brings (B 1, ctx 4096: 64 splits 24 us, 128 splits 32 us).
KV_MAX_AUTO_SPLITS = 64
_SMEM_LIMIT = 48 * 1024  # static shared memory per block
_MAX_GRID = 1 << 20


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kv_smem(spec: S.KVAttentionSpec, ng: int, r: int) -> int:
    """The kernel's static shared memory at ``r`` query rows a tile: the key groups' partials (red_*), with a cluster
    merge every split's partials in rank 0 (pu_*), with a global merge every split's (max, sum) and the shares of the
    merging block's sums (mg_*), with the head_rope prologue the tile's q rows and the step's k/v rows."""
    nbytes = ng * r * (spec.D + 2) * 4
    if spec.cluster:
        nbytes += spec.cluster_size * r * (spec.D + 2) * 4 + 8
    if spec.global_merge:
        nbytes += (2 * spec.splits + 1) * r * 4 + spec.threads * 16
    if spec.heads:
        nbytes += (r + 2 * spec.S) * spec.D * spec.dtype.itemsize
    return nbytes


def kv_layout(spec: S.KVAttentionSpec, threads: int = 128) -> dict[str, int]:
    """Thread layout of the split attention kernel: 16-byte slices of D per lane (``vec``
    elements), ``lpk`` lanes per key, ``nv`` slices per lane, ``rows`` query rows per tile (as many as
    the kernel's static shared memory leaves room for: ``_kv_smem``)."""
    vec = 16 // spec.dtype.itemsize
    nvec = spec.D // vec
    lpk = min(32, _pow2_ceil(nvec))
    nv = cdiv(nvec, lpk)
    ng = threads // 32 if spec.mma else threads // lpk  # the merge's groups: a warp each in the tensor-core form
    rows_all = spec.Hq // spec.Hkv * spec.S
    r = min(rows_all, max(1, 32 // (vec * nv)))
    while r > 1 and _kv_smem(spec, ng, r) > _SMEM_LIMIT:
        r -= 1
    unroll = spec.unroll or (4 if r * vec * nv <= 16 else 2)
    return {"vec": vec, "nvec": nvec, "lpk": lpk, "nv": nv, "ng": ng, "rows": r,
            "tiles": cdiv(rows_all, r), "unroll": unroll}


def chunk_max(T: int, splits: int) -> int:
    return cdiv(cdiv(T, splits), S.KV_CHUNK_GRANULE) * S.KV_CHUNK_GRANULE


def kv_attention_spec(B: int, Hq: int, Hkv: int, S_: int, T: int, D: int, dtype: DType, scale: float,
                      pos_dtype: DType = DType.I64, target_blocks: int = KV_TARGET_BLOCKS,
                      threads: int = 128, max_splits: int = KV_MAX_AUTO_SPLITS,
                      softcap: float = 0.0, window: int = 0, prefetch: bool = False,
                      cluster: bool = False, split_keys: int = S.KV_CHUNK_GRANULE,
                      heads: tuple[S.HeadRopeSpec, ...] = (), unroll: int = 0,
                      cluster_levels: int = 2, solo_keys: int = 0, mma: bool = False) -> S.KVAttentionSpec:
    """The spec for a KV attention: as many splits of the key range as keep a full-context step
    within ``target_blocks`` blocks (one wave), at most ``max_splits``: batch 1 with a long
    context still spreads over the SMs, a large batch is not cut into a wave and a tail.
    ``cluster`` (sm_90 only; the caller checks): where that gives 2 to 2 * KV_MAX_CLUSTER splits,
    at most KV_MAX_CLUSTER of them merged through a thread block cluster (no counter, no partials
    in global memory); more splits (a long cache needs its blocks), with ``cluster_levels`` 2, a
    multiple of KV_MAX_CLUSTER in clusters: a context whose keys lie in the first cluster (at run
    time) merges there, a longer one through global memory. Alone on an H200 (batch 1, Qwen3's heads,
    128 keys): 3.90 us in a 272-row cache's one cluster against 5.8-6.1 with the global merge of a
    1,024- or 4,096-row cache's 32-64 splits, and the Qwen3-0.6B step at 128 tokens in a 4,096-row
    cache 0.572 ms against 0.635 (merging each cluster first, then the clusters, had cost 1.8 us
    more alone at 4,096 keys). Not where the splits take 8 keys a group (below).
    Where the batch's (row, kv head, tile) blocks alone fill a quarter of the SMs, a split covers at
    least ``split_keys`` rows of the cache's capacity T (fewer keep the 32-row granule). Measured on an
    H200 (Qwen3-0.6B, 271-row cache, plans in turns): batch 8 took 0.847 ms a step with 4 splits (64
    rows) against 0.924 with 8; batch 1 (8 blocks a split) took 0.763 with 8 against 0.789 with 4.
    ``solo_keys`` (a decode step's, where the splits merge through global memory): a context of at most that many
    keys runs in one block a head, with no merge (alone on an H200, batch 1, 128 keys: 4.70 us against 5.8-6.0 merged).
    ``heads``: the q/k/v head_rope parts of its prologue (``KVAttentionSpec.heads``). ``unroll``: keys a
    key group loads at a time; 0 takes 8 where the older rows load before the PDL wait (``prefetch``) and a
    chunk at half the cache's capacity is more than 4 a group load and at most 8 (so they load whole
    before the wait), else the layout's. ``mma``: the key loop on tensor cores where it applies (fp16/bf16, D 64 or
    128: ``kv_mma_applies``). Measured on an H200 (Qwen3-0.6B, 271-row cache, plans in turns):
    batch 8 (4 splits, 64-key chunks) took 0.790 ms a step with 8 against 0.827 with 4; batch 1 (8 splits,
    32-key chunks: the rule keeps 4) took 0.777 with 8 against 0.760 with 4."""
    mma = mma and kv_mma_applies(dtype, D)
    probe = S.KVAttentionSpec(B, Hq, Hkv, S_, T, D, dtype, scale, 1, pos_dtype, threads, softcap, mma=mma)
    lay = kv_layout(probe, threads)
    per_split = B * Hkv * lay["tiles"]
    if per_split < SMS // 4 or split_keys <= S.KV_CHUNK_GRANULE:
        by_keys = cdiv(T, S.KV_CHUNK_GRANULE)
    else:
        by_keys = T // split_keys
    splits = max(1, min(target_blocks // per_split, by_keys, max_splits, S.KV_MAX_SPLITS))

    def keys_a_group(n: int) -> int:
        if unroll or not prefetch or lay["unroll"] != 4:
            return unroll
        # a chunk at half the cache's capacity (a step's typical context) that 4 keys a group leave to a
        # second, dependent batch and 8 load whole before the wait: 8. Even where that form's 160-193 registers
        # make two waves (batch 1, a 4,240-row cache's 64 splits: 15.1 us alone against 11.9 at 4), it was the
        # faster in the step (Qwen3-0.6B at 4,096 tokens, H200: 0.852 ms against 0.889): its first wave's keys
        # load before the PDL wait
        half = cdiv(cdiv(max(1, T // 2), n), S.KV_CHUNK_GRANULE) * S.KV_CHUNK_GRANULE
        return 8 if lay["ng"] * 4 < half <= lay["ng"] * 8 else unroll

    use_cluster = cluster and 2 <= splits
    if use_cluster and splits <= 2 * S.KV_MAX_CLUSTER:
        splits = min(splits, S.KV_MAX_CLUSTER)
    elif use_cluster:
        # not at 8 keys a group: clusters of 8 there (189 registers, two waves) made the Qwen3-0.6B step at 4,096
        # tokens in a 4,240-row cache 0.967 ms against 0.852 through global memory
        whole = splits // S.KV_MAX_CLUSTER * S.KV_MAX_CLUSTER
        use_cluster = cluster_levels == 2 and keys_a_group(whole) != 8
        splits = whole if use_cluster else splits
    unroll = keys_a_group(splits)
    solo = solo_keys if splits > 1 and not use_cluster and S_ == 1 else 0  # decode steps (S > 1 spilled 12 bytes)
    return S.KVAttentionSpec(B, Hq, Hkv, S_, T, D, dtype, scale, splits, pos_dtype, threads, softcap, window, prefetch,
                             use_cluster, heads, unroll, solo, mma=mma)


def kv_mma_applies(dtype: DType, D: int) -> bool:
    """Whether the decode attention's key loop can run on tensor cores (templates/kv_mma.jinja)."""
    return dtype in (DType.F16, DType.BF16) and D in (64, 128)  # D 256 spilled (255 registers)


# The rule for the tensor-core key loop: decode steps whose tile holds at least this many query rows (q heads a kv
# head). The SIMT loop's work a key grows with the rows (a dot and a shuffle reduction each); an mma step's does not,
# up to 8. Measured on an H200, in turns, ms a step (fortieth session): GQA 4 (the Llama-1B shape, context 32) Q4_K_M
# batch 1 0.440-0.444 against 0.449-0.450, batch 8 0.860 against 0.876, bf16 0.751 against 0.759; GQA 2 (Qwen3-0.6B,
# context 128) batch 1 0.553-0.566 against 0.550-0.551, batch 8 0.751 against 0.724; GQA 1 (the 7B int4 shape) 1.3175
# against 1.3124. The key loop's ~1 us at batch 1 is mostly the keys' load latency, which neither form changes.
KV_MMA_MIN_ROWS = 4


def kv_mma_rule(Hq: int, Hkv: int, S_: int) -> bool:
    """Kernel selection's choice of the tensor-core key loop (FUSEC_KV_MMA=auto), where it applies."""
    return S_ == 1 and Hq // Hkv >= KV_MMA_MIN_ROWS


def kv_form(B: int, Hq: int, Hkv: int, S_: int, T: int, D: int, dtype: DType, pos_dtype: DType = DType.I64,
            softcap: float = 0.0, clusters: bool = False) -> dict[str, Any]:
    """Kernel selection's decode attention form at q [B, Hq, S_, D] over a [B, Hkv, T, D] cache: the split
    count, the cluster merge (``clusters``: the target has them), keys a key group, the solo context and
    whether the older rows load before the PDL wait (where the lowering finds the task before it leaves them
    alone). ``kv_attention_spec`` is the rule; the decode attention's knobs in ``fusec.knobs`` are its A/Bs."""
    from fusec import knobs

    prefetch = bool(knobs.get("FUSEC_KV_PREFETCH"))
    wave = int(knobs.get("FUSEC_KV_WAVE_BLOCKS")) * SMS  # blocks of a full-context step: one wave
    spec = kv_attention_spec(B, Hq, Hkv, S_, T, D, dtype, 1.0, pos_dtype, wave, softcap=softcap, prefetch=prefetch,
                             cluster=bool(knobs.get("FUSEC_KV_CLUSTER")) and clusters,
                             cluster_levels=int(knobs.get("FUSEC_KV_CLUSTER_LEVELS")),
                             solo_keys=knobs.get("FUSEC_KV_SOLO_KEYS"), split_keys=knobs.get("FUSEC_KV_SPLIT_KEYS"),
                             unroll=int(knobs.get("FUSEC_KV_UNROLL")),
                             max_splits=int(knobs.get("FUSEC_KV_MAX_SPLITS")) or KV_MAX_AUTO_SPLITS,
                             mma={"auto": kv_mma_rule(Hq, Hkv, S_), "1": True, "0": False}[knobs.get("FUSEC_KV_MMA")])
    trigger = knobs.get("FUSEC_KV_TRIGGER")
    return ({"splits": spec.splits, "cluster": spec.cluster, "unroll": spec.unroll, "solo_keys": spec.solo_keys,
             "prefetch": prefetch} | ({"trigger": trigger} if trigger != "wait" else {})
            | ({"mma": True} if spec.mma else {}))


@builder(S.KVAttentionSpec)
def _kv_attention(spec: S.KVAttentionSpec) -> Rendered:
    lay = kv_layout(spec, spec.threads)
    grid = (spec.splits, spec.Hkv * lay["tiles"], spec.B)
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"kv_attention grid {grid} exceeds the y/z launch limits (S={spec.S} too long?)")
    ctx = {
        "name": kernel_name("kvattn", spec), "D": spec.D, "S": spec.S, "T": spec.T, "Hq": spec.Hq,
        "Hkv": spec.Hkv, "group": spec.Hq // spec.Hkv, "R": lay["rows"], "threads": spec.threads,
        "vec": lay["vec"], "lpk": lay["lpk"], "nv": lay["nv"], "ng": lay["ng"], "unroll": lay["unroll"],
        "splits": spec.splits,
        "gran": S.KV_CHUNK_GRANULE, "chunk_max": chunk_max(spec.T, spec.splits),
        "b_rows": spec.B * spec.Hq * spec.S, "t": ctype(spec.dtype), "pos_t": ctype(spec.pos_dtype),
        "scale_log2": float_lit(spec.scale * math.log2(math.e), "scale"),
        # the scores are in log2 units: cap * tanh(s / cap) there is cap2 * tanh(s2 / cap2), cap2 = cap * log2(e)
        "softcap_log2": float_lit(spec.softcap * math.log2(math.e), "softcap") if spec.softcap else None,
        "window": spec.window,  # 0: the template renders no window code
        "prefetch": spec.prefetch, "cluster": spec.cluster, "cl": spec.cluster_size,
        "gmerge": spec.global_merge,
        "solo_keys": spec.solo_keys, "mma": spec.mma,
        "trigger_wait": spec.trigger == "wait", "trigger_merged": spec.trigger == "merged",  # else at exit
        "trigger_prologue": spec.trigger == "prologue",
        # ptxas caps registers oddly (and spills) when D / vec is no power of two, and with several query rows a
        # step (S > 1: 4 bytes at 128 registers, f32 with the head_rope prologue); lift the cap there
        "min_blocks": 1 if lay["nvec"] & (lay["nvec"] - 1) or spec.S > 1 else 0,
    }
    ctx["heads"] = _heads_ctx(spec) if spec.heads else None
    merge = ("part", "sync") if spec.global_merge else ()
    if spec.heads:  # the prologue reads the product's rows and writes the caches
        q, k, _ = spec.heads
        ins = ("xq",) + (("wq",) if q.norm else ()) + ("xk",) + (("wk",) if k.norm else ()) + ("xv", "cos", "sin")
        params = ins + ("pos", "out_k", "out_v") + merge + ("out",)
    else:
        params = ("q", "k", "v", "pos") + merge + ("out",)
    return Rendered("kv_attention.cu.jinja", ctx, grid, (spec.threads, 1, 1), params)


def _heads_ctx(spec: S.KVAttentionSpec) -> dict[str, object]:
    """What the kv_attention template's prologue needs of the q/k/v head_rope parts (head_rope_row.jinja)."""
    q, k, v = spec.heads
    extent = max(sum((n - 1) * st for n, st in zip((p.B, p.H, p.S), p.x_strides)) + p.D for p in spec.heads)
    return {"cs_t": ctype(q.cs_dtype), "cs": q.cs_strides, "per_lane": q.D // 32, "half_k": q.D // 64,
            "idx_t": idx_type(extent, spec.B * spec.Hkv * spec.T * spec.D),
            "parts": [{"xs": p.x_strides, "norm": p.norm, "w_t": ctype(p.w_dtype or p.dtype), "eps": float_lit(p.eps),
                       "weight_offset": float_lit(p.weight_offset), "rotate": p.rotate} for p in (q, k, v)]}


@builder(S.CacheWriteSpec)
def _cache_write(spec: S.CacheWriteSpec) -> Rendered:
    total = spec.numel_new // spec.vec
    block = 256
    extent = spec.B * spec.outer * spec.T * spec.inner
    ctx = {
        "name": kernel_name("cachew", spec), "B": spec.B, "outer": spec.outer, "T": spec.T, "S": spec.S,
        "inner": spec.inner, "vec": spec.vec, "total": total, "t": ctype(spec.dtype),
        "pos_t": ctype(spec.pos_dtype), "idx_t": idx_type(max(extent, spec.numel_new) + block), "block": block,
        "rows_t": ctype(spec.rows_dtype) if spec.rows_dtype is not None else None,
    }
    return Rendered("cache_write.cu.jinja", ctx, (max(1, min(cdiv(total, block), _MAX_GRID)), 1, 1), (block, 1, 1),
                    ("new", "pos", "rows", "out") if spec.rows_dtype is not None else ("new", "pos", "out"))


SAMPLE_THREADS = 1024  # the row kernel: the radix descents' histograms are 2048 bins, two per thread


def _sample_ctx(spec: S.SampleSpec | S.SamplePartSpec, name: str) -> dict[str, object]:
    vec = 16 // spec.dtype.itemsize
    while spec.V % vec:
        vec //= 2
    return {"name": name, "V": spec.V, "vec": vec, "chunks": spec.chunks, "t": ctype(spec.dtype),
            "seed_t": ctype(spec.seed_dtype), "ctr_t": ctype(spec.counter_dtype), "k_t": ctype(spec.top_k_dtype)}


_SAMPLE_PARAMS = ("logits", "seed", "counter", "temperature", "top_k", "top_p")


@builder(S.SampleSpec)
def _sample(spec: S.SampleSpec) -> Rendered:
    ctx = _sample_ctx(spec, kernel_name("sample", spec))
    ctx["threads"] = SAMPLE_THREADS
    params = _SAMPLE_PARAMS + (("best_in",) if spec.chunks > 1 else ()) + ("out",)  # the chunks' pairs, read
    return Rendered("sample.cu.jinja", ctx, (spec.B, 1, 1), (SAMPLE_THREADS, 1, 1), params)


@builder(S.SamplePartSpec)
def _sample_part(spec: S.SamplePartSpec) -> Rendered:
    ctx = _sample_ctx(spec, kernel_name("samplep", spec))
    per_block = cdiv(spec.V // int(ctx["vec"]), spec.chunks)  # vectors of a row one block reads
    ctx["threads"] = threads = min(1024, max(32, cdiv(cdiv(per_block, 4), 32) * 32))
    return Rendered("sample_part.cu.jinja", ctx, (spec.chunks, spec.B, 1), (threads, 1, 1), _SAMPLE_PARAMS + ("part",))


SAMPLE_TARGET_BLOCKS = 2 * SMS


def sample_spec(B: int, V: int, dtype: DType, seed_dtype: DType = DType.I64, counter_dtype: DType = DType.I64,
                top_k_dtype: DType = DType.I64, target_blocks: int = SAMPLE_TARGET_BLOCKS) -> S.SampleSpec:
    """The spec for ``Op.SAMPLE``: rows without a cut (greedy, plain sampling) are split over
    enough blocks (chunks of >= 2048 tokens) that a small batch still uses the whole GPU; a row
    with a top-k/top-p cut needs row-wide histograms and runs in one block."""
    chunks = max(1, min(cdiv(target_blocks, B), V // 2048)) if B <= 65535 else 1
    return S.SampleSpec(B, V, dtype, seed_dtype, counter_dtype, top_k_dtype, chunks)
