"""Kernel specs of the decode step (``fusec.lower.decode``, ``fusec.codegen.build_decode``): the KV
cache write, attention over a cache (split over keys, and its combine step) and token sampling (and
its per-chunk first step). Same conventions as ``fusec.codegen.specs``, which re-exports every name here."""

from __future__ import annotations

import dataclasses
import math

from fusec.codegen.spec_base import FLOATS, _ints, _pos, _req, _softcap_ok
from fusec.dtypes import DType

POS_DTYPES = (DType.I64, DType.I32)
CACHE_DTYPES = FLOATS + POS_DTYPES
KV_CHUNK_GRANULE = 32  # split lengths of kv_attention are multiples of this many keys
KV_MAX_SPLITS = 1024  # the merging block loops over the splits
KV_MAX_CLUSTER = 8  # splits merged through a thread block cluster: the portable cluster size
KV_HEADS_SMEM = 16 * 1024  # shared memory a kv_attention prologue may keep the step's k and v rows in


def kv_heads_refusal(S: int, D: int, dtype: DType, window: int) -> str | None:
    """Why a kv_attention over S query rows a step cannot take the head_rope group as its prologue, or
    None: the step's k and v rows live in shared memory (``KV_HEADS_SMEM``), and a tile's first key is
    in its first query's window, so with more rows a step than the window the last row tile (the one
    that stores the step's rows) would skip some of them."""
    if 2 * S * D * dtype.itemsize > KV_HEADS_SMEM:
        return (f"a prologue keeps the step's k and v rows in at most {KV_HEADS_SMEM} bytes of shared memory "
                f"({S} rows of {D})")
    if window and S > window:
        return f"a prologue takes at most the window's {window} rows a step, got {S}"
    return None


@dataclasses.dataclass(frozen=True)
class CacheWriteSpec:
    """In-place write of ``new`` into a cache at a per-row offset along one axis.

    The cache is viewed [B, outer, T, inner] (contiguous), ``new`` [B, outer, S, inner]:
    ``out[b, o, pos[b] + s, i] = new[b, o, s, i]`` where 0 <= pos[b] + s < T; other writes are
    dropped and nothing else of ``out`` is touched. ``vec`` elements move per access (``inner %
    vec == 0``, 16-byte aligned pointers). Params: new, pos, out (the cache's storage).
    ``rows_dtype`` set: ``new`` has ``N`` rows, row i going to cache row ``rows[i]`` at ``pos[i]``
    (a row outside [0, B) is dropped); params new, pos, rows, out."""

    B: int
    outer: int
    T: int
    S: int
    inner: int
    dtype: DType
    pos_dtype: DType = DType.I64
    vec: int = 1
    rows_dtype: DType | None = None
    N: int = 0  # new's rows when rows_dtype is set (else B)

    def __post_init__(self) -> None:
        _pos(("B", self.B), ("outer", self.outer), ("T", self.T), ("S", self.S), ("inner", self.inner))
        _req((self.rows_dtype is None) == (self.N == 0), "cache_write: N is given with rows and only then")
        _req(self.rows_dtype in (None,) + POS_DTYPES, "cache_write: rows are int32/int64")
        _req(self.S <= self.T, f"cache_write: {self.S} new positions do not fit a cache of length {self.T}")
        _req(self.dtype in CACHE_DTYPES, f"cache_write: dtype {self.dtype!r} is not one of {CACHE_DTYPES}")
        _req(self.pos_dtype in POS_DTYPES, "cache_write: positions are int32/int64")
        _req(self.vec in (1, 2, 4, 8, 16) and self.inner % self.vec == 0, "cache_write: vec must divide inner")
        _req(self.vec * self.dtype.itemsize <= 16, "cache_write: a vector access may not exceed 16 bytes")

    @property
    def numel_new(self) -> int:
        return (self.N or self.B) * self.outer * self.S * self.inner


def cache_write_spec(cache_shape: tuple[int, ...], new_shape: tuple[int, ...], axis: int, dtype: DType,
                     pos_dtype: DType = DType.I64, vectorize: bool = True,
                     rows_dtype: DType | None = None) -> CacheWriteSpec:
    """The spec of ``Op.CACHE_WRITE`` for a cache/new pair of shapes (widest legal vector access);
    ``rows_dtype``: the write takes a destination row per row of ``new``."""
    _req(len(cache_shape) == len(new_shape) and 1 <= axis < len(cache_shape),
         f"cache_write: axis {axis} and shapes {list(cache_shape)}, {list(new_shape)} do not match")
    _req(all(a == b for i, (a, b) in enumerate(zip(cache_shape, new_shape)) if i != axis and (i or rows_dtype is None)),
         f"cache_write: new {list(new_shape)} does not fit cache {list(cache_shape)} along axis {axis}")
    outer, inner = math.prod(cache_shape[1:axis]), math.prod(cache_shape[axis + 1:])
    vec = max(1, 16 // dtype.itemsize) if vectorize else 1
    while vec > 1 and inner % vec:
        vec //= 2
    return CacheWriteSpec(cache_shape[0], outer, cache_shape[axis], new_shape[axis], inner, dtype, pos_dtype, vec,
                          rows_dtype, new_shape[0] if rows_dtype is not None else 0)


@dataclasses.dataclass(frozen=True)
class HeadRopeSpec:
    """Per head row: [RMSNorm over D] -> rotate-half RoPE -> store, optionally into a KV cache.

    x is [B, H, S, D] read through ``x_strides`` (per b, h, s; d contiguous). With ``norm``, each
    row is first normalized as ``RMSNORM`` computes it (x * rsqrt(mean(x^2) + eps), rounded to the
    storage dtype, times (w + weight_offset), rounded) before RoPE, exactly as the unfused pair
    stores and reloads it. cos/sin rows are addressed as in ``RopeSpec``. With ``cache_len`` > 0
    the row (b, h, s) is written to cache row ``pos[b] + s`` (dropped past ``cache_len``) through
    ``out_strides`` (per b, h, cache row): a cache_write fused into the same launch. One warp per
    row; D must be a multiple of 64 so that each lane holds both halves of its rotation pairs.
    Params: x, [w], cos, sin, [pos], out.
    """

    B: int
    H: int
    S: int
    D: int
    dtype: DType
    x_strides: tuple[int, int, int]
    out_strides: tuple[int, int, int]
    cs_strides: tuple[int, int]
    cs_dtype: DType
    norm: bool = False
    eps: float = 1e-6
    weight_offset: float = 0.0
    w_dtype: DType | None = None
    cache_len: int = 0
    pos_dtype: DType = DType.I64
    rotate: bool = True  # False: the rows are copied into the cache as they are (V heads beside rotated K)

    def __post_init__(self) -> None:
        _pos(("B", self.B), ("H", self.H), ("S", self.S), ("D", self.D))
        _req(self.D % 64 == 0 and self.D <= 256, f"head_rope needs D a multiple of 64 up to 256, got {self.D}")
        _req(self.rotate or (not self.norm and self.cache_len > 0), "a head_rope part that does not rotate copies "
             "its rows, without a norm, into a cache")
        _req(self.dtype in FLOATS and self.cs_dtype in FLOATS, "head_rope is float")
        _req(not self.norm or (self.w_dtype or self.dtype) in FLOATS, "the norm weight is float")
        _req(self.cache_len >= 0 and self.pos_dtype in (DType.I32, DType.I64), "cache_len >= 0, integer positions")
        _req(math.isfinite(self.eps) and self.eps >= 0, "eps must be finite and >= 0")
        _ints(self.x_strides + self.out_strides + self.cs_strides, "strides", 0)


KV_TRIGGERS = ("wait", "prologue", "merged", "end")  # KVAttentionSpec.trigger


@dataclasses.dataclass(frozen=True)
class KVAttentionSpec:
    """Attention of q [B, Hq, S, D] over KV caches k/v [B, Hkv, T, D] (all contiguous): query s of
    row b sees keys j <= pos[b] + s, j < T (a row that sees none gives 0); q head h reads kv head
    h // (Hq // Hkv). Flash-decoding: the visible keys of each (b, kv head) are cut into
    ``splits`` chunks of ceil(len / splits) keys rounded up to ``KV_CHUNK_GRANULE`` (len =
    min(T, pos[b] + S), read from device memory at run time), one block per chunk and query-row
    tile; blocks whose chunk starts past the context skip the keys, so the work follows the actual
    context, not T. ``splits == 1``: params q, k, v, pos, out. ``splits > 1``: each block writes its
    chunk's partials (``part``: ``part_floats`` fp32 values of scratch) and counts itself in
    (``sync``: ``sync_ints`` int32 counters, zero before the launch and after it); the last block
    of each (b, tile, kv head) merges the partials into ``out``: one launch either way. Params
    q, k, v, pos, part, sync, out.
    ``threads``: block size (64, 128 or 256). A context within one chunk (len <= the chunk's length, at run time)
    runs in one block a head, which writes ``out`` itself: no partials, no merge. ``softcap`` as in ``AttentionSpec`` (the partials
    hold capped scores). ``window`` > 0: query s of row b also skips keys j <= pos[b] + s - window (a
    sliding window; the key range is still cut as above: a chunk wholly outside the window
    contributes nothing to the merge, and its block loads no key). ``window`` 0 renders the kernel
    without a window, and the spec's repr (its kernel name) is the one it had before the field existed.
    ``prefetch``: pos and the first keys older than the step (rows below pos[b]) are loaded before the
    PDL wait, the rest after it; only where the kernel launched before this one writes neither pos nor
    those rows (the lowering decides from the program: ``Context.older_rows_stable``).
    ``cluster`` (sm_90): the splits of each (b, tile, kv head) are thread block clusters of up to
    ``KV_MAX_CLUSTER``, and each cluster's rank 0 merges its splits' partials from their shared memory.
    One cluster: params q, k, v, pos, out (no part, sync). More (splits a multiple of ``KV_MAX_CLUSTER``):
    a context whose keys lie in one cluster (at run time) merges there; a longer one merges every split
    through global memory as above (part, sync); a cluster past the context leaves at once.
    ``solo_keys`` (a global merge's kernel): a context of at most that many keys (at run time) is one
    chunk, so its block writes out and no merge runs.
    ``heads`` (q, k, v ``HeadRopeSpec`` parts, the head_rope kernel's: the decode step's q and k norm
    and RoPE, and the K/V cache writes, as this kernel's prologue): each block computes its tile's q
    rows and the new rows pos[b] + s its chunk reads into shared memory, and its key loop reads those rows
    there; the last row tile's block stores them to the caches after the split merge's barrier
    (``kv_heads_refusal``: what the prologue cannot take). Params xq, [wq], xk, [wk], xv, cos, sin, pos,
    out_k, out_v (the caches, written in place), [part, sync], out."""

    B: int
    Hq: int
    Hkv: int
    S: int
    T: int
    D: int
    dtype: DType
    scale: float
    splits: int = 1
    pos_dtype: DType = DType.I64
    threads: int = 128
    softcap: float = 0.0
    window: int = 0
    prefetch: bool = False
    cluster: bool = False
    heads: tuple[HeadRopeSpec, ...] = ()
    unroll: int = 0  # keys a key group loads at a time; 0: the layout's (build_decode.kv_layout)
    solo_keys: int = 0  # a global merge's kernel: a context of at most this many keys runs in one block a head
    # where each block lets the kernel after it launch (PDL): "wait", right after its own wait; "prologue", once q is
    # in (with heads: the q/k/v rows computed); "merged", once its key groups are merged; "end", not before it exits
    trigger: str = "wait"
    # the key loop on tensor cores (templates/kv_mma.jinja): fp16/bf16, D a multiple of 64; each warp takes 8-key tiles,
    # and P is rounded to the dtype before P V (build_decode.kv_mma_rule: where kernel selection takes it)
    mma: bool = False

    def __repr__(self) -> str:  # window 0, flags off, no heads, unroll 0 left out: such kernels keep their names
        fields = [f for f in dataclasses.fields(self) if not (f.name == "window" and self.window == 0)
                  and not (f.name in ("prefetch", "cluster", "heads", "unroll", "solo_keys", "mma")
                           and not getattr(self, f.name))
                  and not (f.name == "trigger" and self.trigger == "wait")]
        return f"KVAttentionSpec({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"

    def __post_init__(self) -> None:
        _pos(("B", self.B), ("Hq", self.Hq), ("Hkv", self.Hkv), ("S", self.S), ("T", self.T), ("D", self.D),
             ("splits", self.splits))
        _ints((self.window,), "kv_attention: window", 0)
        _req(isinstance(self.prefetch, bool) and isinstance(self.cluster, bool),
             "kv_attention: prefetch and cluster must be bools")
        _req(not self.cluster or 2 <= self.splits <= KV_MAX_CLUSTER or self.splits % KV_MAX_CLUSTER == 0,
             f"kv_attention: a cluster merge takes 2..{KV_MAX_CLUSTER} splits or a multiple of {KV_MAX_CLUSTER} "
             f"(clusters of {KV_MAX_CLUSTER}; a longer context merges through global memory), got {self.splits}")
        _req(self.Hq % self.Hkv == 0, "kv_attention: Hq must be a multiple of Hkv")
        _req(self.dtype in FLOATS, "kv_attention is float")
        _req(self.D % 8 == 0 and 8 <= self.D <= 256, "kv_attention: head_dim must be a multiple of 8 in [8, 256]")
        _req(math.isfinite(self.scale), "kv_attention: scale must be finite")
        _req(_softcap_ok(self.softcap), "kv_attention: softcap must be finite and >= 0 (0 = none)")
        _req(self.pos_dtype in POS_DTYPES, "kv_attention: positions are int32/int64")
        _req(self.splits <= -(-self.T // KV_CHUNK_GRANULE), f"kv_attention: {self.splits} splits exceed the "
             f"{-(-self.T // KV_CHUNK_GRANULE)} chunks of {KV_CHUNK_GRANULE} keys a cache of {self.T} has")
        _req(self.threads in (64, 128, 256), "kv_attention: threads must be 64, 128 or 256")
        _req(self.splits <= KV_MAX_SPLITS, f"kv_attention: at most {KV_MAX_SPLITS} splits")
        _ints((self.solo_keys,), "kv_attention: solo_keys", 0)
        _req(self.trigger in KV_TRIGGERS, f"kv_attention: trigger must be one of {KV_TRIGGERS}, got {self.trigger!r}")
        _req(not self.mma or (self.dtype in (DType.F16, DType.BF16) and self.D % 64 == 0),
             f"kv_attention: the tensor-core key loop takes fp16/bf16 and a head_dim multiple of 64, got "
             f"{self.dtype.value}, {self.D}")
        _req(self.unroll in (0, 1, 2, 4, 8),
             f"kv_attention: unroll must be 0 (the layout's), 1, 2, 4 or 8, got {self.unroll!r}")
        if self.heads:
            self._check_heads()

    def _check_heads(self) -> None:
        _req(len(self.heads) == 3 and all(isinstance(p, HeadRopeSpec) for p in self.heads),
             "kv_attention: heads are the (q, k, v) HeadRopeSpec parts of its prologue")
        q, k, v = self.heads
        _req((q.B, q.H, q.S, q.D, q.dtype) == (self.B, self.Hq, self.S, self.D, self.dtype) and q.rotate
             and not q.cache_len, "kv_attention: the q part rotates [B, Hq, S, D] rows of the attention's dtype")
        cache = (self.Hkv * self.T * self.D, self.T * self.D, self.D)
        for name, p, rotate in (("k", k, True), ("v", v, False)):
            _req((p.B, p.H, p.S, p.D, p.dtype, p.cache_len, p.out_strides) == (self.B, self.Hkv, self.S, self.D,
                 self.dtype, self.T, cache) and p.rotate == rotate and p.pos_dtype == self.pos_dtype,
                 f"kv_attention: the {name} part writes [B, Hkv, S, D] rows into the contiguous [B, Hkv, T, D] cache"
                 f"{' after its RoPE' if rotate else ' as they are'}, at the attention's positions")
        _req((k.cs_strides, k.cs_dtype) == (q.cs_strides, q.cs_dtype), "kv_attention: q and k share cos/sin")
        why = kv_heads_refusal(self.S, self.D, self.dtype, self.window)
        _req(why is None, f"kv_attention: {why}")

    @property
    def cluster_size(self) -> int:
        """Splits a thread block cluster holds (1: no cluster)."""
        return min(self.splits, KV_MAX_CLUSTER) if self.cluster else 1

    @property
    def global_merge(self) -> bool:
        """Whether the splits may merge through global memory (a split's partials each, then the last block):
        not for one split, nor for one cluster."""
        return self.splits > 1 and not (self.cluster and self.splits <= KV_MAX_CLUSTER)

    @property
    def part_floats(self) -> int:
        """fp32 values of the partials buffer (0 without a global merge): per (b, h, s, split) D
        unnormalized outputs, then per (b, h, s, split) the pair (max in log2 units, sum)."""
        return self.B * self.Hq * self.S * self.splits * (self.D + 2) if self.global_merge else 0

    def sync_ints(self, tiles: int) -> int:
        """int32 counters of a global merge: one per (b, tile, kv head) block column."""
        return self.B * self.Hkv * tiles if self.global_merge else 0


@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """``Op.SAMPLE`` (fusec/sampling.py defines it exactly): logits [B, V] -> token ids [B] int64,
    every row with its own settings read from device memory each launch (temperature [B] f32,
    top_k [B], top_p [B] f32, seed [B], counter [B]), so nothing about sampling is compiled in.

    One block of 1024 threads per row. A row with a top-k or top-p cut (temperature > 0 and
    0 < top_k < V or top_p < 1) finds its kept set by radix descents over the fp32 keys of
    z = x / temperature with block-wide integer histograms (deterministic; no sort), then draws by
    Gumbel-max with sampling.py's counter-based noise. Any other row is one argmax: of x (greedy:
    lowest index on ties, NaN wins as in numpy) or of z + noise (uncut sampling); with
    ``chunks`` > 1 its row is first reduced by ``part()``'s kernel, ``chunks`` blocks per row, to
    one (score, index) pair per chunk, and this kernel only merges them. So a greedy row of a
    mixed batch costs an argmax, never a cut. Params: logits, seed, counter, temperature, top_k,
    top_p, [part,] out."""

    B: int
    V: int
    dtype: DType
    seed_dtype: DType = DType.I64
    counter_dtype: DType = DType.I64
    top_k_dtype: DType = DType.I64
    chunks: int = 1  # > 1: part() reduces uncut rows over this many blocks per row first

    def __post_init__(self) -> None:
        _pos(("B", self.B), ("V", self.V), ("chunks", self.chunks))
        _req(self.B <= 2**31 - 1, "sample: at most 2**31 - 1 rows")
        # the row kernel merges one (score, index) pair per chunk: from SamplePartSpec's chunks, from the LM-head
        # product's tiles of 8 columns, or from the quantized product's warps (fusec.lower.skinny; a warp without a
        # task writes (-inf, no index): a small vocabulary may have more pairs than tokens)
        _req(self.chunks <= 65535, "sample: at most 65535 chunks per row")
        _req(self.V < 2**31, "sample: vocabulary must be < 2**31")
        _req(self.dtype in FLOATS, "sample: logits are float")
        _req(self.seed_dtype in POS_DTYPES and self.counter_dtype in POS_DTYPES,
             "sample: seed/counter are int32/int64")
        _req(self.top_k_dtype in POS_DTYPES, "sample: top_k is int32/int64")

    @property
    def part_bytes(self) -> int:
        """Scratch of split rows (``chunks > 1``): per (row, chunk) the best score and its index."""
        return 0 if self.chunks == 1 else self.B * self.chunks * 8

    def part(self) -> SamplePartSpec:
        return SamplePartSpec(self.B, self.V, self.dtype, self.seed_dtype, self.counter_dtype, self.top_k_dtype,
                              self.chunks)


@dataclasses.dataclass(frozen=True)
class SamplePartSpec:
    """First step of a split ``SampleSpec``: for every row without a cut, ``chunks`` blocks per row
    each write the best (score, index) of their chunk (score: x for a greedy row, z + noise for
    an uncut sampled row); rows with a cut are left to the SampleSpec kernel. Params: logits,
    seed, counter, temperature, top_k, top_p, part."""

    B: int
    V: int
    dtype: DType
    seed_dtype: DType
    counter_dtype: DType
    top_k_dtype: DType
    chunks: int

    def __post_init__(self) -> None:
        SampleSpec(self.B, self.V, self.dtype, self.seed_dtype, self.counter_dtype, self.top_k_dtype, self.chunks)
        _req(self.chunks >= 2, "sample_part splits a row into at least 2 chunks")
        _req(self.chunks <= self.V // 256, "sample_part: chunks of fewer than 256 tokens")
        _req(self.B <= 65535, "sample_part: at most 65535 rows (grid y)")
