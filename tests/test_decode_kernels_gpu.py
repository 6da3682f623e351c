"""Decode-step kernels against fusec.reference / fusec.sampling on the GPU (skipped without one).

Fresh random data each run; outputs poisoned before each launch; caches pre-filled with random
data so that a write outside the new positions shows. Tolerances ||out - ref|| / ||ref||: fp32
1e-5, fp16 2e-3, bf16 1e-2 (references in fp32 from the same rounded inputs)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fusec import ops as O
from fusec import reference as R
from fusec import sampling as SM
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_decode import kv_attention_spec, sample_spec
from fusec.dtypes import DType

pytestmark = pytest.mark.gpu

F16, BF16, F32, I64, I32 = DType.F16, DType.BF16, DType.F32, DType.I64, DType.I32
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}
FLOATS = [F32, F16, BF16]
RNG = np.random.default_rng(20261123)


def rand(shape: tuple[int, ...], dt: DType, scale: float = 1.0) -> np.ndarray:
    if dt.is_float:
        x = RNG.standard_normal(size=shape) * scale
        x = np.where(np.abs(x) < 1e-3, 0.5, x)
        return x.astype(np.float32).astype(dt.np)
    return RNG.integers(-(1 << 40), 1 << 40, size=shape).astype(dt.np)


def dev(x: np.ndarray):  # noqa: ANN201
    import cupy as cp

    x = np.ascontiguousarray(x)
    return cp.asarray(x.view(np.uint16) if x.dtype == BF16.np else x)


def host(x, dt: DType) -> np.ndarray:  # noqa: ANN001
    a = x.get()
    return a.view(BF16.np) if dt == BF16 else a


def poisoned(shape: tuple[int, ...], dt: DType):  # noqa: ANN201
    import cupy as cp

    if dt == BF16:
        return cp.full(shape, 0x7FC0, dtype=np.uint16)
    if dt.is_float:
        return cp.full(shape, np.nan, dtype=dt.np)
    return cp.full(shape, -0x5555555555555556, dtype=np.int64).astype(dt.np)


def run(spec: object, args: list) -> None:  # noqa: ANN001
    import cupy as cp

    K.launch(K.build(spec), args)
    cp.cuda.runtime.deviceSynchronize()


def run_kv_attention(spec: S.KVAttentionSpec, args: list, out) -> None:  # noqa: ANN001
    """Launch a kv_attention spec on device ``args`` (q, k, v, pos) into ``out``: one launch; a split
    one (partials merged by its last block) three times, bit-identical each time, its counters back
    at zero after each."""
    import cupy as cp

    if not spec.global_merge:  # one split, or one cluster: no partials in global memory
        run(spec, args + [out])
        return
    from fusec.codegen.build_decode import kv_layout

    part = cp.full(spec.part_floats, np.nan, dtype=np.float32)  # chunks never reached stay NaN
    sync = cp.zeros(spec.sync_ints(kv_layout(spec, spec.threads)["tiles"]), dtype=np.int32)
    first = None
    for _ in range(3):
        out[...] = out.dtype.type(0)
        run(spec, args + [part, sync, out])
        assert int(cp.count_nonzero(sync)) == 0, "a split attention left its counters set"
        got = out.get()
        if first is None:
            first = got
        else:  # whichever block merges, the same bits
            assert np.array_equal(got.view(np.uint8), first.view(np.uint8)), "a split attention is not deterministic"


def check(out: np.ndarray, ref: np.ndarray, dt: DType) -> None:
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert o.shape == r.shape
    assert not np.isnan(o).any(), f"{int(np.isnan(o).sum())} outputs never written (NaN)"
    err = float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30))
    assert err <= TOL[dt], f"relative error {err:.3e} > {TOL[dt]:.0e}"


# ---- cache_write ---------------------------------------------------------------------------------

CW = [
    # dt, cache shape, axis, S, positions (None: random valid)
    (BF16, (3, 2, 37, 64), 2, 1, [0, 36, 17]),            # decode: pos 0 and pos T-1
    (F16, (8, 8, 64, 128), 2, 1, None),
    (F32, (1, 3, 20, 40), 2, 7, [16]),                      # prefill crossing the end: 3 dropped
    (BF16, (2, 4, 33, 24), 2, 5, [0, 40]),                  # a row wholly past the end
    (F16, (2, 3, 5, 7, 6), 3, 2, [5, 1]),                   # odd inner (no vectors), rank 5
    (I64, (3, 50), 1, 1, [0, 49, 7]),                       # token buffer
    (I32, (2, 9, 4), 1, 3, [6, 0]),
]


@pytest.mark.parametrize("dt,shape,axis,Sn,positions", CW, ids=[f"{c[0].value}-{'x'.join(map(str, c[1]))}-S{c[3]}" for c in CW])
@pytest.mark.parametrize("pos_dt", [I64, I32])
def test_cache_write(dt: DType, shape: tuple, axis: int, Sn: int, positions: list | None, pos_dt: DType) -> None:
    B, T = shape[0], shape[axis]
    new_shape = tuple(Sn if i == axis else d for i, d in enumerate(shape))
    cache, new = rand(shape, dt), rand(new_shape, dt)
    pos = np.array(positions if positions is not None else RNG.integers(0, T - Sn + 1, size=B), dtype=pos_dt.np)
    ref = R.IMPL[O.Op.CACHE_WRITE](O.CacheWriteAttrs(axis), cache, new, pos)
    for vectorize in (True, False):
        buf = dev(cache)  # random "old" contents: anything the kernel touches outside the new rows shows
        spec = S.cache_write_spec(shape, new_shape, axis, dt, pos_dt, vectorize=vectorize)
        run(spec, [dev(new), dev(pos), buf])
        got = host(buf, dt)
        assert got.tobytes() == np.ascontiguousarray(ref).tobytes(), f"vec={spec.vec}: cache differs from the reference"


@pytest.mark.parametrize("dt", [BF16, F32])
def test_cache_write_rows(dt: DType) -> None:
    """Rows of new go to their destination rows; past the cache's end and outside it: dropped."""
    shape, new_shape = (5, 4, 40, 64), (3, 4, 16, 64)
    cache, new = rand(shape, dt), rand(new_shape, dt)
    pos = np.array([0, 30, 7], np.int64)  # the second row runs past T: 10 of its 16 positions land
    rows = np.array([4, 1, 9], np.int64)  # the third row is outside the cache: dropped
    ref = R.IMPL[O.Op.CACHE_WRITE](O.CacheWriteAttrs(2), cache, new, pos, rows)
    buf = dev(cache)
    run(S.cache_write_spec(shape, new_shape, 2, dt, rows_dtype=DType.I64), [dev(new), dev(pos), dev(rows), buf])
    assert host(buf, dt).tobytes() == np.ascontiguousarray(ref).tobytes()


# ---- kv_attention ------------------------------------------------------------------------------

def kv_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray, scale: float) -> np.ndarray:
    f = lambda a: a.astype(np.float32)
    return R.IMPL[O.Op.KV_ATTENTION](O.KVAttentionAttrs(scale), f(q), f(k), f(v), pos)


KV = [
    # dt, B, Hq, Hkv, S, T, D, positions (None: random), splits (None: auto)
    (BF16, 1, 16, 8, 1, 4096, 128, [4095], None),         # Qwen3-0.6B, full cache
    (BF16, 3, 16, 8, 1, 300, 128, [0, 299, 131], None),   # pos 0 and pos T-1
    (F16, 8, 9, 3, 1, 257, 64, None, None),                # SmolLM2: GQA 3, odd T
    (F32, 3, 4, 4, 1, 77, 64, [5, 76, 0], None),           # GQA 1
    (BF16, 2, 32, 4, 1, 130, 128, [129, 64], None),        # GQA 8: two row tiles
    (F16, 2, 8, 2, 1, 100, 256, [99, 3], 4),               # D 256
    (BF16, 2, 6, 3, 1, 70, 80, [69, 33], 3),               # D 80: idle lanes
    (F32, 1, 2, 1, 1, 40, 32, [39], 1),                    # one split: one launch
    (BF16, 2, 4, 2, 5, 64, 64, [0, 59], None),             # S > 1 (prefill onto a cache): per-row causal
    (F16, 3, 6, 2, 9, 50, 128, [45, 0, 20], 2),            # S > 1, the last queries run past T
    (F32, 2, 4, 2, 2, 64, 64, [-1, 10], 2),                # pos -1: query 0 of row 0 sees nothing -> 0
    (BF16, 1, 16, 8, 1, 4096, 128, [127], 64),             # short context in a long cache, forced splits
    (BF16, 32, 16, 8, 1, 512, 128, None, None),
    (F16, 1, 4, 1, 1, 12000, 64, [11999], 300),          # 300 splits: several per combine thread
    (F32, 2, 2, 2, 3, 9000, 24, [8990, 4000], 200),       # D 24: idle combine lanes, S > 1
]


@pytest.mark.parametrize("mode", ["", "prefetch", "cluster", "clusters", "unroll8", "solo", "mma", "mma_prefetch",
                                  "mma_cluster"])
@pytest.mark.parametrize("dt,B,Hq,Hkv,Sq,T,D,positions,splits", KV,
                         ids=[f"{c[0].value}-B{c[1]}-H{c[2]}/{c[3]}-S{c[4]}-T{c[5]}-D{c[6]}-x{c[8]}" for c in KV])
def test_kv_attention(dt: DType, B: int, Hq: int, Hkv: int, Sq: int, T: int, D: int, positions: list | None,
                      splits: int | None, mode: str) -> None:
    scale = 1.0 / math.sqrt(D)
    q, k, v = rand((B, Hq, Sq, D), dt), rand((B, Hkv, T, D), dt), rand((B, Hkv, T, D), dt)
    pos = np.array(positions if positions is not None else RNG.integers(0, T, size=B), np.int64)
    if splits is None:
        spec = kv_attention_spec(B, Hq, Hkv, Sq, T, D, dt, scale)
    else:
        spec = S.KVAttentionSpec(B, Hq, Hkv, Sq, T, D, dt, scale, splits)
    if mode == "prefetch":  # keys loaded before the PDL wait: the same result
        spec = dataclasses.replace(spec, prefetch=True)
    if mode == "unroll8":  # twice the keys in flight a key group, and before the wait
        spec = dataclasses.replace(spec, prefetch=True, unroll=8)
    if mode.startswith("mma"):  # the key loop on tensor cores (8-key tiles a warp, P rounded to the dtype)
        from fusec.codegen.build_decode import kv_mma_applies

        if not kv_mma_applies(dt, D):
            pytest.skip("the tensor-core key loop takes fp16/bf16 and a head_dim of 64 or 128")
        spec = dataclasses.replace(spec, mma=True, prefetch=mode == "mma_prefetch")
        mode = mode.removeprefix("mma_")
    if mode == "cluster":  # 2..8 splits merged through a thread block cluster (sm_90)
        from fusec.device import gpu_arch

        if int(gpu_arch()[3:]) < 90:
            pytest.skip("thread block clusters need sm_90")
        spec = dataclasses.replace(spec, splits=min(max(spec.splits, 2), S.KV_MAX_CLUSTER), cluster=True)
    if mode == "solo":  # a context of at most 128 keys in one block a head, a longer one split and merged
        if spec.splits == 1 or Sq > 1:
            pytest.skip("one split (no merge to leave out), or S > 1 (the rule takes decode steps only)")
        spec = dataclasses.replace(spec, solo_keys=128)
    if mode == "clusters":  # clusters of 8 splits, merged over the clusters through global memory (sm_90)
        from fusec.device import gpu_arch

        if int(gpu_arch()[3:]) < 90:
            pytest.skip("thread block clusters need sm_90")
        n = min(128, -(-T // S.KV_CHUNK_GRANULE)) // S.KV_MAX_CLUSTER * S.KV_MAX_CLUSTER
        if n < 2 * S.KV_MAX_CLUSTER:
            pytest.skip("fewer than 16 chunks: one cluster")
        spec = dataclasses.replace(spec, splits=n, cluster=True, prefetch=True)
    ref = kv_ref(q, k, v, pos, scale)

    # keys past each row's context hold NaN: reading any of them would poison the output
    kn, vn = k.copy(), v.copy()
    for b in range(B):
        kn[b, :, max(0, pos[b] + Sq):] = np.nan
        vn[b, :, max(0, pos[b] + Sq):] = np.nan
    out = poisoned((B, Hq, Sq, D), dt)
    run_kv_attention(spec, [dev(q), dev(kn), dev(vn), dev(pos)], out)
    check(host(out, dt), ref, dt)


@pytest.mark.parametrize("dt", FLOATS)
def test_kv_attention_matches_for_every_split_count(dt: DType) -> None:
    B, Hq, Hkv, T, D = 2, 8, 4, 256, 64
    q, k, v = rand((B, Hq, 1, D), dt), rand((B, Hkv, T, D), dt), rand((B, Hkv, T, D), dt)
    pos = np.array([255, 100], np.int64)
    ref = kv_ref(q, k, v, pos, 0.125)

    for splits in (1, 2, 3, 5, 8):
        spec = S.KVAttentionSpec(B, Hq, Hkv, 1, T, D, dt, 0.125, splits, I32, threads=256 if splits == 3 else 128)
        out = poisoned((B, Hq, 1, D), dt)
        run_kv_attention(spec, [dev(q), dev(k), dev(v), dev(pos.astype(np.int32))], out)
        check(host(out, dt), ref, dt)


# ---- sample --------------------------------------------------------------------------------------

def run_sample(spec: S.SampleSpec, logits: np.ndarray, seed, counter: np.ndarray, temperature=0.0, top_k=0,
               top_p=1.0) -> np.ndarray:
    """The kernel(s) of ``spec`` over logits with per-row settings (scalars stand for every row)."""
    import cupy as cp

    B = spec.B

    def rows(v, dtype) -> np.ndarray:  # noqa: ANN001
        return np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype).reshape(-1), (B,)))

    out = cp.full(B, -7, dtype=np.int64)
    args = [dev(logits), dev(rows(seed, np.int64).astype(spec.seed_dtype.np)),
            dev(counter.astype(spec.counter_dtype.np)), dev(rows(temperature, np.float32)),
            dev(rows(top_k, np.int64).astype(spec.top_k_dtype.np)), dev(rows(top_p, np.float32))]
    if spec.chunks == 1:
        run(spec, args + [out])
    else:
        part = cp.full(spec.part_bytes // 4, np.nan, dtype=np.float32)
        run(spec.part(), args + [part])
        run(spec, args + [part, out])
    return out.get()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("B,V", [(1, 151936), (3, 1001), (8, 32000), (2, 4099)])
def test_greedy(dt: DType, B: int, V: int, split: bool) -> None:
    logits = rand((B, V), dt, 3.0)
    # a tie for the maximum at two places: the lower index wins
    x32 = logits.astype(np.float32)
    for b in range(B):
        i, j = sorted(RNG.choice(V, 2, replace=False))
        logits[b, i] = logits[b, j] = (x32[b].max() + 1.0).astype(dt.np)
    spec = sample_spec(B, V, dt) if split else S.SampleSpec(B, V, dt)
    assert spec.chunks > 1 or not split or V < 4096
    got = run_sample(spec, logits, 0, np.zeros(B, np.int64))
    want = SM.sample(logits, np.array([0]), np.zeros(B, np.int64))
    assert (got == want).all(), (got, want)
    assert (want == logits.astype(np.float32).argmax(1)).all()  # greedy is exactly argmax


def _explain_mismatch(logits: np.ndarray, seed: int, counter: np.ndarray, b: int, t: float, k: int, p: float) -> float:
    """The gap between the reference's two best scores of row b (a mismatch is allowed only where it is tiny)."""
    z = logits[b].astype(np.float32) / np.float32(t)
    keep = SM.keep_mask(z, k, float(np.float32(p)))
    sc = np.where(keep, z + SM.gumbel(seed, int(counter[b]), z.shape[0]), -np.inf)
    top2 = np.sort(sc)[-2:]
    return float(top2[1] - top2[0])


SAMPLING = [
    # dt, B, V, temperature, top_k, top_p, logit scale
    (F32, 4, 151936, 0.7, 50, 0.9, 3.0),
    (BF16, 4, 151936, 1.0, 0, 0.95, 3.0),
    (F16, 3, 32000, 0.6, 40, 1.0, 2.0),
    (F32, 5, 1001, 1.3, 0, 1.0, 1.0),      # plain Gumbel-max
    (BF16, 3, 999, 0.8, 1, 1.0, 2.0),      # top_k 1 == greedy on z
    (F32, 3, 1000, 1.0, 998, 0.5, 1.0),
    (F32, 2, 5000, 1.0, 0, 0.05, 4.0),     # tiny nucleus
    (F16, 2, 4096, 0.9, 100, 0.8, 0.25),   # flat distribution: large kept set
    (F32, 2, 50000, 1.0, 20000, 1.0, 1.0),  # many candidates
    (BF16, 2, 50000, 1.0, 0, 0.9, 0.1),     # the same for top-p alone (flat: a huge nucleus)
    (F32, 2, 50000, 1.0, 0, 0.9, 0.1),
]


@pytest.mark.parametrize("dt,B,V,t,k,p,scale", SAMPLING, ids=[f"{c[0].value}-B{c[1]}-V{c[2]}-t{c[3]}-k{c[4]}-p{c[5]}" for c in SAMPLING])
@pytest.mark.parametrize("variant", ["one_block", "split"])
def test_sampling_matches_reference(dt: DType, B: int, V: int, t: float, k: int, p: float, scale: float, variant: str) -> None:
    spec = sample_spec(B, V, dt) if variant == "split" else S.SampleSpec(B, V, dt)
    if variant == "split" and spec.chunks == 1:
        pytest.skip("a small vocabulary keeps one block per row")
    mismatches = 0
    for trial in range(6):
        logits = rand((B, V), dt, scale)
        seeds = RNG.integers(-(1 << 62), 1 << 62, size=B)
        counter = RNG.integers(0, 100000, size=B).astype(np.int64)
        got = run_sample(spec, logits, seeds, counter, t, k, p)
        want = SM.sample(logits, seeds, counter, t, k, p)
        for b in np.nonzero(got != want)[0]:
            gap = _explain_mismatch(logits, int(seeds[b]), counter, int(b), t, k, p)
            assert gap <= 1e-5, f"trial {trial} row {b}: got {got[b]}, want {want[b]}, reference top-2 gap {gap:.3e}"
            mismatches += 1
        assert (got >= 0).all() and (got < V).all()
        again = run_sample(spec, logits, seeds, counter, t, k, p)
        assert (again == got).all(), "not reproducible"
    assert mismatches <= 1


@pytest.mark.parametrize("dt", [F32, BF16])
@pytest.mark.parametrize("split", [False, True])
def test_mixed_rows_each_draw_as_alone(dt: DType, split: bool) -> None:
    """One launch, every row with other settings (greedy, plain, top-k, top-p, both): each row
    draws what the reference draws for it, and what the same kernel draws for it alone."""
    V = 151936
    settings = [(0.0, 0, 1.0), (0.8, 0, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.6, 40, 0.95), (0.0, 7, 0.5),
                (1.3, 0, 1.0), (0.0, 0, 1.0)]
    B = len(settings)
    temps = np.array([s[0] for s in settings], np.float32)
    ks = np.array([s[1] for s in settings], np.int64)
    ps = np.array([s[2] for s in settings], np.float32)
    spec = sample_spec(B, V, dt) if split else S.SampleSpec(B, V, dt)
    one = sample_spec(1, V, dt) if split else S.SampleSpec(1, V, dt)
    for _ in range(3):
        logits = rand((B, V), dt, 3.0)
        seeds = RNG.integers(0, 1 << 62, size=B)
        counter = RNG.integers(0, 4096, size=B).astype(np.int64)
        got = run_sample(spec, logits, seeds, counter, temps, ks, ps)
        want = SM.sample(logits, seeds, counter, temps, ks, ps)
        for b in range(B):
            alone = run_sample(one, logits[b:b + 1], seeds[b:b + 1], counter[b:b + 1], temps[b], ks[b], ps[b])
            assert alone[0] == got[b], f"row {b} {settings[b]}: {got[b]} in the batch, {alone[0]} alone"
            if got[b] != want[b]:
                assert _explain_mismatch(logits, int(seeds[b]), counter, b, *settings[b]) <= 1e-5
        greedy = temps == 0
        assert (got[greedy] == logits.astype(np.float32)[greedy].argmax(1)).all()


def test_sampling_ties_at_the_cut_are_kept() -> None:
    """Logits on a coarse grid: many exact ties at the top-k and top-p boundaries."""
    B, V = 4, 20000
    spec = S.SampleSpec(B, V, F32)
    for _ in range(8):
        logits = np.round(RNG.standard_normal((B, V)) * 2).astype(np.float32) / 2
        seed, counter = int(RNG.integers(0, 1 << 62)), RNG.integers(0, 1000, size=B).astype(np.int64)
        got = run_sample(spec, logits, seed, counter, 1.0, 64, 0.7)
        want = SM.sample(logits, np.array([seed]), counter, 1.0, 64, 0.7)
        for b in np.nonzero(got != want)[0]:
            assert _explain_mismatch(logits, seed, counter, int(b), 1.0, 64, 0.7) <= 1e-5


def test_sampling_depends_on_seed_and_counter_only() -> None:
    V = 50000
    spec = S.SampleSpec(6, V, F32)
    logits = np.tile(rand((1, V), F32, 0.5), (6, 1))  # flat-ish: many plausible tokens
    ctr = np.array([5, 5, 6, 7, 8, 9], np.int64)
    seeds = np.array([123, 123, 123, 123, 123, 77])
    a = run_sample(spec, logits, seeds, ctr, 1.0)
    assert (run_sample(sample_spec(6, V, F32), logits, seeds, ctr, 1.0) == a).all()  # split: the same draw
    assert a[0] == a[1]  # same seed and counter, another row: the same token
    assert (run_sample(spec, logits, seeds, ctr, 1.0) == a).all()
    assert (run_sample(spec, logits, seeds + 1, ctr, 1.0) != a).any()
    assert len(set(a.tolist())) >= 4  # rows differ through their counters and seeds
    assert (a == SM.sample(logits, seeds, ctr, 1.0)).sum() >= 5
