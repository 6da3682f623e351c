"""Per-op ONNX import: a one-node model per case, run by fusec's reference and by onnxruntime.

Each case names the ONNX op, its inputs (run-time graph inputs with random non-zero data, or
constants stored as initializers), attributes and opset; ``ops`` lists IR ops the import must
contain (e.g. Split -> SLICE nodes). Run-time inputs keep the op from being folded away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from fusec import reference
from fusec.frontend.onnx_import import import_onnx
from fusec.ir import verify

rng = np.random.default_rng(20261123)  # seeded: a failure must be reproducible
# Ops whose outputs are sums of many products: fp32 accumulation in another order (numpy's BLAS vs
# onnxruntime's) differs by ~K * 2^-24 * the terms' magnitude, which cancellation can leave far above
# 1e-5 of the (small) result, so their absolute tolerance scales with the output's magnitude.
CONTRACTIONS = {"Gemm", "MatMul", "Conv", "ConvTranspose", "Einsum"}

_ELEM = {"f": TensorProto.FLOAT, "h": TensorProto.FLOAT16, "i": TensorProto.INT64, "b": TensorProto.BOOL,
         "i32": TensorProto.INT32}


def _data(kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """Random non-zero data of a kind: f (normal, |x|>=0.1), pos, h (fp16), i (small ints), b, nan, inf."""
    if kind in ("f", "h"):
        x = rng.standard_normal(shape).astype(np.float32)
        x = np.where(np.abs(x) < 0.1, np.sign(x + 1e-9) * 0.5, x)
        return x.astype(np.float16 if kind == "h" else np.float32)
    if kind == "pos":
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if kind in ("i", "i32"):
        return rng.integers(-3, 4, shape).astype(np.int64 if kind == "i" else np.int32)
    if kind == "b":
        return rng.random(shape) < 0.5
    if kind in ("nan", "inf"):
        x = rng.standard_normal(shape).astype(np.float32)
        special = np.array([np.nan, np.inf, -np.inf], np.float32) if kind == "inf" else np.float32(np.nan)
        mask = rng.random(shape) < 0.3
        x[mask] = special if kind == "nan" else rng.choice(special, size=int(mask.sum()))
        return x
    raise ValueError(kind)


@dataclass
class Case:
    id: str
    op: str
    ins: list[Any]  # (shape, kind) -> run-time input; np.ndarray -> initializer; None -> omitted
    attrs: dict[str, Any] = field(default_factory=dict)
    opset: int = 18
    out: str | tuple[str, ...] = "f"  # elem kind per output
    ops: tuple[str, ...] = ()  # IR ops the import must contain
    tol: float = 1e-5


def C(id: str, op: str, *ins: Any, **kw: Any) -> Case:
    return Case(id, op, list(ins), **kw)


F = lambda *s: (s, "f")  # a run-time fp32 input of shape s
I64 = lambda *xs: np.array(xs, np.int64)

CASES = [
    *[C(op, op, F(3, 4), ops=(ir,)) for op, ir in [
        ("Neg", "neg"), ("Abs", "abs"), ("Exp", "exp"), ("Reciprocal", "reciprocal"), ("Erf", "erf"),
        ("Tanh", "tanh"), ("Sigmoid", "sigmoid"), ("Relu", "relu"), ("Cos", "cos"), ("Sin", "sin")]],
    C("Log", "Log", ((3, 4), "pos"), ops=("log",)),
    C("Sqrt", "Sqrt", ((3, 4), "pos"), ops=("sqrt",)),
    C("Not", "Not", ((3, 4), "b"), out="b", ops=("not",)),
    C("IsNaN", "IsNaN", ((3, 4), "nan"), out="b", ops=("isnan",)),
    C("IsInf", "IsInf", ((3, 4), "inf"), out="b", ops=("isinf",)),
    C("IsInf-neg-only", "IsInf", ((3, 4), "inf"), attrs={"detect_positive": 0}, out="b"),
    C("Gelu", "Gelu", F(3, 4), opset=20, ops=("gelu",)),
    C("Gelu-tanh", "Gelu", F(3, 4), attrs={"approximate": "tanh"}, opset=20, ops=("gelu",)),
    *[C(op, op, F(2, 3, 4), F(4), ops=(ir,)) for op, ir in [
        ("Add", "add"), ("Sub", "sub"), ("Mul", "mul"), ("Div", "div")]],
    C("Add-fp16", "Add", ((3, 4), "h"), ((3, 4), "h"), out="h", tol=1e-3),
    C("Add-const-rhs", "Add", F(3, 4), rng.standard_normal((1, 4)).astype(np.float32)),
    C("Div-int", "Div", ((3, 4), "i"), np.array([2, -3, 5, -7], np.int64), out="i"),
    C("Pow", "Pow", ((3, 4), "pos"), F(3, 4), ops=("pow",)),
    C("Pow-scalar", "Pow", F(3, 4), np.array(2.0, np.float32)),
    *[C(op, op, ((3, 4), "i"), ((4,), "i"), out="b", ops=(ir,)) for op, ir in [
        ("Equal", "equal"), ("Less", "less"), ("LessOrEqual", "less_equal"), ("Greater", "greater"),
        ("GreaterOrEqual", "greater_equal")]],
    C("Less-float", "Less", F(3, 4), F(3, 4), out="b"),
    C("And", "And", ((3, 4), "b"), ((3, 4), "b"), out="b", ops=("and",)),
    C("Or", "Or", ((3, 4), "b"), ((1, 4), "b"), out="b", ops=("or",)),
    C("Where", "Where", ((3, 4), "b"), F(3, 4), F(4), ops=("where",)),
    C("Max-3", "Max", F(3, 4), F(4), F(3, 1), ops=("max",)),
    C("Min-3", "Min", F(3, 4), F(4), F(3, 1), ops=("min",)),
    C("Max-1", "Max", F(3, 4)),
    C("Sum-3", "Sum", F(3, 4), F(4), F(3, 4), ops=("add",)),
    C("Clip", "Clip", F(3, 4), np.array(-0.5, np.float32), np.array(0.7, np.float32), ops=("max", "min")),
    C("Clip-min-only", "Clip", F(3, 4), np.array(-0.5, np.float32)),
    C("Clip-max-only", "Clip", F(3, 4), None, np.array(0.3, np.float32), ops=("min",)),
    C("Cast-f16", "Cast", F(3, 4), attrs={"to": TensorProto.FLOAT16}, out="h", ops=("cast",)),
    C("Cast-i64", "Cast", F(3, 4), attrs={"to": TensorProto.INT64}, out="i"),
    C("Cast-bool", "Cast", F(3, 4), attrs={"to": TensorProto.BOOL}, out="b"),
    C("Cast-from-bool", "Cast", ((3, 4), "b"), attrs={"to": TensorProto.FLOAT}),
    C("Cast-i32", "Cast", ((3, 4), "i"), attrs={"to": TensorProto.INT32}, out="i32"),
    C("CastLike", "CastLike", ((3, 4), "i"), F(1), ops=("cast",)),
    C("Identity", "Identity", F(3, 4)),
    C("Dropout", "Dropout", F(3, 4), opset=13),
    C("MatMul-2d", "MatMul", F(3, 4), F(4, 5), ops=("matmul",)),
    C("MatMul-3d-2d", "MatMul", F(2, 3, 4), F(4, 5)),
    C("MatMul-4d", "MatMul", F(2, 3, 4, 8), F(2, 3, 8, 5)),
    C("MatMul-1d", "MatMul", F(4), F(4, 5)),
    C("Gemm", "Gemm", F(3, 4), F(4, 5), ops=("matmul",)),
    C("Gemm-transA", "Gemm", F(4, 3), F(4, 5), attrs={"transA": 1}, ops=("transpose", "matmul")),
    C("Gemm-transB-bias", "Gemm", F(3, 4), F(5, 4), F(5), attrs={"transB": 1}, ops=("transpose", "matmul", "add")),
    C("Gemm-alpha-beta", "Gemm", F(3, 4), F(4, 5), F(3, 5), attrs={"alpha": 0.5, "beta": 2.0}),
    C("Gemm-weight-transB", "Gemm", F(3, 96), rng.standard_normal((64, 96)).astype(np.float32),
      rng.standard_normal(64).astype(np.float32), attrs={"transB": 1}, ops=("transpose",)),
    C("Softmax", "Softmax", F(2, 3, 5), opset=13, ops=("softmax",)),
    C("Softmax-axis1", "Softmax", F(2, 3, 5), attrs={"axis": 1}),
    C("LayerNorm", "LayerNormalization", F(2, 3, 8), F(8), F(8), attrs={"epsilon": 1e-3}, ops=("layernorm",)),
    C("LayerNorm-axis1-nobias", "LayerNormalization", F(2, 3, 8), F(3, 8), attrs={"axis": 1}),
    C("ReduceMean-13", "ReduceMean", F(2, 3, 4), attrs={"axes": [-1]}, opset=13, ops=("reduce_mean",)),
    C("ReduceMean-18", "ReduceMean", F(2, 3, 4), I64(-1), opset=18, ops=("reduce_mean",)),
    C("ReduceMean-18-nokeep", "ReduceMean", F(2, 3, 4), I64(0, 2), attrs={"keepdims": 0}),
    C("ReduceSum-13", "ReduceSum", F(2, 3, 4), I64(1), opset=13, ops=("reduce_sum",)),
    C("ReduceSum-all", "ReduceSum", F(2, 3, 4), attrs={"keepdims": 0}),
    C("ReduceSum-noop", "ReduceSum", F(2, 3, 4), attrs={"noop_with_empty_axes": 1}),
    C("ReduceMax-18", "ReduceMax", F(2, 3, 4), I64(1, 2), ops=("reduce_max",)),
    C("ReduceMax-13", "ReduceMax", F(2, 3, 4), attrs={"axes": [0], "keepdims": 0}, opset=13),
    C("Transpose", "Transpose", F(2, 3, 4), attrs={"perm": [1, 2, 0]}, ops=("transpose",)),
    C("Transpose-default", "Transpose", F(2, 3, 4)),
    C("Reshape-0-neg1", "Reshape", F(2, 3, 4), I64(0, -1), ops=("reshape",)),
    C("Reshape-neg1-first", "Reshape", F(2, 3, 4), I64(-1, 4, 1)),
    C("Flatten", "Flatten", F(2, 3, 4), ops=("reshape",)),
    C("Flatten-axis0", "Flatten", F(2, 3, 4), attrs={"axis": 0}),
    C("Flatten-axis-neg1", "Flatten", F(2, 3, 4), attrs={"axis": -1}),
    C("Squeeze-axes", "Squeeze", F(2, 1, 4, 1), I64(-1), ops=("reshape",)),
    C("Squeeze-all", "Squeeze", F(2, 1, 4, 1)),
    C("Unsqueeze", "Unsqueeze", F(2, 4), I64(0, -1), ops=("reshape",)),
    C("Concat", "Concat", F(2, 3), F(2, 1), rng.standard_normal((2, 2)).astype(np.float32), attrs={"axis": -1},
      ops=("concat",)),
    C("Split-sizes", "Split", F(2, 7), I64(2, 5), attrs={"axis": 1}, out=("f", "f"), ops=("slice",)),
    C("Split-equal-13", "Split", F(6, 3), out=("f", "f", "f"), opset=13, ops=("slice",)),
    C("Split-num-outputs-uneven", "Split", F(2, 7), attrs={"axis": 1, "num_outputs": 3}, out=("f", "f", "f")),
    C("Slice", "Slice", F(5, 6), I64(1, -4), I64(4, 100), ops=("slice",)),
    C("Slice-neg-step", "Slice", F(5, 6), I64(-1, 4), I64(-100, 0), I64(0, 1), I64(-1, -2)),
    C("Slice-neg-step-partial", "Slice", F(5, 6), I64(3), I64(0), I64(1), I64(-2)),
    C("Slice-step2-axes", "Slice", F(5, 6, 3), I64(0), I64(9223372036854775807), I64(-2), I64(2)),
    C("Gather", "Gather", F(5, 4), ((2, 3), "i"), ops=("gather",)),
    C("Gather-axis1-scalar", "Gather", F(5, 4), np.array(-1, np.int64), attrs={"axis": 1}),
    C("GatherElements", "GatherElements", F(3, 4), ((3, 2), "i"), attrs={"axis": 1}, ops=("gather_elements",)),
    C("GatherND", "GatherND", F(3, 4, 2), np.array([[0, 1], [2, -1]], np.int64), ops=("gather_nd",)),
    C("GatherND-batch", "GatherND", F(3, 4, 2), np.array([[1], [0], [3]], np.int64), attrs={"batch_dims": 1}),
    C("Expand", "Expand", F(3, 1), I64(2, 1, 4), ops=("expand",)),
    C("Tile", "Tile", F(2, 3), I64(2, 1), ops=("tile",)),
    C("Range-int", "Range", np.array(1, np.int64), np.array(10, np.int64), np.array(3, np.int64), out="i"),
    C("Range-float", "Range", np.array(0.5, np.float32), np.array(-2, np.float32), np.array(-0.7, np.float32)),
    C("Shape", "Shape", F(2, 3, 4), out="i"),
    C("Shape-start-end", "Shape", F(2, 3, 4), attrs={"start": 1, "end": -1}, out="i"),
    C("Size", "Size", F(2, 3, 4), out="i"),
    C("ConstantOfShape", "ConstantOfShape", I64(2, 3),
      attrs={"value": helper.make_tensor("v", TensorProto.INT64, [1], [7])}, out="i"),
    C("Constant", "Constant", attrs={"value_floats": [1.5, -2.0, 3.0]}),
    C("Trilu-upper-k", "Trilu", F(2, 4, 5), np.array(1, np.int64), ops=("trilu",)),
    C("Trilu-lower", "Trilu", F(4, 5), np.array(-1, np.int64), attrs={"upper": 0}),
    C("CumSum", "CumSum", F(3, 4), np.array(1, np.int64), ops=("cumsum",)),
    C("CumSum-excl-rev", "CumSum", F(3, 4), np.array(0, np.int64), attrs={"exclusive": 1, "reverse": 1}),
    C("ScatterND", "ScatterND", F(4, 3), np.array([[1], [3]], np.int64), F(2, 3), ops=("scatter_nd",)),
    C("Einsum-attn-qk", "Einsum", F(2, 3, 5, 8), F(2, 3, 6, 8), attrs={"equation": "bhqd,bhkd->bhqk"},
      ops=("matmul", "transpose")),
    C("Einsum-attn-pv", "Einsum", F(2, 3, 5, 6), F(2, 3, 6, 8), attrs={"equation": "bhqk,bhkd->bhqd"}),
    C("Einsum-bmm", "Einsum", F(2, 3, 4), F(2, 4, 5), attrs={"equation": "bij,bjk->bik"}, ops=("matmul",)),
    C("Einsum-implicit", "Einsum", F(3, 4), F(4, 5), attrs={"equation": "ij,jk"}),
    C("Einsum-ellipsis", "Einsum", F(2, 3, 4), F(2, 4, 5), attrs={"equation": "...ij,...jk->...ik"}),
    C("Einsum-proj-transposed-out", "Einsum", F(2, 5, 8), F(8, 3, 4), attrs={"equation": "bsd,dhk->bhsk"}),
    C("Einsum-sum-free-letter", "Einsum", F(2, 3, 4), F(4, 5), attrs={"equation": "bij,jk->ik"}),
    C("Einsum-one-operand", "Einsum", F(2, 3, 4), attrs={"equation": "bij->jb"}),
]


def _build(case: Case) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    inputs, feeds, inits, names = [], {}, [], []
    for i, spec in enumerate(case.ins):
        name = f"in{i}"
        if spec is None:
            names.append("")
        elif isinstance(spec, np.ndarray):
            inits.append(onnx.numpy_helper.from_array(spec, name))
            names.append(name)
        else:
            shape, kind = spec
            feeds[name] = _data(kind, tuple(shape))
            elem = onnx.helper.np_dtype_to_tensor_dtype(feeds[name].dtype)
            inputs.append(helper.make_tensor_value_info(name, elem, list(shape)))
            names.append(name)
    outs = (case.out,) if isinstance(case.out, str) else case.out
    out_names = [f"out{i}" for i in range(len(outs))]
    node = helper.make_node(case.op, names, out_names, name=f"node_{case.id}", **case.attrs)
    graph = helper.make_graph([node], f"g_{case.id}", inputs,
                              [helper.make_tensor_value_info(n, _ELEM[k if k in _ELEM else "f"], None)
                               for n, k in zip(out_names, outs)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    model.ir_version = 8 if case.opset <= 18 else 10
    # the checker wants output shapes: let ONNX shape inference fill them in
    return onnx.shape_inference.infer_shapes(model, strict_mode=True), feeds


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_onnxruntime(case: Case) -> None:
    model, feeds = _build(case)
    g = import_onnx(model)
    verify(g)
    hist = g.op_histogram()
    for op in case.ops:
        assert op in hist, f"{case.id}: expected IR op {op!r} in {hist}"
    got = reference.run(g, feeds)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the test machine's cores are shared
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    assert list(got) == [o.name for o in model.graph.output]
    for name, w in zip(got, want):
        r = got[name]
        assert r.shape == w.shape, f"{case.id}/{name}: shape {r.shape} vs onnxruntime {w.shape}"
        assert r.dtype == w.dtype, f"{case.id}/{name}: dtype {r.dtype} vs onnxruntime {w.dtype}"
        if r.dtype.kind in "fc":
            scale = 1.0
            if case.op in CONTRACTIONS and np.isfinite(w).any():
                scale = max(1.0, float(np.abs(w[np.isfinite(w)]).max()))
            np.testing.assert_allclose(r.astype(np.float32), w.astype(np.float32), rtol=case.tol,
                                       atol=case.tol / 10 * scale)
        else:
            np.testing.assert_array_equal(r, w)


def test_gemm_transposes_a_weight_as_a_node_but_folds_small_constants() -> None:
    """Weights (> 4096 elements) are never folded into: Transpose(W) stays for transpose caching."""
    big = next(c for c in CASES if c.id == "Gemm-weight-transB")
    g = import_onnx(_build(big)[0])
    (tr,) = [n for n in g.nodes if n.op.value == "transpose"]
    assert tr.inputs[0].is_const and tr.inputs[0].numel > 4096
    small = next(c for c in CASES if c.id == "Gemm-transB-bias")
    model, _ = _build(small)
    model.graph.initializer.append(onnx.numpy_helper.from_array(_data("f", (5, 4)), "w"))
    model.graph.node[0].input[1] = "w"
    del model.graph.input[1]
    g = import_onnx(model)
    assert "transpose" not in g.op_histogram()  # a 20-element constant is folded: not a weight
