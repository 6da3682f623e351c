"""Rewrites that once changed what a graph computes, each on the look-alike that fooled it: a fused
group that ran a read of a cache after the cache was overwritten in place, a LayerNorm "+ beta"
that broadcast along rows, attention products read with trans_b, a constant mask made causal
with more queries than keys. Each compares the reference before and after (and on the memory
plan, where storage is shared)."""

from __future__ import annotations

import numpy as np

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import verify
from fusec.ops import Op
from fusec.passes import recognize_attention, recognize_norms
from fusec.passes.base import PassOptions
from fusec.passes.memory_plan import plan_memory
from fusec.passes.pipeline import optimize

F = DType.F32
RNG = np.random.default_rng(20261125)


def _same(before, after, feeds: dict, atol: float = 1e-5) -> None:  # noqa: ANN001
    verify(after)
    want, got = reference.run(before, feeds), reference.run(after, feeds)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=atol, err_msg=k)


def test_a_fused_group_does_not_read_a_cache_after_it_is_overwritten_in_place() -> None:
    b = GraphBuilder()
    cache = b.state("cache", (1, 4, 8), F)
    new, pos = b.input("new", (1, 1, 8), F), b.input("pos", (1,), DType.I64)
    old2 = b.emit(Op.MUL, cache, b.scalar(2.0, F))  # reads the cache before the write
    w = b.emit(Op.CACHE_WRITE, cache, new, pos, axis=1)  # in place
    b.update(cache, w)
    red = b.emit(Op.REDUCE_SUM, w, axes=(1,), keepdims=True)
    b.output(b.emit(Op.EXP, b.emit(Op.ADD, old2, red)), "y")
    g = b.build()
    feeds = {"cache": RNG.standard_normal((1, 4, 8)).astype(np.float32),
             "new": RNG.standard_normal((1, 1, 8)).astype(np.float32), "pos": np.array([1])}
    opt, _ = optimize(g, PassOptions())
    verify(opt)  # no read of 'cache' after the write
    plan = plan_memory(opt)  # the state's storage shared, as on the GPU
    np.testing.assert_allclose(reference.run_planned(opt, feeds, plan)["y"], reference.run(g, feeds)["y"], rtol=1e-6)
    fused = [n for n in opt.nodes if n.op == Op.FUSED]
    assert all(Op.MUL not in {m.op for m in n.attrs.body.nodes} or Op.ADD not in {m.op for m in n.attrs.body.nodes}
               for n in fused), "the multiply that reads the old cache was grouped past the write"


def _standardized(b: GraphBuilder, x, d: int):  # noqa: ANN001, ANN202
    mu = b.emit(Op.REDUCE_MEAN, x, axes=(1,), keepdims=True)
    c = b.emit(Op.SUB, x, mu)
    var = b.emit(Op.REDUCE_MEAN, b.emit(Op.MUL, c, c), axes=(1,), keepdims=True)
    y = b.emit(Op.DIV, c, b.emit(Op.SQRT, b.emit(Op.ADD, var, b.scalar(1e-5, F))))
    return b.emit(Op.MUL, y, b.const(RNG.standard_normal(d).astype(np.float32), name="gamma"))


def test_layernorm_bias_that_broadcasts_along_rows_is_not_taken_for_a_vector() -> None:
    d = 4
    b = GraphBuilder()
    x = b.input("x", (d, d), F)
    beta = b.const(np.arange(d, dtype=np.float32).reshape(d, 1) * 10, name="beta")  # one bias per row
    b.output(b.emit(Op.ADD, _standardized(b, x, d), beta), "y")
    g = b.build()
    res = recognize_norms.run(g, PassOptions())
    _same(g, res.graph, {"x": RNG.standard_normal((d, d)).astype(np.float32)})


def test_a_norm_weight_that_adds_an_axis_is_declined_not_raised() -> None:
    d = 4
    b = GraphBuilder()
    x = b.input("x", (3, d), F)
    ms = b.emit(Op.REDUCE_MEAN, b.emit(Op.MUL, x, x), axes=(1,), keepdims=True)
    y = b.emit(Op.DIV, x, b.emit(Op.SQRT, b.emit(Op.ADD, ms, b.scalar(1e-6, F))))
    b.output(b.emit(Op.MUL, y, b.const(np.ones((1, 1, d), np.float32), name="w")), "y")  # -> [1, 3, d]
    g = b.build()
    opts = PassOptions()
    res = recognize_norms.run(g, opts)
    _same(g, res.graph, {"x": RNG.standard_normal((3, d)).astype(np.float32)})
    assert any("broadcasts" in str(d) for d in opts.declines)


def _attention(trans_qk: bool, trans_pv: bool, s: int, t: int, mask: np.ndarray | None = None):  # noqa: ANN202
    b = GraphBuilder()
    q = b.input("q", (1, 2, s, 8), F)
    k, v = b.input("k", (1, 2, t, 8), F), b.input("v", (1, 2, t, 8), F)
    kt = b.emit(Op.TRANSPOSE, k, perm=(0, 1, 3, 2))
    sc = b.emit(Op.MUL, b.emit(Op.MATMUL, q, kt, trans_b=trans_qk), b.scalar(0.125, F))
    if mask is not None:
        sc = b.emit(Op.ADD, sc, b.const(mask, name="mask"))
    o = b.emit(Op.MATMUL, b.emit(Op.SOFTMAX, sc, axis=3), v, trans_b=trans_pv)
    b.output(o, "o")
    g = b.build()
    feeds = {"q": RNG.standard_normal((1, 2, s, 8)).astype(np.float32),
             "k": RNG.standard_normal((1, 2, t, 8)).astype(np.float32),
             "v": RNG.standard_normal((1, 2, t, 8)).astype(np.float32)}
    return g, feeds


def test_products_read_with_trans_b_are_not_attention() -> None:
    for trans_qk, trans_pv in ((True, False), (False, True)):  # t == head dim: the shapes alone agree
        g, feeds = _attention(trans_qk, trans_pv, 8, 8)
        res = recognize_attention.run(g, PassOptions())
        assert Op.ATTENTION not in {n.op for n in res.graph.nodes}
        _same(g, res.graph, feeds)
    g, feeds = _attention(False, False, 8, 8)  # the plain products still are
    res = recognize_attention.run(g, PassOptions())
    assert Op.ATTENTION in {n.op for n in res.graph.nodes}
    _same(g, res.graph, feeds)


def test_a_causal_looking_mask_with_more_queries_than_keys_stays_a_mask() -> None:
    lowest = np.finfo(np.float32).min
    for s, t in ((8, 4), (4, 8)):
        keep = np.tril(np.ones((s, t), bool), k=t - s)
        g, feeds = _attention(False, False, s, t, np.where(keep, 0, lowest).astype(np.float32))
        res = recognize_attention.run(g, PassOptions())
        (att,) = [n for n in res.graph.nodes if n.op == Op.ATTENTION]
        assert att.attrs.causal == (s <= t)
        _same(g, res.graph, feeds)
        assert not np.isnan(reference.run(res.graph, feeds)["o"]).any()
