"""Attention logit soft-capping (Gemma-2's attn_logit_softcapping, ONNX Attention's ``softcap``):
scores = cap * tanh(scale * q.k / cap) before the masks and the softmax.

CPU: the reference against a numpy formula; the attribute's validation; recognition of the capped
scores path (and the forms it must decline); unfusing and the KV-cache rewrite keep the cap; every
attention kernel variant renders the cap as a literal and compiles with NVRTC for sm_80/sm_90; the
lowering passes it to the kernels. GPU (``gpu`` mark): prefill (fp16, bf16, fp32 3xtf32/tf32/simt)
and decode (one split and split-K) kernels with a cap small enough to bend the scores, against
float64 numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_decode_kernels_gpu import dev as _dev
from test_decode_kernels_gpu import host as _host
from test_decode_kernels_gpu import poisoned
from test_decode_kernels_gpu import run as _launch

from fusec import ops as O
from fusec import reference
from fusec.builder import GraphBuilder
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_decode import kv_attention_spec
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op
from fusec.passes import recognize_attention
from fusec.passes.base import PassOptions

F16, BF16, F32, I64, BOOL = DType.F16, DType.BF16, DType.F32, DType.I64, DType.BOOL
RNG = np.random.default_rng(20261123)
B, HQ, HKV, SQ, D = 2, 4, 2, 6, 8


def numpy_attention(q, k, v, scale, cap, mask=None, causal=False):  # noqa: ANN001, ANN201
    """float64 attention with the cap written out: cap * tanh(s / cap), then the masks."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("bhsd,bhtd->bhst", q, k) * scale
    if cap:
        s = cap * np.tanh(s / cap)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask
    if causal:
        sl, tl = s.shape[-2:]
        s = np.where(np.tril(np.ones((sl, tl), bool), k=tl - sl), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhst,bhtd->bhsd", p / p.sum(-1, keepdims=True), v)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _qkv(dt: np.dtype = np.float32, s: int = SQ, t: int = SQ, d: int = D, spread: float = 3.0):
    return (RNG.standard_normal((B, HQ, s, d)) * spread).astype(dt), \
        (RNG.standard_normal((B, HKV, t, d)) * spread).astype(dt), RNG.standard_normal((B, HKV, t, d)).astype(dt)


# ---- the attribute and the reference ----------------------------------------------------------

def test_reference_soft_cap_matches_the_numpy_formula() -> None:
    q, k, v = _qkv()
    mask = np.where(RNG.random((B, 1, SQ, SQ)) < 0.8, 0.0, -1e9).astype(np.float32)
    mask[..., 0] = 0.0
    for cap, causal in ((2.0, True), (5.0, False)):
        got = reference.IMPL[Op.ATTENTION](O.AttentionAttrs(0.5, causal=causal, softcap=cap), q, k, v, mask)
        assert _rel(got, numpy_attention(q, k, v, 0.5, cap, mask, causal)) < 1e-5
        uncapped = numpy_attention(q, k, v, 0.5, 0.0, mask, causal)
        assert _rel(got, uncapped) > 1e-2  # scores of spread ~18 bent by a cap of 2..5: the cap shows
    # the cap comes before the mask: a masked key stays masked whatever the cap
    keep = RNG.random((B, 1, SQ, SQ)) < 0.6
    keep[..., 0] = True
    got = reference.IMPL[Op.ATTENTION](O.AttentionAttrs(0.5, softcap=1.0), q, k, v, keep)
    assert _rel(got, numpy_attention(q, k, v, 0.5, 1.0, keep)) < 1e-5
    # no cap: 0 and None mean the same
    plain = reference.IMPL[Op.ATTENTION](O.AttentionAttrs(0.5), q, k, v)
    assert np.array_equal(plain, reference.IMPL[Op.ATTENTION](O.AttentionAttrs(0.5, softcap=None), q, k, v))


def test_reference_kv_attention_soft_cap() -> None:
    q, k, v = _qkv(s=1, t=9)
    pos = np.array([3, 8])
    got = reference.IMPL[Op.KV_ATTENTION](O.KVAttentionAttrs(0.4, softcap=3.0), q, k, v, pos)
    keep = np.arange(9)[None, None, None, :] <= pos.reshape(B, 1, 1, 1)
    assert _rel(got, numpy_attention(q, k, v, 0.4, 3.0, keep)) < 1e-5


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_a_cap_that_is_not_a_finite_non_negative_number_is_refused(bad: float) -> None:
    for make in (lambda: O.AttentionAttrs(1.0, softcap=bad), lambda: O.KVAttentionAttrs(1.0, softcap=bad),
                 lambda: S.AttentionSpec(1, 2, 2, 4, 4, 16, F16, 0.25, softcap=bad),
                 lambda: S.KVAttentionSpec(1, 2, 2, 1, 64, 16, F16, 0.25, softcap=bad)):
        with pytest.raises(ValueError, match="softcap"):
            make()


# ---- recognition ------------------------------------------------------------------------------

def _capped_graph(pre: str = "mul_div", post: float = 30.0, mask_below_tanh: bool = False, two_tanh: bool = False,
                  d: int = D) -> Graph:
    """HF Gemma-2 eager: (q @ k^T) * scaling / cap -> tanh -> * cap -> + mask -> softmax (fp32) -> @ v."""
    f = F32
    b = GraphBuilder("gemma2_attn")
    q, k, v = b.input("q", (B, HQ, SQ, d), f), b.input("k", (B, HKV, SQ, d), f), b.input("v", (B, HKV, SQ, d), f)
    mask = b.input("mask", (B, 1, SQ, SQ), f)

    def rep(x: Value) -> Value:
        x = b.emit(Op.EXPAND, b.emit(Op.RESHAPE, x, shape=(B, HKV, 1, SQ, d)), shape=(B, HKV, HQ // HKV, SQ, d))
        return b.emit(Op.RESHAPE, x, shape=(B, HQ, SQ, d))

    s = b.emit(Op.MATMUL, q, b.emit(Op.TRANSPOSE, rep(k), perm=(0, 1, 3, 2)))
    if mask_below_tanh:
        s = b.emit(Op.ADD, s, mask)
    if pre == "mul_div":
        s = b.emit(Op.DIV, b.emit(Op.MUL, s, b.scalar(d ** -0.5, f)), b.scalar(abs(post), f))
    else:  # one folded multiply, as constant folding may leave it
        s = b.emit(Op.MUL, s, b.scalar(d ** -0.5 / abs(post), f))
    s = b.emit(Op.TANH, s)
    if two_tanh:
        s = b.emit(Op.TANH, s)
    s = b.emit(Op.MUL, s, b.scalar(post, f))
    if not mask_below_tanh:
        s = b.emit(Op.ADD, s, mask)
    p = b.emit(Op.SOFTMAX, s, axis=3)
    b.output(b.emit(Op.MATMUL, p, rep(v)), "o")
    return b.build()


def _feeds(g: Graph) -> dict[str, np.ndarray]:
    out = {}
    for x in g.inputs:
        a = RNG.standard_normal(x.shape).astype(np.float32) * (4.0 if x.name in "qk" else 1.0)
        if x.name == "mask":
            a = np.where(RNG.random(x.shape) < 0.7, 0.0, -1e9).astype(np.float32)
            a[..., 0] = 0.0
        out[x.name] = a
    return out


def _recognize(g: Graph) -> tuple[Graph, PassOptions]:
    opts = PassOptions()
    out = recognize_attention.run(g, opts).graph
    verify(out)
    return out, opts


@pytest.mark.parametrize("pre, post", [("mul_div", 30.0), ("folded", 7.0), ("mul_div", -7.0)])
def test_gemma2_capped_scores_become_one_attention_with_the_cap(pre: str, post: float) -> None:
    g = _capped_graph(pre, post)
    out, opts = _recognize(g)
    (att,) = [n for n in out.nodes if n.op == Op.ATTENTION]
    assert [n.op for n in out.nodes] == [Op.ATTENTION], [n.op for n in out.nodes]
    assert att.attrs.softcap == pytest.approx(abs(post)) and att.attrs.scale == pytest.approx(D ** -0.5 * post / abs(post))
    assert out.meta["patterns"]["attention"] == 1 and not opts.declines
    feeds = _feeds(g)
    want, got = reference.run(g, feeds)["o"], reference.run(out, feeds)["o"]
    assert _rel(got, want) < 1e-5
    # the test can fail: the same node without its cap gives another answer on these scores
    bare = reference.IMPL[Op.ATTENTION](O.AttentionAttrs(att.attrs.scale), *(feeds[x] for x in "qkv"), feeds["mask"])
    assert _rel(bare, want) > 1e-3


@pytest.mark.parametrize("kw, why", [(dict(mask_below_tanh=True), "mask between Q @ K^T and the tanh"),
                                     (dict(two_tanh=True), "two tanh")])
def test_capped_forms_the_kernel_cannot_take_are_declined_by_name(kw: dict, why: str) -> None:
    g = _capped_graph(**kw)
    out, opts = _recognize(g)
    assert Op.ATTENTION not in {n.op for n in out.nodes}
    reasons = [r for p, _, r in opts.declines if p == "attention"]
    assert len(reasons) == 1 and why in reasons[0], reasons


def test_an_unfused_attention_keeps_its_cap() -> None:
    """head_dim 12 is no multiple of 8: recognition's legalization decomposes the ATTENTION node."""
    b = GraphBuilder("capped")
    q, k, v = b.input("q", (B, HQ, SQ, 12), F32), b.input("k", (B, HKV, SQ, 12), F32), b.input("v", (B, HKV, SQ, 12), F32)
    b.output(b.emit(Op.ATTENTION, q, k, v, scale=0.3, causal=True, softcap=2.5), "o")
    g = b.build()
    out, opts = _recognize(g)
    assert Op.ATTENTION not in {n.op for n in out.nodes} and Op.TANH in {n.op for n in out.nodes}
    assert any("unfused" in r for _, _, r in opts.declines)
    feeds = _feeds(g)
    assert _rel(reference.run(out, feeds)["o"], reference.run(g, feeds)["o"]) < 1e-5
    assert _rel(reference.run(out, feeds)["o"], numpy_attention(feeds["q"], feeds["k"], feeds["v"], 0.3, 2.5,
                                                                causal=True)) < 1e-5


def test_the_kv_cache_rewrite_keeps_the_cap() -> None:
    from fusec.frontend.kv_attention import use_kv_attention

    b = GraphBuilder("attn")
    k, v = (b.state(n, (2, 1, 6, 8), F32) for n in ("k.0", "v.0"))
    pos = b.state("pos", (2,), I64)
    q, new = b.input("q", (2, 2, 1, 8), F32), b.input("new", (2, 1, 1, 8), F32)
    kc, vc = (b.emit(Op.CACHE_WRITE, c, new, pos, axis=2) for c in (k, v))
    allowed = b.emit(Op.LESS_EQUAL, b.const(np.arange(6)[None, :]), b.emit(Op.RESHAPE, pos, shape=(2, 1)))
    b.output(b.emit(Op.ATTENTION, q, kc, vc, b.emit(Op.RESHAPE, allowed, shape=(2, 1, 1, 6)), scale=0.5, softcap=1.5),
             "out")
    for s, u in ((k, kc), (v, vc), (pos, pos)):
        b.update(s, u)
    g = b.build()
    got = use_kv_attention(g)
    (kva,) = [n for n in got.nodes if n.op == Op.KV_ATTENTION]
    assert kva.attrs.softcap == 1.5
    feeds = {"k.0": RNG.standard_normal((2, 1, 6, 8)).astype(np.float32) * 3,
             "v.0": RNG.standard_normal((2, 1, 6, 8)).astype(np.float32), "pos": np.array([2, 5]),
             "q": RNG.standard_normal((2, 2, 1, 8)).astype(np.float32) * 3,
             "new": RNG.standard_normal((2, 1, 1, 8)).astype(np.float32)}
    np.testing.assert_allclose(reference.run(got, feeds)["out"], reference.run(g, feeds)["out"], rtol=1e-5, atol=1e-6)


# ---- kernels: render + NVRTC -------------------------------------------------------------------

PREFILL = [(F16, ""), (BF16, ""), (F32, "3xtf32"), (F32, "tf32"), (F32, "simt")]


def _prefill_spec(dt: DType, math_: str, cap: float, D_: int = 64, **kw: object) -> S.AttentionSpec:
    return S.AttentionSpec(2, 4, 2, 37, 37, D_, dt, 0.125, causal=True, fp32_math=math_, softcap=cap, **kw)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dt, math_", PREFILL, ids=[f"{d.value}-{m or 'mma'}" for d, m in PREFILL])
def test_prefill_kernel_renders_the_cap_and_compiles(dt: DType, math_: str, arch: str) -> None:
    capped = K.build(_prefill_spec(dt, math_, 50.0, mask="additive", mask_dtype=dt, mask_strides=(37, 0, 0, 1)), arch)
    plain = K.build(_prefill_spec(dt, math_, 0.0, mask="additive", mask_dtype=dt, mask_strides=(37, 0, 0, 1)), arch)
    assert capped.cubin[:4] == b"\x7fELF" and plain.cubin[:4] == b"\x7fELF"
    line = "v = 50.0f * tanhf(v / 50.0f);"
    assert line in capped.source and "tanhf(v" not in plain.source
    # the cap sits between the scale and the mask in the score function
    src = capped.source
    assert src.index("float v = dot * 0.125f;") < src.index(line) < src.index("v += fc_val(*mp)")
    assert capped.name != plain.name  # the cap is part of the kernel's identity (no cache collision)
    # finfo(fp32).min masks stay finite in log2 units (a row they hide averages V, no 0 / 0)
    assert "fmaxf(v * LOG2E, -3.402823466e38f)" in src


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("dt", [F16, BF16, F32])
def test_decode_kernel_renders_the_cap_and_compiles(dt: DType, arch: str) -> None:
    for spec in (S.KVAttentionSpec(2, 8, 2, 1, 300, 64, dt, 0.125, 1, softcap=30.0),
                 kv_attention_spec(1, 16, 8, 1, 4096, 128, dt, 0.088, softcap=30.0),
                 S.KVAttentionSpec(2, 4, 2, 5, 128, 64, dt, 0.125, 3, softcap=30.0)):
        ck = K.build(spec, arch)
        # fp32 with head_dim 128: ptxas keeps one 4-byte value on the stack once tanhf is in (seen with
        # NVRTC here: 8 spill bytes; no spill without the cap); every other variant spills nothing
        allowed = 8 if dt == F32 and spec.D == 128 else 0
        assert ck.cubin[:4] == b"\x7fELF" and ck.binary.spill_bytes <= allowed, ck.binary.log
        c2 = repr(30.0 * math.log2(math.e)) + "f"
        assert f"dot = {c2} * tanhf(dot / {c2});" in ck.source
        assert ck.source.index("tanhf(dot") < ck.source.index("sc[u][r] = kv_visible(j, j1, ")
        if spec.splits > 1:  # the partials hold capped scores: the merge applies no cap again
            assert ck.source.count("tanhf(dot") == 1


def test_lowering_passes_the_cap_to_the_kernels() -> None:
    from fusec.lower import Context
    from fusec.lower.nodes import LOWER
    from fusec.passes import select_kernels
    from fusec.passes.base import PassOptions

    q, k, v = Value("q", (1, 16, 1, 128), BF16), Value("k", (1, 8, 4096, 128), BF16), Value("v", (1, 8, 4096, 128), BF16)
    pos, out = Value("pos", (1,), I64), Value("o", (1, 16, 1, 128), BF16)
    node = Node(Op.KV_ATTENTION, [q, k, v, pos], [out], O.KVAttentionAttrs(0.088, softcap=30.0), name="attn")
    node.kernel = select_kernels._select(node, PassOptions(clusters=True), {})  # the form the lowering builds
    ctx = Context("sm_90", {"q": 0, "k": 1 << 20, "v": 16 << 20, "pos": 32 << 20, "o": 33 << 20}, "f32", None)
    ctx.arena_base = 64 << 20
    LOWER[Op.KV_ATTENTION](ctx, node, "#1 kv_attention")
    sources = [bytes(b).decode() for n, b in ctx.blobs.items() if n.startswith("source/")]
    assert sum("tanhf(dot" in s for s in sources) == 1 and len(ctx.launches) == 1  # splits merge in-kernel


def test_a_compiled_plan_holds_the_cap_in_its_attention_kernel() -> None:
    import fusec

    for dtype in ("fp16", "fp32"):
        g = _capped_graph(d=16)
        plan = fusec.compile(g, dtype=dtype, arch="sm_90")
        assert plan.manifest["report"]["patterns"]["attention"] == 1
        srcs = [bytes(b).decode() for n, b in plan.blobs().items() if n.startswith("source/")]
        assert sum("v = 30.0f * tanhf(v / 30.0f);" in s for s in srcs) == 1, dtype


def test_onnx_export_writes_the_cap(tmp_path) -> None:  # noqa: ANN001
    import onnxruntime as ort

    from fusec.onnx_export import export_onnx

    b = GraphBuilder("capped")
    q, k, v = b.input("q", (B, HQ, SQ, D), F32), b.input("k", (B, HKV, SQ, D), F32), b.input("v", (B, HKV, SQ, D), F32)
    b.output(b.emit(Op.ATTENTION, q, k, v, scale=0.3, causal=True, softcap=2.5), "o")
    g = b.build()
    export_onnx(g, tmp_path / "capped.onnx")
    feeds = _feeds(g)
    got = ort.InferenceSession(str(tmp_path / "capped.onnx"), providers=["CPUExecutionProvider"]).run(["o"], feeds)[0]
    assert _rel(got, numpy_attention(feeds["q"], feeds["k"], feeds["v"], 0.3, 2.5, causal=True)) < 1e-5


# ---- GPU: the kernels against float64 numpy ----------------------------------------------------

GPU_TOL = {F32: 1e-5, F16: 3e-3, BF16: 1.5e-2}
# one tf32 product rounds q, k, p and v to 10 bits; scores here reach ~5 (not ~1 as in test_kernels_gpu), so
# the bound is looser than there: an ignored cap is still 0.9 away (relative) on these inputs
TF32_TOL = 1e-2


def _rand(shape: tuple[int, ...], dt: DType, spread: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * spread).astype(np.float32).astype(dt.np)


GPU_PREFILL = [(dt, m, D_) for dt, m in PREFILL for D_ in (64, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("dt, math_, D_", GPU_PREFILL, ids=[f"{d.value}-{m or 'mma'}-D{x}" for d, m, x in GPU_PREFILL])
def test_gpu_prefill_attention_with_a_cap(dt: DType, math_: str, D_: int) -> None:
    Bn, Hq, Hkv, Sq, T = 2, 8, 2, 77, 77
    # scores of spread ~ sqrt(D) * 4 * 0.5: well past the cap of 5, so an ignored cap fails the check
    q, k, v = _rand((Bn, Hq, Sq, D_), dt, 2.0), _rand((Bn, Hkv, T, D_), dt, 2.0), _rand((Bn, Hkv, T, D_), dt)
    scale, cap = 1.0 / math.sqrt(D_), 5.0
    keep = RNG.random((Bn, 1, 1, T)) < 0.8
    keep[..., 0] = True
    mask = np.where(keep, 0.0, -1e4).astype(dt.np)
    out = poisoned((Bn, Hq, Sq, D_), dt)
    spec = S.AttentionSpec(Bn, Hq, Hkv, Sq, T, D_, dt, scale, causal=True, mask="additive", mask_dtype=dt,
                           mask_strides=(T, 0, 0, 1), fp32_math=math_, softcap=cap)
    _launch(spec, [_dev(q), _dev(k), _dev(v), _dev(mask), out])
    f = lambda a: a.astype(np.float64)  # noqa: E731
    want = numpy_attention(f(q), f(k), f(v), scale, cap, f(mask).reshape(Bn, 1, 1, T), causal=True)
    got = _host(out, dt)
    tol = TF32_TOL if math_ == "tf32" else GPU_TOL[dt]
    err = _rel(got, want)
    assert err <= tol, f"{dt.value}/{math_ or 'mma'}: relative error {err:.3e} > {tol:.0e}"
    assert _rel(numpy_attention(f(q), f(k), f(v), scale, 0.0, f(mask).reshape(Bn, 1, 1, T), causal=True), want) > 10 * tol


GPU_DECODE = [(dt, sq, splits) for dt in (F16, BF16, F32) for sq, splits in ((1, 1), (1, 4), (3, 3))]


@pytest.mark.gpu
@pytest.mark.parametrize("dt, sq, splits", GPU_DECODE, ids=[f"{d.value}-S{s}-x{n}" for d, s, n in GPU_DECODE])
def test_gpu_decode_attention_with_a_cap(dt: DType, sq: int, splits: int) -> None:
    import cupy as cp

    Bn, Hq, Hkv, T, D_ = 2, 8, 2, 256, 64
    q, k, v = _rand((Bn, Hq, sq, D_), dt, 2.0), _rand((Bn, Hkv, T, D_), dt, 2.0), _rand((Bn, Hkv, T, D_), dt)
    pos = np.array([200, 37], np.int64)
    scale, cap = 0.125, 5.0
    spec = S.KVAttentionSpec(Bn, Hq, Hkv, sq, T, D_, dt, scale, splits, softcap=cap)
    f = lambda a: a.astype(np.float32)  # noqa: E731
    want = reference.IMPL[Op.KV_ATTENTION](O.KVAttentionAttrs(scale, softcap=cap), f(q), f(k), f(v), pos)
    bare = reference.IMPL[Op.KV_ATTENTION](O.KVAttentionAttrs(scale), f(q), f(k), f(v), pos)
    out = poisoned((Bn, Hq, sq, D_), dt)
    args = [_dev(q), _dev(k), _dev(v), _dev(pos)]
    if splits == 1:
        _launch(spec, args + [out])
    else:
        from fusec.codegen.build_decode import kv_layout

        part = cp.full(spec.part_floats, np.nan, dtype=np.float32)
        sync = cp.zeros(spec.sync_ints(kv_layout(spec, spec.threads)["tiles"]), dtype=np.int32)
        _launch(spec, args + [part, sync, out])
    err = _rel(_host(out, dt), want)
    assert err <= GPU_TOL[dt], f"{dt.value} S{sq} x{splits}: relative error {err:.3e} > {GPU_TOL[dt]:.0e}"
    assert _rel(bare, want) > 10 * GPU_TOL[dt]


@pytest.mark.gpu
@pytest.mark.parametrize("dt, math_", PREFILL, ids=[f"{d.value}-{m or 'mma'}" for d, m in PREFILL])
@pytest.mark.parametrize("cap", [0.0, 5.0], ids=["plain", "capped"])
def test_gpu_a_row_that_a_finfo_min_mask_hides_averages_v(dt: DType, math_: str, cap: float) -> None:
    """HF's additive masks fill with finfo(dtype).min: a query row whose keys are all hidden (Gemma-2's
    sliding window over a right-padded row) gets the plain mean of V from the softmax, not NaN;
    score * log2(e) must not round -3.4e38 to -inf (0 / 0 in the kernel, spread by later layers)."""
    Bn, Hq, Hkv, Sq, T, D_ = 2, 4, 2, 20, 20, 64
    q, k, v = _rand((Bn, Hq, Sq, D_), dt), _rand((Bn, Hkv, T, D_), dt), _rand((Bn, Hkv, T, D_), dt)
    import ml_dtypes

    # HF fills with finfo(model dtype).min: fp32's -3.4e38 (bf16's -3.39e38) swamps every score, so
    # a fully hidden row is an exact mean of V; fp16's -65504 does not swamp them (scores still count)
    fill = float(ml_dtypes.finfo(dt.np).min)
    keep = np.tril(np.ones((Sq, T), bool)) & ~np.tril(np.ones((Sq, T), bool), k=-4)  # a window of 4 keys
    keep = np.broadcast_to(keep, (Bn, 1, Sq, T)).copy()
    keep[1, :, :, 12:] = False  # row 1 right-padded from key 12: its queries 15.. see no key at all
    mask = np.where(keep, 0.0, fill).astype(dt.np)
    out = poisoned((Bn, Hq, Sq, D_), dt)
    spec = S.AttentionSpec(Bn, Hq, Hkv, Sq, T, D_, dt, 0.125, mask="additive", mask_dtype=dt,
                           mask_strides=(Sq * T, 0, T, 1), fp32_math=math_, softcap=cap)
    _launch(spec, [_dev(q), _dev(k), _dev(v), _dev(mask), out])
    f = lambda a: a.astype(np.float64)  # noqa: E731
    want = numpy_attention(f(q), f(k), f(v), 0.125, cap, f(mask))
    got = _host(out, dt).astype(np.float64)
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} non-finite outputs"
    if dt != F16:
        assert np.allclose(want[1, :, 15:], np.repeat(f(v), Hq // Hkv, axis=1)[1, :, None].mean(axis=2), atol=1e-12)
    tol = TF32_TOL if math_ == "tf32" else GPU_TOL[dt]
    assert _rel(got, want) <= tol, f"{dt.value}/{math_ or 'mma'}: relative error {_rel(got, want):.3e}"
