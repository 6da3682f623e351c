"""transpose_cache (weight TRANSPOSE folded into constants) and merge_gemms (shared-input GEMMs)."""

from __future__ import annotations

import numpy as np

from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, Value, print_graph, verify
from fusec.ops import Op
from fusec.passes import merge_gemms, transpose_cache
from fusec.passes.base import PassOptions

RNG = np.random.default_rng(20261123)
F = DType.F32


def _run(mod, g: Graph, opts: PassOptions | None = None) -> tuple[Graph, PassOptions]:  # type: ignore[no-untyped-def]
    opts = opts or PassOptions()
    out = mod.run(g, opts).graph
    verify(out)
    return out, opts


def _same(g0: Graph, g1: Graph) -> None:
    inputs = {v.name: (RNG.integers(0, 10, v.shape) if v.dtype.is_int else RNG.standard_normal(v.shape))
              .astype(v.dtype.np) for v in g0.inputs}
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k], r0[k], rtol=1e-5, atol=1e-5)


def _w(b: GraphBuilder, shape: tuple[int, ...], name: str) -> Value:
    return b.const(RNG.standard_normal(shape).astype(np.float32), name=name)


def _linear(b: GraphBuilder, x: Value, name: str, d_in: int, d_out: int, bias: bool = True) -> Value:
    y = b.emit(Op.MATMUL, x, b.emit(Op.TRANSPOSE, _w(b, (d_out, d_in), f"{name}.weight"), perm=(1, 0)))
    return b.emit(Op.ADD, y, _w(b, (d_out,), f"{name}.bias")) if bias else y


def test_linear_weight_transposes_become_constants() -> None:
    b = GraphBuilder("mlp")
    x = b.input("x", (2, 5, 16), F)
    h = _linear(b, x, "fc1", 16, 32)
    b.output(_linear(b, b.emit(Op.RELU, h), "fc2", 32, 16), "y")
    g = b.build()
    out, opts = _run(transpose_cache, g)
    assert Op.TRANSPOSE not in [n.op for n in out.nodes]
    assert out.meta["transposes_cached"] == 2 and opts.stats["transposes_cached"] == 2
    mm = [n for n in out.nodes if n.op == Op.MATMUL]
    assert all(n.inputs[1].data is not None and n.inputs[1].data.flags.c_contiguous for n in mm)
    assert {c.name for c in out.constants} >= {"fc1.weight.T", "fc2.weight.T"}
    assert "fc1.weight" not in {c.name for c in out.constants}  # the [out, in] copy is gone
    _same(g, out)


def _tied(vocab: int = 10, dim: int = 8, dtype: DType = F) -> Graph:
    b = GraphBuilder("tied")
    ids = b.input("ids", (2, 4), DType.I64)
    table = b.const(RNG.standard_normal((vocab, dim)).astype(np.float32), name="embed.weight", dtype=dtype)
    x = b.emit(Op.GATHER, table, ids, axis=0)
    b.output(b.emit(Op.MATMUL, x, b.emit(Op.TRANSPOSE, table, perm=(1, 0))), "logits")
    return b.build()


def test_tied_embedding_is_read_through_the_transpose_flag_not_copied() -> None:
    g = _tied()
    out, opts = _run(transpose_cache, g)
    assert [n.op for n in out.nodes] == [Op.GATHER, Op.MATMUL]
    gather, mm = out.nodes
    assert mm.attrs.trans_b and mm.inputs[1] is gather.inputs[0]  # one table, read by both
    assert [c.name for c in out.constants] == ["embed.weight"] and out.weight_bytes == g.weight_bytes
    assert "transpose_cache_extra_bytes" not in opts.stats
    assert out.meta["transposes_flagged"] == 1 and out.meta["transposes_cached"] == 0
    assert "matmul[trans_b=True]" in print_graph(out)
    _same(g, out)


def test_transpose_read_by_a_non_gemm_is_declined() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 4), F)
    wt = b.emit(Op.TRANSPOSE, _w(b, (4, 4), "w"), perm=(1, 0))
    b.output(b.emit(Op.ADD, b.emit(Op.MATMUL, x, wt), wt), "y")
    g = b.build()
    out, opts = _run(transpose_cache, g)
    assert out.meta["transposes_cached"] == 0
    assert any(p == "transpose_cache" and "add" in r for p, _, r in opts.declines)
    _same(g, out)


def _qkv(bias: tuple[bool, bool, bool] = (True, True, True), shared: bool = True) -> Graph:
    b = GraphBuilder("qkv")
    x = b.input("x", (2, 5, 16), F)
    x2 = x if shared else b.input("x2", (2, 5, 16), F)
    outs = []
    for i, (n, d, has_b) in enumerate(zip("qkv", (16, 8, 8), bias)):
        y = b.emit(Op.MATMUL, x if i == 0 else x2, _w(b, (16, d), f"layers.0.attn.{n}_proj.weight"))
        if has_b:
            y = b.emit(Op.ADD, y, _w(b, (d,), f"layers.0.attn.{n}_proj.bias"))
        outs.append(b.emit(Op.RELU, y))
    for i, o in enumerate(outs):
        b.output(o, f"o{i}")
    return b.build()


def test_qkv_with_biases_merge_into_one_gemm_and_bias() -> None:
    g = _qkv()
    out, opts = _run(merge_gemms, g)
    ops = [n.op for n in out.nodes]
    assert ops.count(Op.MATMUL) == 1 and ops.count(Op.ADD) == 1 and ops.count(Op.SLICE) == 3
    mm = next(n for n in out.nodes if n.op == Op.MATMUL)
    assert mm.inputs[1].shape == (16, 32) and out.meta["gemms_merged"] == 1
    assert opts.stats["gemms_merged_branches"] == 3
    _same(g, out)


def test_mixed_bias_uses_zeros_and_separate_inputs_do_not_merge() -> None:
    g = _qkv(bias=(True, False, True))
    out, _ = _run(merge_gemms, g)
    assert [n.op for n in out.nodes].count(Op.MATMUL) == 1
    _same(g, out)
    g2 = _qkv(shared=False)  # q reads x, k and v read x2: only k and v merge
    out2, _ = _run(merge_gemms, g2)
    assert [n.op for n in out2.nodes].count(Op.MATMUL) == 2 and out2.meta["gemms_merged"] == 1
    _same(g2, out2)


def test_merge_requires_cached_transposes() -> None:
    assert "transpose_cache" in merge_gemms.REQUIRES
    b = GraphBuilder()
    x = b.input("x", (3, 8), F)
    for i in range(2):  # weights still behind TRANSPOSE nodes: not constants, nothing merges
        b.output(_linear(b, x, f"p{i}", 8, 4, bias=False), f"y{i}")
    out, _ = _run(merge_gemms, b.build())
    assert out.meta["gemms_merged"] == 0
