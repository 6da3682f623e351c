"""IR -> ONNX export: onnxruntime must compute what the reference computes, op by op and for the
built-in models; the checker must accept the file; a failed export must leave nothing behind."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from fusec import models, onnx_export, reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph
from fusec.onnx_export import export_onnx
from fusec.ops import FusionKind, Op


def ort_run(path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the test machine's cores are shared
    sess = ort.InferenceSession(os.fspath(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def model_feed(g: Graph, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    bsz, seq = g.inputs[0].shape
    mask = np.ones((bsz, seq), np.int64)
    mask[-1, seq // 2:] = 0
    return {"input_ids": rng.integers(0, vocab, (bsz, seq), dtype=np.int64), "attention_mask": mask}


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"])
def test_models_export_and_match_reference(name: str, tmp_path: Path) -> None:
    g = models.build(name, {"input_ids": (2, 10), "attention_mask": (2, 10)}, seed=3)
    path = tmp_path / f"{name}.onnx"
    export_onnx(g, path)
    model = onnx.load(os.fspath(path))
    onnx.checker.check_model(model, full_check=True)  # also runs shape inference against value_info
    assert model.opset_import[0].version == onnx_export.OPSET
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in model.graph.output] == [g.outputs[0].name]
    feed = model_feed(g, models.get_config(name).vocab_size, np.random.default_rng(20261123))
    want = reference.run(g, feed)[g.outputs[0].name]
    got = ort_run(path, feed)[g.outputs[0].name]
    assert got.shape == want.shape
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel <= 1e-5, f"relative error {rel:.3g}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp files or data file left


# ---- every IR op -----------------------------------------------------------------------------


class Case:
    """A one-op graph plus random inputs for it."""

    def __init__(self, name: str) -> None:
        self.b = GraphBuilder(name)
        self.feed: dict[str, np.ndarray] = {}
        self.rng = np.random.default_rng(20261124)

    def x(self, shape: tuple[int, ...], dt: DType = DType.F32, kind: str = "normal") -> Any:
        r = self.rng
        if dt == DType.BOOL:
            arr = r.random(shape) < 0.5
        elif dt.is_int:
            arr = r.integers(-7, 8, shape).astype(dt.np)
        elif kind == "positive":
            arr = r.uniform(0.5, 2.0, shape).astype(dt.np)
        else:
            arr = r.standard_normal(shape).astype(dt.np)
        name = f"in{len(self.feed)}"
        self.feed[name] = arr
        return self.b.input(name, shape, dt)

    def out(self, op: Op, *ins: Any, **attrs: Any) -> Case:
        self.b.output(self.b.emit(op, *ins, **attrs), "y")
        return self


def _unary(op: Op, kind: str = "normal", **attrs: Any) -> Callable[[Case], Case]:
    return lambda c: c.out(op, c.x((3, 5), kind=kind), **attrs)


def _binary(op: Op, dt: DType = DType.F32, kind: str = "normal") -> Callable[[Case], Case]:
    return lambda c: c.out(op, c.x((3, 5), dt, kind), c.x((5,), dt, kind))  # with broadcasting


def _nonfinite(c: Case, op: Op, **attrs: Any) -> Case:
    x = c.x((2, 4))
    c.feed[x.name][0, :3] = [np.nan, np.inf, -np.inf]
    return c.out(op, x, **attrs)


def _int_div(c: Case) -> Case:
    a, d = c.x((2, 6), DType.I64), c.x((6,), DType.I64)
    c.feed[d.name] = np.array([2, -2, 3, -3, 5, 1], np.int64)
    return c.out(Op.DIV, a, d)


def _gather(c: Case, op: Op, idx_shape: tuple[int, ...], hi: int, **attrs: Any) -> Case:
    data = c.x((4, 5))
    idx = c.b.const(c.rng.integers(-hi if op == Op.GATHER else 0, hi, idx_shape), name="idx")
    return c.out(op, data, idx, **attrs)


def _gather_nd(c: Case, batch_dims: int) -> Case:
    data = c.x((2, 3, 4))
    idx = c.b.const(np.array([[[1], [2]], [[0], [2]]]) if batch_dims else np.array([[0, 1], [1, 2]]), name="idx")
    return c.out(Op.GATHER_ND, data, idx, batch_dims=batch_dims)


def _scatter_nd(c: Case) -> Case:
    data, upd = c.x((4, 3)), c.x((2, 3))
    return c.out(Op.SCATTER_ND, data, c.b.const(np.array([[3], [1]]), name="idx"), upd)


def _rmsnorm(c: Case, dt: DType, offset: float) -> Case:
    return c.out(Op.RMSNORM, c.x((2, 3, 8), dt), c.b.const(c.rng.standard_normal(8).astype(np.float32), name="w"),
                 eps=1e-6, weight_offset=offset)


CASES: dict[str, Callable[[Case], Case]] = {
    **{op.value: _unary(op) for op in (Op.NEG, Op.ABS, Op.EXP, Op.ERF, Op.TANH, Op.SIGMOID, Op.RELU, Op.COS,
                                       Op.SIN, Op.SILU)},
    **{op.value: _unary(op, "positive") for op in (Op.LOG, Op.SQRT, Op.RECIPROCAL)},
    "gelu": _unary(Op.GELU), "gelu_tanh": _unary(Op.GELU, approximate="tanh"),
    "not": lambda c: c.out(Op.NOT, c.x((3, 4), DType.BOOL)),
    "isnan": lambda c: _nonfinite(c, Op.ISNAN),
    "isinf": lambda c: _nonfinite(c, Op.ISINF), "isinf_pos": lambda c: _nonfinite(c, Op.ISINF, detect_negative=False),
    "cast_f16": lambda c: c.out(Op.CAST, c.x((3, 4)), to=DType.F16),
    "cast_i64": lambda c: c.out(Op.CAST, c.x((3, 4), DType.I64), to=DType.F32),
    "cast_bool": lambda c: c.out(Op.CAST, c.x((3, 4), DType.BOOL), to=DType.F32),
    **{op.value: _binary(op) for op in (Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN)},
    "pow": _binary(Op.POW, kind="positive"), "div_int": _int_div,
    **{op.value: _binary(op, DType.I64) for op in (Op.EQUAL, Op.LESS, Op.LESS_EQUAL, Op.GREATER, Op.GREATER_EQUAL)},
    **{op.value: _binary(op, DType.BOOL) for op in (Op.AND, Op.OR)},
    "where": lambda c: c.out(Op.WHERE, c.x((3, 5), DType.BOOL), c.x((3, 5)), c.x((5,))),
    "reduce_sum": lambda c: c.out(Op.REDUCE_SUM, c.x((3, 4, 5)), axes=(0, 2), keepdims=False),
    "reduce_mean": lambda c: c.out(Op.REDUCE_MEAN, c.x((3, 4, 5)), axes=(2,), keepdims=True),
    "reduce_max": lambda c: c.out(Op.REDUCE_MAX, c.x((3, 4, 5)), axes=(1,), keepdims=False),
    "softmax": lambda c: c.out(Op.SOFTMAX, c.x((3, 7)), axis=1),
    "cumsum": lambda c: c.out(Op.CUMSUM, c.x((3, 6)), axis=1),
    "cumsum_excl_rev": lambda c: c.out(Op.CUMSUM, c.x((3, 6)), axis=1, exclusive=True, reverse=True),
    "layernorm": lambda c: c.out(Op.LAYERNORM, c.x((2, 3, 8)), c.x((8,)), c.x((8,)), axis=2, eps=1e-5),
    "layernorm_nobias": lambda c: c.out(Op.LAYERNORM, c.x((2, 3, 8)), c.x((3, 8)), axis=1, eps=1e-5),
    "rmsnorm": lambda c: _rmsnorm(c, DType.F32, 0.0), "rmsnorm_f16_offset": lambda c: _rmsnorm(c, DType.F16, 1.0),
    "matmul": lambda c: c.out(Op.MATMUL, c.x((2, 3, 4)), c.x((4, 5))),
    "reshape": lambda c: c.out(Op.RESHAPE, c.x((2, 3, 4)), shape=(6, 4)),
    "transpose": lambda c: c.out(Op.TRANSPOSE, c.x((2, 3, 4)), perm=(2, 0, 1)),
    "expand": lambda c: c.out(Op.EXPAND, c.x((3, 1)), shape=(2, 3, 4)),
    "concat": lambda c: c.out(Op.CONCAT, c.x((2, 3)), c.x((2, 1)), c.x((2, 2)), axis=1),
    "slice": lambda c: c.out(Op.SLICE, c.x((4, 6)), axes=(0, 1), starts=(1, 0), ends=(4, 6), steps=(1, 2)),
    "slice_reverse": lambda c: c.out(Op.SLICE, c.x((4, 6)), axes=(1,), starts=(5,), ends=(-1,), steps=(-1,)),
    "gather": lambda c: _gather(c, Op.GATHER, (2, 3), 4, axis=0),
    "gather_elements": lambda c: _gather(c, Op.GATHER_ELEMENTS, (4, 2), 5, axis=1),
    "gather_nd": lambda c: _gather_nd(c, 0), "gather_nd_batch": lambda c: _gather_nd(c, 1),
    "scatter_nd": _scatter_nd,
    "tile": lambda c: c.out(Op.TILE, c.x((2, 3)), repeats=(2, 1)),
    "trilu_upper": lambda c: c.out(Op.TRILU, c.x((4, 5)), upper=True, k=1),
    "trilu_lower": lambda c: c.out(Op.TRILU, c.x((4, 5)), upper=False, k=-1),
}



# High-level ops from the pattern passes; only where the IR defines them.
def _attention(c: Case, mask_kind: str) -> Case:
    q, k, v = c.x((2, 4, 5, 8)), c.x((2, 2, 5, 8)), c.x((2, 2, 5, 6))  # GQA: 4 query heads, 2 kv heads
    if mask_kind == "float":
        return c.out(Op.ATTENTION, q, k, v, c.x((2, 1, 5, 5)), scale=8 ** -0.5)
    keep = c.rng.random((2, 1, 1, 5)) < 0.7
    keep[1, 0, 0, :] = False  # a fully masked batch row: NaN probabilities, zeroed
    return c.out(Op.ATTENTION, q, k, v, c.b.const(keep, name="keep"), scale=0.3, causal=True, nan_to_zero=True)


def _fused_body() -> Graph:
    b = GraphBuilder("body")
    x, y = b.input("x", (3, 5), DType.F32), b.input("y", (5,), DType.F32)
    h = b.emit(Op.ADD, b.emit(Op.MUL, x, b.const(np.float32(1.5), name="k")), y)
    b.output(b.emit(Op.GELU, h, approximate="tanh"), "o1")
    b.output(x, "o2")  # an input passed straight out
    return b.build()


def _fused(c: Case) -> Case:
    body = _fused_body()
    x, y = c.x((3, 5)), c.x((5,))
    o1, o2 = c.b.emit(Op.FUSED, x, y, kind=FusionKind.ELEMENTWISE, rule="test", body=body)
    p1, _ = c.b.emit(Op.FUSED, o1, y, kind=FusionKind.ELEMENTWISE, rule="test", body=body)  # the same body again
    return c.out(Op.ADD, p1, o2)


def _ints(c: Case, shape: tuple[int, ...], dt: DType, lo: int, hi: int) -> Any:
    x = c.x(shape, dt)
    c.feed[x.name] = c.rng.integers(lo, hi, shape).astype(dt.np)
    return x


CASES.update({
    **{op.value: _unary(op) for op in (Op.FLOOR, Op.CEIL, Op.ROUND, Op.SIGN)},
    "xor": _binary(Op.XOR, DType.BOOL),
    "mod": lambda c: c.out(Op.MOD, c.x((3, 5), DType.I64), _ints(c, (5,), DType.I64, 1, 6)),
    "fmod_f64": lambda c: c.out(Op.MOD, c.x((3, 5), DType.F64), c.x((5,), DType.F64, "positive"), fmod=True),
    "bit_shift_u8": lambda c: c.out(Op.BIT_SHIFT, _ints(c, (3, 5), DType.U8, 0, 256), _ints(c, (5,), DType.U8, 0, 8),
                                    left=True),
    "argmax": lambda c: c.out(Op.ARGMAX, c.x((3, 5)), axis=1, keepdims=False),
    "argmin_last": lambda c: c.out(Op.ARGMIN, _ints(c, (3, 5), DType.I32, 0, 3), axis=0, select_last_index=True),
    "topk": lambda c: c.out(Op.TOPK, c.x((3, 6)), axis=1, k=2, largest=False),
    "pad_constant": lambda c: c.out(Op.PAD, c.x((3, 4)), c.b.const(np.float32(2.5), name="fill"), pads=(1, 0, -1, 2)),
    "pad_reflect": lambda c: c.out(Op.PAD, c.x((3, 4)), pads=(1, 2, 1, 0), mode="reflect"),
    "reduce_min": lambda c: c.out(Op.REDUCE_MIN, c.x((3, 4, 5)), axes=(1,), keepdims=True),
    "reduce_prod": lambda c: c.out(Op.REDUCE_PROD, c.x((3, 4, 5), kind="positive"), axes=(0, 2), keepdims=False),
})


def test_ops_without_an_opset_17_form_are_refused_in_one_line(tmp_path: Path) -> None:
    from fusec.errors import ModelError

    c = Case("bitwise")
    c.out(Op.BITWISE_AND, c.x((3, 4), DType.I32), c.x((4,), DType.I32))
    with pytest.raises(ModelError, match="bitwise_and needs opset 18"):
        onnx_export.export_onnx(c.b.build(), tmp_path / "b.onnx")
    assert not (tmp_path / "b.onnx").exists()
    c = Case("wrap")
    c.out(Op.PAD, c.x((3, 4)), pads=(1, 1, 1, 1), mode="wrap")
    with pytest.raises(ModelError, match="wrap mode needs opset 19"):
        onnx_export.export_onnx(c.b.build(), tmp_path / "w.onnx")


if hasattr(Op, "ATTENTION"):
    CASES["attention_gqa_float_mask"] = lambda c: _attention(c, "float")
    CASES["attention_bool_causal"] = lambda c: _attention(c, "bool")
if hasattr(Op, "ROPE"):
    CASES["rope_partial"] = lambda c: c.out(Op.ROPE, c.x((1, 2, 5, 12)), c.x((1, 1, 5, 8)), c.x((1, 1, 5, 8)),
                                            rotary_dim=8)
    CASES["rope_full"] = lambda c: c.out(Op.ROPE, c.x((1, 2, 5, 8)), c.x((5, 8)), c.x((5, 8)), rotary_dim=8)
if hasattr(Op, "FUSED"):
    CASES["fused"] = _fused


def test_every_ir_op_is_mapped_and_covered() -> None:
    assert onnx_export.MAPPED_OPS | onnx_export.STATEFUL_OPS | onnx_export.UNEXPORTABLE_OPS == set(Op)
    assert not onnx_export.MAPPED_OPS & (onnx_export.STATEFUL_OPS | onnx_export.UNEXPORTABLE_OPS)
    def ops(g: Graph) -> set[Op]:
        return {n.op for n in g.nodes} | {o for n in g.nodes if hasattr(n.attrs, "body") for o in ops(n.attrs.body)}

    covered = {o for name, make in CASES.items() for o in ops(make(Case(name)).b.build())}
    assert covered == onnx_export.MAPPED_OPS


def test_packed_quantized_products_are_refused_in_one_line(tmp_path: Path) -> None:
    from fusec.errors import ModelError
    from fusec.models.llama import build_llama
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomPackedWeights

    cfg = get_config("llama-tiny")
    g = build_llama(cfg, 1, 8, RandomPackedWeights(lambda name: "Q8_0" if name.endswith("_proj.weight") else None))
    with pytest.raises(ModelError, match="packed quantized weights"):
        export_onnx(g, tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_generation_graphs_are_refused_in_one_line(tmp_path: Path) -> None:
    from fusec.errors import ModelError
    from fusec.genmodel import build_graphs, load_generation_model

    g = build_graphs(load_generation_model("llama-tiny"), 1, 8, 4, [])["decode"]
    with pytest.raises(ModelError, match="plan state"):
        export_onnx(g, tmp_path / "d.onnx")
    assert not (tmp_path / "d.onnx").exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_op_matches_reference(case: str, tmp_path: Path) -> None:
    c = CASES[case](Case(case))
    g = c.b.build()
    path = tmp_path / "op.onnx"
    export_onnx(g, path)
    onnx.checker.check_model(onnx.load(os.fspath(path)), full_check=True)
    want = reference.run(g, c.feed)["y"]
    got = ort_run(path, c.feed)["y"]
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


# ---- names, external data, atomicity -------------------------------------------------------


def test_odd_names_are_sanitized_and_inputs_as_outputs_work(tmp_path: Path) -> None:
    b = GraphBuilder('odd "graph"')
    x = b.input('in"put\n', (2, 3), DType.F32)
    y = b.emit(Op.NEG, x, name="a b")
    b.output(y, "ou t")
    b.output(x)  # an input that is also an output needs an Identity in ONNX
    g = b.build()
    path = tmp_path / "odd.onnx"
    export_onnx(g, path)
    model = onnx.load(os.fspath(path))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["in_put_"]
    out_names = [o.name for o in model.graph.output]
    assert out_names[0] == "ou_t" and len(set(out_names)) == 2
    xv = np.random.default_rng(20261125).standard_normal((2, 3)).astype(np.float32)
    got = ort_run(path, {"in_put_": xv})
    np.testing.assert_array_equal(got["ou_t"], -xv)
    np.testing.assert_array_equal(got[out_names[1]], xv)


def test_external_data_round_trip(tmp_path: Path) -> None:
    g = models.build("llama-tiny", {"input_ids": (1, 8), "attention_mask": (1, 8)})
    path = tmp_path / "m.onnx"
    export_onnx(g, path, external_data=True)
    data = tmp_path / "m.onnx.data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert data.stat().st_size >= 0.99 * g.weight_bytes and path.stat().st_size < g.weight_bytes / 10
    onnx.checker.check_model(os.fspath(path))
    feed = model_feed(g, models.get_config("llama-tiny").vocab_size, np.random.default_rng(20261126))
    want = reference.run(g, feed)["logits"]
    got = ort_run(path, feed)["logits"]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5


@pytest.mark.parametrize("external", [False, True])
def test_failed_export_leaves_nothing_behind(external: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = models.build("gpt2-tiny", {"input_ids": (1, 4), "attention_mask": (1, 4)})
    path = tmp_path / "fresh.onnx"
    old = tmp_path / "old.onnx"
    old.write_bytes(b"previous export")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("checker exploded")

    monkeypatch.setattr(onnx.checker, "check_model", broken)
    with pytest.raises(RuntimeError, match="checker exploded"):
        export_onnx(g, path, external_data=external)
    with pytest.raises(RuntimeError, match="checker exploded"):
        export_onnx(g, old, external_data=external)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.onnx"]  # no model, data or temp folder
    assert old.read_bytes() == b"previous export"  # an existing file is replaced only on success
