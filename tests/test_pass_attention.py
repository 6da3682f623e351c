"""recognize_attention: the ways HF eager code and torch's exporters spell attention -> ONE op."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value, verify
from fusec.ops import Op
from fusec.passes import recognize_attention
from fusec.passes.base import PassOptions

RNG = np.random.default_rng(20261123)
F = DType.F32
B, HQ, HKV, S, D = 2, 4, 2, 6, 8
F32_MIN = float(np.finfo(np.float32).min)


def _run(g: Graph) -> tuple[Graph, PassOptions]:
    opts = PassOptions()
    out = recognize_attention.run(g, opts).graph
    verify(out)
    return out, opts


def _inputs(g: Graph) -> dict[str, np.ndarray]:
    out = {}
    for v in g.inputs:
        if v.dtype == DType.BOOL:
            m = RNG.random(v.shape) > 0.3
            m[..., 0] = True  # every row keeps one key
            out[v.name] = m
        else:
            out[v.name] = RNG.standard_normal(v.shape).astype(v.dtype.np)
    return out


def _same(g0: Graph, g1: Graph) -> None:
    inputs = _inputs(g0)
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k], r0[k], rtol=1e-5, atol=1e-5)


def _repeat_kv(b: GraphBuilder, x: Value, rep: int) -> Value:
    bs, h, t, d = x.shape
    x = b.emit(Op.EXPAND, b.emit(Op.RESHAPE, x, shape=(bs, h, 1, t, d)), shape=(bs, h, rep, t, d))
    return b.emit(Op.RESHAPE, x, shape=(bs, h * rep, t, d))


def _attention_ops(g: Graph) -> list:  # type: ignore[type-arg]
    return [n for n in g.nodes if n.op == Op.ATTENTION]


def test_eager_mha_with_padding_mask() -> None:
    b = GraphBuilder("bert_attn")
    q, k, v = (b.input(n, (B, HQ, S, D), F) for n in "qkv")
    mask = b.input("mask", (B, 1, 1, S), F)
    s = b.emit(Op.MATMUL, q, b.emit(Op.TRANSPOSE, k, perm=(0, 1, 3, 2)))
    s = b.emit(Op.ADD, b.emit(Op.MUL, s, b.scalar(D ** -0.5, F)), mask)
    b.output(b.emit(Op.MATMUL, b.emit(Op.SOFTMAX, s, axis=3), v), "o")
    g = b.build()
    out, _ = _run(g)
    (att,) = _attention_ops(out)
    assert [n.op for n in out.nodes] == [Op.ATTENTION]
    assert att.attrs.scale == pytest.approx(D ** -0.5) and not att.attrs.causal
    assert att.inputs == (q, k, v, mask) and out.meta["patterns"]["attention"] == 1
    _same(g, out)


def test_gqa_repeat_kv_with_divided_scores_and_mask_added_before_the_scale() -> None:
    b = GraphBuilder("llama_attn")
    q = b.input("q", (B, HQ, S, D), F)
    k, v = b.input("k", (B, HKV, S, D), F), b.input("v", (B, HKV, S, D), F)
    mask = b.input("mask", (B, 1, S, S), F)
    kt = b.emit(Op.TRANSPOSE, _repeat_kv(b, k, HQ // HKV), perm=(0, 1, 3, 2))
    s = b.emit(Op.ADD, b.emit(Op.MATMUL, q, kt), mask)  # (qk + m) / sqrt(d): the mask is scaled too
    s = b.emit(Op.DIV, s, b.scalar(D ** 0.5, F))
    p = b.emit(Op.CAST, b.emit(Op.SOFTMAX, b.emit(Op.CAST, s, to=F), axis=3), to=F)
    b.output(b.emit(Op.MATMUL, p, _repeat_kv(b, v, HQ // HKV)), "o")
    g = b.build()
    out, _ = _run(g)
    (att,) = _attention_ops(out)
    assert att.inputs[1] is k and att.inputs[2] is v  # GQA: kv heads are not repeated in memory
    assert att.attrs.scale == pytest.approx(D ** -0.5)
    assert [n.op for n in out.nodes] == [Op.MUL, Op.ATTENTION]  # mask * (1/sqrt(d))
    _same(g, out)


def test_sdpa_export_form_scaled_q_and_k_bool_mask_nan_guard() -> None:
    """torch.onnx (legacy) SDPA: q*sqrt(s), k^T*sqrt(s), add where(mask, 0, -inf), isnan guard."""
    b = GraphBuilder("sdpa")
    q = b.input("q", (B, HQ, S, D), F)
    k, v = b.input("k", (B, HKV, S, D), F), b.input("v", (B, HKV, S, D), F)
    keep = b.input("keep", (B, 1, S, S), DType.BOOL)
    r = D ** -0.25
    kt = b.emit(Op.TRANSPOSE, _repeat_kv(b, k, HQ // HKV), perm=(0, 1, 3, 2))
    s = b.emit(Op.MATMUL, b.emit(Op.MUL, q, b.scalar(r, F)), b.emit(Op.MUL, kt, b.scalar(r, F)))
    m = b.emit(Op.WHERE, keep, b.scalar(0.0, F), b.scalar(-np.inf, F))
    p = b.emit(Op.SOFTMAX, b.emit(Op.ADD, s, m), axis=3)
    p = b.emit(Op.WHERE, b.emit(Op.ISNAN, p), b.scalar(0.0, F), p)
    b.output(b.emit(Op.MATMUL, p, _repeat_kv(b, v, HQ // HKV)), "o")
    g = b.build()
    out, _ = _run(g)
    (att,) = _attention_ops(out)
    assert att.attrs.nan_to_zero and att.attrs.scale == pytest.approx(D ** -0.5)
    assert att.inputs[3].shape == (B, 1, S, S) and att.inputs[3].dtype == F
    _same(g, out)


def test_dynamo_3d_layout_chain_and_where_on_scores() -> None:
    """torch.export form: K repeated, reshaped to [B*H, T, D], transposed in 3-D, reshaped back;
    the mask applied as where(keep, scores, finfo.min)."""
    b = GraphBuilder("dynamo")
    q = b.input("q", (B, HQ, S, D), F)
    k, v = b.input("k", (B, HKV, S, D), F), b.input("v", (B, HKV, S, D), F)
    keep = b.input("keep", (B, 1, S, S), DType.BOOL)
    kr = b.emit(Op.RESHAPE, _repeat_kv(b, k, HQ // HKV), shape=(B * HQ, S, D))
    kt = b.emit(Op.RESHAPE, b.emit(Op.TRANSPOSE, kr, perm=(0, 2, 1)), shape=(B, HQ, D, S))
    s = b.emit(Op.MUL, b.emit(Op.MATMUL, q, kt), b.scalar(0.3, F))
    s = b.emit(Op.WHERE, keep, s, b.scalar(F32_MIN, F))
    b.output(b.emit(Op.MATMUL, b.emit(Op.SOFTMAX, s, axis=3), _repeat_kv(b, v, HQ // HKV)), "o")
    g = b.build()
    out, _ = _run(g)
    (att,) = _attention_ops(out)
    assert att.inputs[1] is k and att.attrs.scale == pytest.approx(0.3)
    _same(g, out)


def test_gpt2_merged_head_transpose_and_constant_causal_mask() -> None:
    """simplify merges K's two transposes into perm (0,2,3,1): no [B,H,T,D] K value exists, so the
    pass emits one; a constant causal mask becomes the causal flag."""
    b = GraphBuilder("gpt2")
    x = b.input("x", (B, S, HQ * D), F)
    heads = [b.emit(Op.RESHAPE, b.emit(Op.MUL, x, b.scalar(c, F)), shape=(B, S, HQ, D)) for c in (1.0, 2.0, 3.0)]
    q = b.emit(Op.TRANSPOSE, heads[0], perm=(0, 2, 1, 3))
    kt = b.emit(Op.TRANSPOSE, heads[1], perm=(0, 2, 3, 1))
    v = b.emit(Op.TRANSPOSE, heads[2], perm=(0, 2, 1, 3))
    causal = np.triu(np.full((S, S), F32_MIN, np.float32), k=1)[None, None]
    s = b.emit(Op.ADD, b.emit(Op.MUL, b.emit(Op.MATMUL, q, kt), b.scalar(0.25, F)), b.const(causal, name="causal"))
    o = b.emit(Op.MATMUL, b.emit(Op.SOFTMAX, s, axis=3), v)
    b.output(b.emit(Op.RESHAPE, b.emit(Op.TRANSPOSE, o, perm=(0, 2, 1, 3)), shape=(B, S, HQ * D)), "o")
    g = b.build()
    out, _ = _run(g)
    (att,) = _attention_ops(out)
    assert att.attrs.causal and len(att.inputs) == 3
    k_node = next(n for n in out.nodes if att.inputs[1] in n.outputs)
    assert k_node.op == Op.TRANSPOSE and k_node.attrs.perm == (0, 2, 1, 3)
    _same(g, out)


def _plain(scores_out: bool = False, scale_input: bool = False, axis: int = 3) -> Graph:
    b = GraphBuilder("plain")
    q, k, v = (b.input(n, (B, HQ, S, D), F) for n in "qkv")
    s = b.emit(Op.MATMUL, q, b.emit(Op.TRANSPOSE, k, perm=(0, 1, 3, 2)))
    if scale_input:
        s = b.emit(Op.MUL, s, b.input("scale", (1,), F))
    p = b.emit(Op.SOFTMAX, s, axis=axis)
    b.output(b.emit(Op.MATMUL, p, v), "o")
    if scores_out:
        b.output(p, "attn_weights")  # output_attentions=True: the probabilities are a result
    return b.build()


def test_declines_when_probabilities_are_read_or_scale_is_not_constant() -> None:
    for g, why in ((_plain(scale_input=True), "non-constant"),):
        out, opts = _run(g)
        assert not _attention_ops(out)
        assert any(p == "attention" and why in r for p, _, r in opts.declines)
        _same(g, out)
    g = _plain(scores_out=True)
    out, _ = _run(g)
    assert not _attention_ops(out) and out.meta["patterns"]["attention"] == 0
    _same(g, out)


def test_softmax_over_another_axis_is_not_attention() -> None:
    g = _plain(axis=2)
    out, _ = _run(g)
    assert not _attention_ops(out)
    _same(g, out)


def _gqa_layer(b: GraphBuilder, i: int, tiled: bool = False) -> None:
    q = b.input(f"q{i}", (B, HQ, S, D), F)
    k, v = b.input(f"k{i}", (B, HKV, S, D), F), b.input(f"v{i}", (B, HKV, S, D), F)
    rep = HQ // HKV
    if tiled:  # heads tiled (h0, h1, h0, h1), not repeated (h0, h0, h1, h1): another layout of the same shape
        kx = b.emit(Op.EXPAND, b.emit(Op.RESHAPE, k, shape=(B, 1, HKV, S, D)), shape=(B, rep, HKV, S, D))
        kr = b.emit(Op.RESHAPE, kx, shape=(B, HQ, S, D))
    else:
        kr = _repeat_kv(b, k, rep)
    kt = b.emit(Op.TRANSPOSE, kr, perm=(0, 1, 3, 2))
    s = b.emit(Op.MUL, b.emit(Op.MATMUL, q, kt), b.scalar(D ** -0.5, F))
    b.output(b.emit(Op.MATMUL, b.emit(Op.SOFTMAX, s, axis=3), _repeat_kv(b, v, rep)), f"o{i}")


def test_heads_tiled_instead_of_repeated_are_not_taken_for_the_kv_heads() -> None:
    """K's heads tiled (h0, h1, h0, h1) have the shape of a repeat_kv but not its layout: the attention op must not
    read k as its kv heads (that would pair query heads with the wrong keys); the result stays the graph's."""
    b = GraphBuilder("tiled")
    _gqa_layer(b, 0, tiled=True)
    g = b.build()
    out, _ = _run(g)
    k = g.inputs[1]
    assert all(att.inputs[1] is not k for att in _attention_ops(out))
    _same(g, out)


def test_identical_layers_check_their_kv_layout_once() -> None:
    """The layout check (a replay of the chain on an index array as large as K) runs once for each chain of shapes
    and attrs, not once a layer: three identical layers miss the cache as often as one."""
    def misses(layers: int) -> int:
        recognize_attention._layout_perm.cache_clear()
        b = GraphBuilder(f"layers{layers}")
        for i in range(layers):
            _gqa_layer(b, i)
        g = b.build()
        out, _ = _run(g)
        assert len(_attention_ops(out)) == layers
        assert all(att.inputs[1] is g.inputs[3 * i + 1] for i, att in enumerate(_attention_ops(out)))
        _same(g, out)
        return recognize_attention._layout_perm.cache_info().misses

    one, three = misses(1), misses(3)
    assert one > 0 and three == one, (one, three)
    assert recognize_attention._layout_perm.cache_info().hits >= 2 * one
