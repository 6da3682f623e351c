"""GPU: the decode attention with the head_rope group as its prologue (``KVAttentionSpec.heads``) gives
the bits of the two launches it replaces, the head_rope group kernel then the attention over the caches
it wrote: the attention's output and both caches, bit for bit, for every merge (one split, a cluster,
partials in global memory), GQA / MQA / MHA, several query rows a step with rows past the cache, a
sliding window, with and without q/k norms. Generation with the rule: tests/test_head_rope_pair.py and
test_generation_gpu.py (against the reference)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from fusec.codegen.build_decode import kv_attention_spec
from fusec.codegen.build_heads import HeadRopeGroupSpec
from fusec.dtypes import DType
from test_decode_kernels import heads_parts
from test_decode_kernels_gpu import dev, host, rand, run, run_kv_attention

pytestmark = pytest.mark.gpu

F32, F16, BF16 = DType.F32, DType.F16, DType.BF16

# (B, Hq, Hkv, S, T, D, norm, positions, kv_attention_spec keywords)
CASES = {
    "qwen3-b1-cluster": (1, 16, 8, 1, 271, 128, True, [200], dict(prefetch=True, cluster=True)),
    "qwen3-b8-split": (8, 16, 8, 1, 271, 128, True, None, dict(prefetch=True, split_keys=64)),
    "gqa-S3-window-past-the-cache": (3, 8, 2, 3, 100, 64, True, [0, 50, 98], dict(window=20)),
    "mha-plain-rope-one-split": (2, 4, 4, 1, 40, 64, False, [39, 10], dict(max_splits=1)),
    "mqa-S2": (2, 8, 1, 2, 80, 128, True, [5, 77], dict(cluster=True)),
    # one chunk holds the context (kv <= chunk): its block writes out and the caches, no merge
    "qwen3-b1-cluster-one-chunk": (1, 16, 8, 1, 271, 128, True, [20], dict(prefetch=True, cluster=True)),
    "qwen3-b8-cluster-one-chunk-some-rows": (8, 16, 8, 1, 271, 128, True, [3, 127, 31, 200, 270, 0, 20, 100],
                                             dict(prefetch=True, cluster=True)),
    "qwen3-b8-split-one-chunk-some-rows": (8, 16, 8, 1, 400, 128, True, [3, 127, 31, 300, 399, 0, 20, 200],
                                           dict(prefetch=True, cluster=False, split_keys=32)),
    # a long cache: clusters of 8 splits; a context past the first cluster merges through global memory
    "qwen3-b1-clusters-full": (1, 16, 8, 1, 2048, 128, True, [2040], dict(prefetch=True, cluster=True)),
    "qwen3-b2-clusters-short-and-long": (2, 16, 8, 1, 2048, 128, True, [100, 1500], dict(prefetch=True, cluster=True)),
}


def _bits(a) -> np.ndarray:  # noqa: ANN001
    return np.ascontiguousarray(a.get()).view(np.uint8)


@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("dt", [F32, F16, BF16])
@pytest.mark.parametrize("case", list(CASES))
def test_prologue_gives_the_bits_of_head_rope_then_attention(dt: DType, case: str, mma: bool) -> None:
    """(``mma``: with the key loop on tensor cores, where it applies.)"""
    import cupy as cp

    B, Hq, Hkv, Sq, T, D, norm, positions, kw = CASES[case]
    if mma:
        from fusec.codegen.build_decode import kv_mma_applies

        if not kv_mma_applies(dt, D):
            pytest.skip("the tensor-core key loop takes fp16/bf16")
        kw = kw | {"mma": True}
    if kw.get("cluster"):
        from fusec.device import gpu_arch

        if int(gpu_arch()[3:]) < 90:
            pytest.skip("thread block clusters need sm_90")
    parts = heads_parts(B, Hq, Hkv, Sq, T, D, dt, norm)
    fused = kv_attention_spec(B, Hq, Hkv, Sq, T, D, dt, 1.0 / math.sqrt(D), heads=parts, **kw)
    plain = dataclasses.replace(fused, heads=())
    rng = np.random.default_rng(11)
    pos = np.array(positions if positions is not None else rng.integers(0, T - 1, size=B), np.int64)
    W = (Hq + 2 * Hkv) * D
    x = dev(rand((B, Sq, W), dt)).reshape(-1)
    wq, wk = (dev(rng.uniform(0.5, 1.5, D).astype(np.float32)) for _ in range(2))
    ang = (pos[:, None, None] + np.arange(Sq)[None, :, None]) * 1e4 ** -((np.arange(D) % (D // 2)) / (D // 2))
    cos, sin = dev(np.cos(ang).astype(dt.np)), dev(np.sin(ang).astype(dt.np))
    old = [rand((B, Hkv, T, D), dt) for _ in range(2)]
    for c in old:  # rows at and past the step's position: written by the step or never read
        for b in range(B):
            c[b, :, pos[b]:] = np.nan
    xs = [x, *([wq] if norm else []), x[Hq * D:], *([wk] if norm else []), x[(Hq + Hkv) * D:]]

    k1, v1 = dev(old[0]), dev(old[1])  # the two launches: head_rope group, then the attention
    q = cp.zeros((B, Hq, Sq, D), dtype=k1.dtype)
    run(HeadRopeGroupSpec(parts), xs + [cos, sin, dev(pos), q, k1, v1])
    out1 = cp.zeros((B, Hq, Sq, D), dtype=k1.dtype)
    run_kv_attention(plain, [q, k1, v1, dev(pos)], out1)

    k2, v2 = dev(old[0]), dev(old[1])  # one launch (run three times where it merges partials)
    out2 = cp.zeros_like(out1)
    run_kv_attention(fused, xs + [cos, sin, dev(pos), k2, v2], out2)

    assert not np.isnan(host(out2, dt).astype(np.float32)).any()
    for a, b, what in ((out1, out2, "attention"), (k1, k2, "K cache"), (v1, v2, "V cache")):
        assert np.array_equal(_bits(a), _bits(b)), f"{what} differs ({fused.splits} splits, cluster {fused.cluster})"
    written = host(k2, dt).astype(np.float32)
    for b in range(B):  # the step's rows are in the cache (rows past it dropped), the rest untouched
        n = min(Sq, T - int(pos[b]))
        assert not np.isnan(written[b, :, pos[b]:pos[b] + n]).any()
        assert np.isnan(written[b, :, pos[b] + n:]).all()
