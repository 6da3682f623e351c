"""views: view_of against a brute-force oracle (is the output a contiguous run of the input's
row-major elements, and where does it start?), chain resolution, and the views pass record."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Node, Value
from fusec.ops import Op, PermAttrs, ShapeAttrs, SliceAttrs, infer
from fusec.passes import views
from fusec.passes.base import PassOptions


def _node(op: Op, shape: tuple[int, ...], attrs: object, dtype: DType = DType.F32) -> Node:
    x = Value("x", shape, dtype)
    ((oshape, odt),) = infer(op, attrs, [(shape, dtype)])
    return Node(op, [x], [Value("y", oshape, odt)], attrs)


def _oracle(node: Node) -> int | None:
    """Element offset of the output's first element if it is a contiguous run, else None."""
    x = node.inputs[0]
    flat = np.arange(x.numel).reshape(x.shape)
    sel = {
        Op.SLICE: lambda: flat[tuple(_py_slices(node.attrs, x.shape))],
        Op.TRANSPOSE: lambda: np.transpose(flat, node.attrs.perm),
        Op.EXPAND: lambda: np.broadcast_to(flat, node.attrs.shape),
        Op.RESHAPE: lambda: flat.reshape(node.attrs.shape),
    }[node.op]().ravel()
    if sel.size == 0:
        return None
    return int(sel[0]) if np.array_equal(sel, np.arange(sel[0], sel[0] + sel.size)) else None


def _py_slices(a: SliceAttrs, shape: tuple[int, ...]) -> list[slice]:
    idx = [slice(None)] * len(shape)
    for ax, s, e, stp in zip(a.axes, a.starts, a.ends, a.steps):
        idx[ax] = slice(s, e if e >= 0 else None, stp)
    return idx


def _check(node: Node) -> views.ViewInfo | None:
    info = views.view_of(node)
    want = _oracle(node)
    if want is None:
        assert info is None, f"{node.op.value} {node.attrs} on {node.inputs[0].shape} is not contiguous"
    else:
        assert info is not None, f"{node.op.value} {node.attrs} on {node.inputs[0].shape} is a contiguous run"
        assert info.base is node.inputs[0]
        assert info.byte_offset == want * node.inputs[0].dtype.itemsize
    return info


shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


@st.composite
def slices(draw: st.DrawFn) -> Node:
    shape = draw(shapes)
    axes = sorted(draw(st.sets(st.integers(0, len(shape) - 1), min_size=1)))
    starts, ends, steps = [], [], []
    for ax in axes:
        d = shape[ax]
        step = draw(st.sampled_from([1, 1, 1, 2, -1]))
        if step > 0:
            s = draw(st.integers(0, d - 1))
            e = draw(st.integers(s + 1, d))
        else:
            s = draw(st.integers(0, d - 1))
            e = draw(st.integers(-1, s - 1))
        starts.append(s)
        ends.append(e)
        steps.append(step)
    return _node(Op.SLICE, shape, SliceAttrs(tuple(axes), tuple(starts), tuple(ends), tuple(steps)),
                 draw(st.sampled_from([DType.F32, DType.F16, DType.I64])))


@settings(max_examples=300, deadline=None)
@given(slices())
def test_slice_view_rule_matches_brute_force(node: Node) -> None:
    _check(node)


@settings(max_examples=150, deadline=None)
@given(shapes.flatmap(lambda s: st.tuples(st.just(s), st.permutations(range(len(s))))))
def test_transpose_view_rule_matches_brute_force(case: tuple[tuple[int, ...], list[int]]) -> None:
    shape, perm = case
    _check(_node(Op.TRANSPOSE, shape, PermAttrs(tuple(perm))))


def test_concrete_slice_cases() -> None:
    # rows 1..2 of a [4, 8] matrix: contiguous, starts at element 8
    rows = _check(_node(Op.SLICE, (4, 8), SliceAttrs((0,), (1,), (3,), (1,))))
    assert rows is not None and rows.byte_offset == 8 * 4
    # a column block is not contiguous
    assert _check(_node(Op.SLICE, (4, 8), SliceAttrs((1,), (0,), (4,), (1,)))) is None
    # q/k/v split of a [1, T, 3D] projection along the last axis: not contiguous for T > 1 ...
    assert _check(_node(Op.SLICE, (1, 5, 24), SliceAttrs((2,), (8,), (16,), (1,)))) is None
    # ... but it is for T == 1 (decode): leading axes of extent 1
    kv = _check(_node(Op.SLICE, (1, 1, 24), SliceAttrs((2,), (8,), (16,), (1,))))
    assert kv is not None and kv.byte_offset == 8 * 4
    # a single row picked with a step still is one contiguous row
    assert _check(_node(Op.SLICE, (4, 8), SliceAttrs((0,), (3,), (4,), (5,)))) is not None
    # reversal of a whole axis is a copy
    assert _check(_node(Op.SLICE, (4, 8), SliceAttrs((0,), (3,), (-1,), (-1,)))) is None


def test_reshape_expand_and_non_view_ops() -> None:
    assert _check(_node(Op.RESHAPE, (2, 3, 4), ShapeAttrs((6, 4)))) is not None
    assert _check(_node(Op.EXPAND, (3, 4), ShapeAttrs((1, 1, 3, 4)))) is not None
    assert _check(_node(Op.EXPAND, (1, 4), ShapeAttrs((3, 4)))) is None  # a real broadcast
    assert _check(_node(Op.TRANSPOSE, (1, 5, 1, 6), PermAttrs((2, 1, 0, 3)))) is not None
    assert _check(_node(Op.TRANSPOSE, (2, 5, 1, 6), PermAttrs((0, 3, 2, 1)))) is None
    b = GraphBuilder()
    x = b.input("x", (2, 3), DType.F32)
    b.output(b.emit(Op.NEG, x))
    b.output(b.emit(Op.CAST, x, to=DType.F16))
    assert all(views.view_of(n) is None for n in b.build().nodes)


def test_chains_resolve_to_the_ultimate_base_and_pass_counts_views() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 6, 8), DType.F32)
    t = b.emit(Op.EXP, x)
    s1 = b.emit(Op.SLICE, t, axes=(0,), starts=(2,), ends=(4,), steps=(1,))  # offset 2*48 elems
    r = b.emit(Op.RESHAPE, s1, shape=(12, 8))
    s2 = b.emit(Op.SLICE, r, axes=(0,), starts=(5,), ends=(7,), steps=(1,))  # + 5*8 elems
    col = b.emit(Op.SLICE, r, axes=(1,), starts=(0,), ends=(4,), steps=(1,))  # not a view
    b.output(b.emit(Op.NEG, s2), "a")
    b.output(b.emit(Op.NEG, col), "b")
    g = b.build()
    chains = views.resolve(g)
    assert chains[s2] == (t, (2 * 48 + 5 * 8) * 4)
    assert chains[r] == (t, 2 * 48 * 4)
    assert col not in chains
    opts = PassOptions()
    g.meta["keep"] = 1
    res = views.run(g, opts)
    assert res.graph.meta == {"keep": 1, "views": 3}
    assert not res.changed and res.graph.nodes == g.nodes
    assert "views" not in g.meta  # the input graph's record is untouched
