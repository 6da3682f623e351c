"""RoPE siblings (``rope_siblings``): the q and k heads of one QKV product, each with its own
per-head norm (Qwen3) and output (the K cache in decode), rotated by one head_rope launch.

CPU: the fused graphs (one launch per layer for q + k, GQA / MQA / MHA, with and without q/k
norm), reference agreement with the same graph fused without the rule, the memory plan of the
two-output node, NVRTC compiles of the group kernel, generation plans (prefill + decode), and the
declines. GPU (``-m gpu``): the group kernel against float64 numpy, and generation against the
reference for MQA.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec import reference  # noqa: E402
from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen import specs as S  # noqa: E402
from fusec.codegen.build_heads import HeadRopeGroupSpec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402
from fusec.models import get_config  # noqa: E402
from fusec.passes.base import PassOptions  # noqa: E402
from fusec.passes.fusion import describe_kernels, kernel_count, records  # noqa: E402
from fusec.passes.pipeline import optimize  # noqa: E402
from fusec.runtime.generation import generate_with_plan  # noqa: E402

F32, F16, BF16 = DType.F32, DType.F16, DType.BF16
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23], [31, 32, 33, 34, 35, 36]]

# (model, config changes): GQA with q/k norm, MQA with q/k norm, MHA with q/k norm, Llama GQA (plain RoPE)
CASES = {
    "qwen3-gqa": ("qwen3-tiny", dict(head_dim=64)),
    "qwen3-mqa": ("qwen3-tiny", dict(head_dim=64, num_kv_heads=1)),
    "qwen3-mha": ("qwen3-tiny", dict(head_dim=64, num_kv_heads=4)),
    "llama-gqa": ("llama-tiny", dict(hidden_size=128, head_dim=64)),
    "llama-mqa-d128": ("llama-tiny", dict(hidden_size=128, head_dim=128, num_heads=2, num_kv_heads=1)),
}


def _cfg(case: str):  # noqa: ANN202
    name, kw = CASES[case]
    return dataclasses.replace(get_config(name), name=f"{name}-{case}", **kw)


def _graph(cfg, batch: int = 2, seq: int = 8):  # noqa: ANN001, ANN202
    from fusec.models.llama import build_llama
    from fusec.models.weights import RandomWeights

    w = RandomWeights(3)
    g = build_llama(cfg, batch, seq, w)
    w.finish()
    return g


def _feeds(cfg, batch: int = 2, seq: int = 8) -> dict[str, np.ndarray]:  # noqa: ANN001
    rng = np.random.default_rng(5)
    mask = np.ones((batch, seq), np.int64)
    mask[1, seq - 3:] = 0
    return {"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)), "attention_mask": mask}


def _optimized(g, disabled=()):  # noqa: ANN001, ANN202
    return optimize(g, PassOptions(disabled_fusions=frozenset(disabled)))[0]


# ---- the fused graph ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_q_and_k_rope_are_one_launch_per_layer(case: str) -> None:
    """One rope_siblings kernel per layer and no other RoPE launch; the rule saves exactly one
    launch per layer; the fused graph computes bit for bit what the graph fused without it does."""
    cfg = _cfg(case)
    g0 = _graph(cfg)
    g = _optimized(g0)
    ks = describe_kernels(g)
    sib = [k for k in ks if k.startswith("rope_siblings:")]
    assert len(sib) == cfg.num_layers, ks
    assert all(k.count("rope") == 3 for k in sib), sib  # the rule name and two RoPEs
    assert all(k.count("rmsnorm") == (2 if cfg.qk_norm else 0) for k in sib), sib
    assert not [k for k in ks if "rope" in k and not k.startswith("rope_siblings:")], ks
    applied = [r for r in records(g) if r.rule == "rope_siblings" and r.applied]
    assert len(applied) == cfg.num_layers and all(r.legal for r in applied)
    g_off = _optimized(g0, ("rope_siblings",))
    assert kernel_count(g_off) == kernel_count(g) + cfg.num_layers
    assert not any(k.startswith("rope_siblings") for k in describe_kernels(g_off))
    fused = [n for n in g.nodes if n.op.value == "fused" and n.attrs.rule == "rope_siblings"]
    assert all(len(n.outputs) == 2 for n in fused)
    q, k = fused[0].outputs
    assert (q.shape[1], k.shape[1]) == (cfg.num_heads, cfg.num_kv_heads)
    feeds = _feeds(cfg)
    want, got = reference.run(g_off, feeds), reference.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    raw = reference.run(g0, feeds)
    for name in raw:
        np.testing.assert_allclose(got[name], raw[name], rtol=1e-4, atol=1e-4)


def test_memory_plan_of_the_two_output_node() -> None:
    """Each value in one arena at its planned offset (poisoned first): the two outputs of the
    sibling node get slots that nothing overwrites while attention reads them."""
    from fusec.passes.memory_plan import plan_memory

    cfg = _cfg("qwen3-mqa")
    g = _optimized(_graph(cfg))
    feeds = _feeds(cfg)
    got = reference.run_planned(g, feeds, plan_memory(g))
    want = reference.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize("entry", ["prefill", "decode"])
def test_memory_plan_of_generation_siblings(entry: str) -> None:
    """Generation graphs run with every value at its planned arena slot and the caches in their
    state buffers: the sibling node's K and V cache outputs are written in place (attention reads
    the caches, in the prefill too), and the results equal the unplanned reference's."""
    from fusec.genmodel import GenModel, build_graphs
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights
    from fusec.passes.memory_plan import plan_memory

    cfg = _cfg("qwen3-mqa")
    gm = GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)
    g = _optimized(build_graphs(gm, 2, 32, 8, [])[entry])
    sib = [n for n in g.nodes if n.op.value == "fused" and n.attrs.rule.startswith("rope_siblings")]
    # q (decode: the attention's result, q being the prologue's), the K cache and the V cache (V's heads
    # copied by the same launch: the V cache write is no launch of its own)
    assert len(sib) == cfg.num_layers and all(len(n.outputs) == 3 for n in sib)
    rng = np.random.default_rng(2)
    fixed = {"pos": np.array([0, 0]) if entry == "prefill" else np.array([8, 5]), "cur": np.array([8, 5]),
             "done": np.zeros(2, bool), "seed": np.array([3, 4]), "lengths": np.array([8, 5]),
             "temperature": np.array([0.0, 0.7], np.float32), "top_k": np.array([0, 5]),
             "top_p": np.array([1.0, 0.9], np.float32)}
    feeds = {v.name: fixed[v.name] if v.name in fixed
             else rng.standard_normal(v.shape).astype(np.float32) if v.dtype == F32
             else rng.integers(0, cfg.vocab_size, v.shape) for v in g.inputs}
    plan = plan_memory(g)
    got, want = reference.run_planned(g, feeds, plan), reference.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    caches = [n.outputs[i] for n in sib for i, o in enumerate(n.outputs) if o.shape[2] == 32]
    assert len(caches) == 2 * cfg.num_layers and all(plan.alias[c.name]["kind"] == "update" for c in caches)


def test_decline_names_the_reason_and_falls_back() -> None:
    """head_dim 32 is no head_rope kernel (D must be a multiple of 64): the sibling candidate is
    recorded as rejected with the codegen's reason, and the graph is what it was without the rule."""
    cfg = get_config("qwen3-tiny")
    g0 = _graph(cfg)
    g = _optimized(g0)
    rej = [r for r in records(g) if r.rule == "rope_siblings"]
    assert len(rej) == cfg.num_layers
    assert all(not r.applied and not r.legal and "multiple of 64" in r.reason for r in rej), rej
    assert describe_kernels(g) == describe_kernels(_optimized(g0, ("rope_siblings",)))


def test_disabled_rule_gives_two_head_rope_launches() -> None:
    cfg = _cfg("qwen3-gqa")
    g = _optimized(_graph(cfg), ("rope_siblings",))
    assert sum(k.startswith("head_rope:") for k in describe_kernels(g)) == 2 * cfg.num_layers
    off = [r for r in records(g) if r.rule == "rope_siblings"]
    assert off and all(r.reason == "disabled by option" and r.legal for r in off)


# ---- the kernel -------------------------------------------------------------------------------------

def _pair(dt: DType, B: int, S_: int, Hq: int, Hkv: int, D: int, norm: bool, cache_len: int,
          cs_dt: DType | None = None) -> HeadRopeGroupSpec:
    """q heads then k heads of one [B, S, (Hq + 2 Hkv) D] product; q to a [B, Hq, S, D] output,
    k to a [B, Hkv, T, D] cache at pos[b] + s (T = cache_len) or to a [B, Hkv, S, D] output."""
    row = (Hq + 2 * Hkv) * D
    xs = (S_ * row, D, row)
    cs = (S_ * D, D)
    kw = dict(norm=True, eps=1e-6, w_dtype=F32) if norm else {}
    q = S.HeadRopeSpec(B, Hq, S_, D, dt, xs, (Hq * S_ * D, S_ * D, D), cs, cs_dt or dt, **kw)
    t = cache_len or S_
    k = S.HeadRopeSpec(B, Hkv, S_, D, dt, xs, (Hkv * t * D, t * D, D), cs, cs_dt or dt, cache_len=cache_len, **kw)
    return HeadRopeGroupSpec((q, k))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dt", [F32, F16, BF16])
def test_group_kernel_compiles(arch: str, dt: DType) -> None:
    """NVRTC compiles the two-part kernel (norm + cache on k, GQA) and the plain one (MQA, D 128);
    the grid covers the rows of both parts, the params are each part's x [w], then the shared
    cos, sin [pos], then each part's output."""
    for spec, params in ((_pair(dt, 2, 5, 4, 2, 64, True, 40), ("x0", "w0", "x1", "w1", "cos", "sin", "pos", "out0", "out1")),
                         (_pair(dt, 1, 7, 8, 1, 128, False, 0, F32), ("x0", "x1", "cos", "sin", "out0", "out1"))):
        ck = K.build(spec, arch)
        assert ck.params == params
        rows = sum(p.B * p.H * p.S for p in spec.parts)
        assert ck.grid[0] * ck.block[0] // 32 >= rows > (ck.grid[0] - 1) * ck.block[0] // 32
        assert ck.source.count("__device__ __forceinline__ void hr_part") == 2
    dual = HeadRopeGroupSpec(_pair(dt, 2, 5, 4, 2, 64, True, 40).parts, copies=(1,))  # prefill: k to the cache and out
    assert K.build(dual, arch).params[-3:] == ("out0", "out1", "dual1")
    fixed = HeadRopeGroupSpec(_pair(dt, 1, 5, 4, 2, 64, True, 40).parts, copies=(1,), fixed_pos=0)  # one-row prefill
    ck = K.build(fixed, arch)
    assert "pos" not in ck.params and "(hr_idx)0 + s0" in ck.source


@pytest.mark.parametrize("S_,rows,want", [(2048, 65536, 4), (128, 4096, 1), (2048, 8192, 2), (1, 64, 1),
                                          (6, 65536, 2), (77, 65536, 1)])
def test_rows_a_warp_where_positions_and_blocks_allow(S_: int, rows: int, want: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``rows_per_warp``: the most of 4, 2, 1 that divides S and leaves 4 blocks an SM (4 warps a block); the knob
    forces it where it divides S. The kernel's grid covers the rows at the spec's rows a warp."""
    from fusec.codegen.build_heads import rows_per_warp

    assert rows_per_warp(S_, rows) == want
    monkeypatch.setenv("FUSEC_HEAD_ROPE_RPW", "4")
    assert rows_per_warp(S_, rows) == (4 if S_ % 4 == 0 else 1)
    spec = HeadRopeGroupSpec(_pair(BF16, 1, 2048, 16, 8, 128, True, 2064).parts, rpw=4)
    ck = K.build(spec, "sm_90")
    rows = sum(p.B * p.H * p.S for p in spec.parts)
    assert "#define RPW 4 " in ck.source and ck.grid[0] * ck.block[0] // 32 * 4 >= rows
    with pytest.raises(ValueError, match="rpw"):
        HeadRopeGroupSpec(_pair(BF16, 1, 6, 16, 8, 128, True, 20).parts, rpw=4)  # 4 does not divide S = 6


@pytest.mark.parametrize("prompt,want", [(512, 4), (8, 1)])
def test_the_prefills_head_rope_records_and_launches_its_rows_a_warp(prompt: int, want: int) -> None:
    """Kernel selection records rows a warp on the head_rope node (what explain shows); the lowering renders the
    kernel at that many."""
    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(_cfg("qwen3-gqa"), max_positions=1024, num_heads=16, num_kv_heads=8, num_layers=1)
    gm = GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)
    plan = compile_generation(gm, batch=4, max_seq_len=prompt + 8, prefill_len=prompt, dtype="bf16", arch="sm_90",
                              eos_ids=[])
    modules = {m["entry"]: m for m in plan.manifest["modules"]}
    entries = {plan.manifest["kernels"][int(L["kernel"])]["entry"] for L in plan.manifest["entries"]["prefill"]["launches"]
               if "kernel" in L}
    srcs = [bytes(plan.blobs()[modules[e]["source"]]).decode() for e in entries if e.startswith("fc_headrope")]
    assert srcs and all(f"#define RPW {want} " in s for s in srcs)


def test_group_spec_rejects_parts_that_cannot_share_a_launch() -> None:
    q = S.HeadRopeSpec(1, 4, 8, 64, F16, (1, 1, 1), (1, 1, 1), (64, 0), F16)
    with pytest.raises(ValueError, match="part 1 differs from part 0"):
        HeadRopeGroupSpec((q, dataclasses.replace(q, S=4)))
    with pytest.raises(ValueError, match="part 1 differs from part 0"):
        HeadRopeGroupSpec((q, dataclasses.replace(q, cs_strides=(0, 64))))
    with pytest.raises(ValueError, match="must name distinct parts that write a cache"):
        HeadRopeGroupSpec((q, q), copies=(0,))
    with pytest.raises(ValueError, match="one positions dtype"):
        HeadRopeGroupSpec((dataclasses.replace(q, cache_len=9, pos_dtype=DType.I32), dataclasses.replace(q, cache_len=9)))


# ---- generation plans -------------------------------------------------------------------------------

@pytest.mark.parametrize("case,batch", [("qwen3-mqa", 2), ("llama-gqa", 2), ("qwen3-gqa", 1)])
def test_generation_plan_one_rope_launch_per_layer(case: str, batch: int) -> None:
    """Prefill and decode of a compiled generation plan (fp16, sm_80): one rope_siblings launch per
    layer and no other RoPE launch; both carry the K and V cache writes (a one-row batch's prefill
    writes from the literal position 0). The reference generation of the optimized graphs (fused bodies)
    matches the unoptimized one."""
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import GenModel, build_graphs
    from fusec.compiler import compile_generation
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = _cfg(case)

    def model():  # noqa: ANN202
        return GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)

    plan = compile_generation(model(), batch=batch, max_seq_len=32, prefill_len=8, dtype="fp16", arch="sm_80", eos_ids=[])
    for entry in ("prefill", "decode"):
        labels = [L["label"] for L in plan.manifest["entries"][entry]["launches"]]
        rule = "rope_siblings+rope_attention" if entry == "decode" else "rope_siblings"
        assert sum(f"fused[{rule}]" in x for x in labels) == cfg.num_layers, (entry, labels)
        assert not [x for x in labels if "rope" in x and rule not in x], (entry, labels)
    graphs = build_graphs(model(), batch, 32, 8, [])
    for entry in ("prefill", "decode"):  # attention reads the caches (the prefill too): K and V go only there
        g = _optimized(graphs[entry])
        sib = [k for k in describe_kernels(g) if k.startswith("rope_siblings")]
        # the V heads' cache write joins K's (...rope[+transpose]+cache_write+cache_write), and in decode
        # the attention that reads them (rope_attention)
        tail = "cache_write+cache_write" + ("+kv_attention" if entry == "decode" else "")
        assert len(sib) == cfg.num_layers and all(k.endswith(tail) for k in sib), (entry, sib)
        n_writes = sum(k == "cache_write" for k in describe_kernels(g))
        assert n_writes == sum(k == "cache_write" for k in describe_kernels(_optimized(graphs[entry], ("rope_siblings",)))) \
            - cfg.num_layers  # V's cache write joins (K's joins its head_rope with the rule off too)
    raw = ReferenceEngine(build_graphs(model(), batch, 32, 12, []))
    fused = ReferenceEngine(build_graphs(model(), batch, 32, 12, []), optimize=True)
    assert generate(raw, PROMPTS[:batch], 6, cfg.vocab_size).new_ids == generate(fused, PROMPTS[:batch], 6, cfg.vocab_size).new_ids


# ---- GPU ---------------------------------------------------------------------------------------------

TOL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}


def _round(x: np.ndarray, dt: DType) -> np.ndarray:
    return x.astype(np.float32).astype(dt.np).astype(np.float64)


def _ref_part(x: np.ndarray, w: np.ndarray | None, cos: np.ndarray, sin: np.ndarray, dt: DType) -> np.ndarray:
    """[B, H, S, D] rows: RMSNorm rounded to dt then scaled by w and rounded (as the unfused pair
    stores and reloads it), then rotate-half RoPE with [B, S, D] cos/sin, in float64."""
    if w is not None:
        inv = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        x = _round(w * _round(x * inv, dt), dt)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rot * sin[:, None]


@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F32, F16, BF16])
@pytest.mark.parametrize("Hq,Hkv,D,norm", [(4, 2, 64, True), (8, 1, 128, True), (6, 1, 64, False), (16, 8, 128, True)])
@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("rpw", [1, 4])
def test_group_kernel_matches_numpy(dt: DType, Hq: int, Hkv: int, D: int, norm: bool, dual: bool, rpw: int) -> None:
    """q heads to their output and k heads into a cache at per-batch positions (rows past the cache
    dropped), from one merged QKV buffer, in one launch: against float64 numpy; the cache rows not
    written keep their poison, and the V columns are never read (NaN there would show). ``dual``
    (prefill): k's rotated rows also go to a [B, Hkv, S, D] output, all of them. ``rpw``: head rows a warp
    (a long prefill's form: 4 positions a warp, some of them past the cache)."""
    import cupy as cp

    B, S_, T = 2, (8 if rpw == 4 else 5), 12
    spec = _pair(dt, B, S_, Hq, Hkv, D, norm, T)
    spec = HeadRopeGroupSpec(spec.parts, copies=(1,) if dual else (), rpw=rpw)
    rng = np.random.default_rng(20261123)
    qkv = rng.uniform(-1, 1, (B, S_, Hq + 2 * Hkv, D)).astype(dt.np)
    qkv[:, :, Hq + Hkv:] = np.nan  # V: not read
    wq, wk = (rng.uniform(0.5, 1.5, D).astype(np.float32) for _ in range(2))
    inv_freq = 1e4 ** -((np.arange(D) % (D // 2)) / (D // 2))  # cat(freqs, freqs), as HF's RoPE
    ang = (np.arange(S_)[None, :, None] + np.array([0, 3])[:, None, None]) * inv_freq  # [B, S, D], per-batch offsets
    cos, sin = np.cos(ang).astype(dt.np), np.sin(ang).astype(dt.np)
    pos = np.array([0, T - 3], np.int64)  # batch 1: its last 2 rows fall past the cache

    def d(a: np.ndarray):  # noqa: ANN202
        a = np.ascontiguousarray(a)
        return cp.asarray(a.view(np.uint16) if dt == BF16 else a)

    nan = {F32: np.float32(np.nan), F16: np.float16(np.nan)}
    raw = cp.uint16 if dt == BF16 else dt.np

    def poisoned(shape):  # noqa: ANN001, ANN202
        return cp.full(shape, 0x7FC0, dtype=raw) if dt == BF16 else cp.full(shape, nan[dt], dtype=raw)

    flat = d(qkv).reshape(-1)
    q_out, cache, k_out = poisoned((B, Hq, S_, D)), poisoned((B, Hkv, T, D)), poisoned((B, Hkv, S_, D))
    args = [flat, *([d(wq)] if norm else []), flat[Hq * D:], *([d(wk)] if norm else []), d(cos), d(sin), d(pos), q_out, cache,
            *([k_out] if dual else [])]
    ck = K.build(spec)
    K.launch(ck, args)
    cp.cuda.runtime.deviceSynchronize()

    def host(a):  # noqa: ANN001, ANN202
        h = a.get()
        return (h.view(BF16.np) if dt == BF16 else h).astype(np.float64)

    x = qkv.astype(np.float64).transpose(0, 2, 1, 3)
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    ref_q = _ref_part(x[:, :Hq], wq.astype(np.float64) if norm else None, c64, s64, dt)
    ref_k = _ref_part(x[:, Hq:Hq + Hkv], wk.astype(np.float64) if norm else None, c64, s64, dt)
    got_q, got_c = host(q_out), host(cache)
    assert np.linalg.norm(got_q - ref_q) / np.linalg.norm(ref_q) <= TOL[dt]
    if dual:
        got_k = host(k_out)
        assert np.linalg.norm(got_k - ref_k) / np.linalg.norm(ref_k) <= TOL[dt]
    for b in range(B):
        n = min(S_, T - int(pos[b]))
        rows = got_c[b, :, pos[b]:pos[b] + n]
        assert np.linalg.norm(rows - ref_k[b, :, :n]) / np.linalg.norm(ref_k[b, :, :n]) <= TOL[dt]
        untouched = np.delete(got_c[b], np.arange(pos[b], pos[b] + n), axis=1)
        assert np.isnan(untouched).all()


@pytest.mark.gpu
@pytest.mark.parametrize("case,batch", [("qwen3-mqa", 3), ("llama-mqa-d128", 3), ("qwen3-gqa", 1)])
def test_generation_with_siblings_matches_the_reference(case: str, batch: int) -> None:
    """An fp32 generation plan whose q and k RoPEs run as one launch per layer (MQA, with and
    without q/k norm; GQA with one row, whose prefill writes the K cache from a literal position)
    generates the reference's tokens (GQA with 4 rows: test_generation_gpu.py's
    test_head_rope_fusion_generates_like_the_reference)."""
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import GenModel, build_graphs
    from fusec.compiler import compile_generation
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = _cfg(case)

    def model():  # noqa: ANN202
        return GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)

    plan = compile_generation(model(), batch=batch, max_seq_len=40, prefill_len=12, dtype="fp32", eos_ids=[])
    for entry in ("prefill", "decode"):
        labels = [L["label"] for L in plan.manifest["entries"][entry]["launches"]]
        rule = "rope_siblings+rope_attention" if entry == "decode" else "rope_siblings"
        assert sum(f"fused[{rule}]" in x for x in labels) == cfg.num_layers
    got = generate_with_plan(plan, PROMPTS[:batch], max_new_tokens=12).new_ids
    want = generate(ReferenceEngine(build_graphs(model(), batch, 40, 12, [])), PROMPTS[:batch], 12,
                    cfg.vocab_size).new_ids
    assert got == want


def test_a_rope_head_rope_cannot_take_still_fuses_with_its_producers() -> None:
    """head_dim 32 (no head_rope kernel: D must be a multiple of 64): the declined head_rope leaves
    each RoPE free, so that the prefill and decode RoPEs fuse with their head split and transpose
    (one elementwise launch each, no RoPE launch of its own) although K goes only to its cache."""
    from fusec.genmodel import GenModel, build_graphs
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("llama-tiny"), name="llama-d32", hidden_size=128, head_dim=32)
    graphs = build_graphs(GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name), 2, 32, 8, [])
    for entry in ("prefill", "decode"):
        ks = describe_kernels(_optimized(graphs[entry]))
        assert "rope" not in ks, (entry, ks)
        assert sum(k.startswith("elementwise:") and k.endswith("rope") for k in ks) == 2 * cfg.num_layers, (entry, ks)
