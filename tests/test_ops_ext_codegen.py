"""The GPU path of the new ops, on the CPU: the elementwise ones (floor, ceil, round, sign, mod,
bitwise and shifts, xor) and non-finite constants render and compile with NVRTC for sm_90; the
others (argmax/argmin, topk, pad, reduce_min/prod) compile or, like the reference-only dtypes, are
refused at compile time with a FusecError naming the op (and dtype)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_ops_ext import masked_scores_model, model

from fusec import ops as O
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.elementwise import Apply, Const, In
from fusec.compiler import stage
from fusec.dtypes import DType
from fusec.errors import FusecError
from fusec.frontend.onnx_import import import_onnx

Op = O.Op


@pytest.fixture(autouse=True, scope="module")
def _private_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with pytest.MonkeyPatch.context() as mp:  # compiled kernels go to a cache of this module's own
        mp.setenv("FUSEC_CACHE_DIR", str(tmp_path_factory.mktemp("kernels")))
        yield


def _float_expr(dt: DType) -> Apply:
    """floor(x) + ceil(x) + round(x) + sign(x) + mod(x, y) + fmod(x, y) over two operands."""
    x, y = In(0), In(1)
    terms = [Apply(Op.FLOOR, (x,)), Apply(Op.CEIL, (x,)), Apply(Op.ROUND, (x,)), Apply(Op.SIGN, (x,)),
             Apply(Op.MOD, (x, y), O.ModAttrs(fmod=False)), Apply(Op.MOD, (x, y), O.ModAttrs(fmod=True))]
    acc = terms[0]
    for t in terms[1:]:
        acc = Apply(Op.ADD, (acc, t))
    return acc


def _int_expr(dt: DType) -> Apply:
    """sign, both mods, and/or/xor/not and both shifts of two integer operands, xor-ed together."""
    x, y = In(0), In(1)
    terms = [Apply(Op.SIGN, (x,)), Apply(Op.MOD, (x, y), O.ModAttrs(False)), Apply(Op.MOD, (x, y), O.ModAttrs(True)),
             Apply(Op.BITWISE_AND, (x, y)), Apply(Op.BITWISE_OR, (x, y)), Apply(Op.BITWISE_NOT, (x,)),
             Apply(Op.BIT_SHIFT, (x, y), O.BitShiftAttrs(True)), Apply(Op.BIT_SHIFT, (x, y), O.BitShiftAttrs(False))]
    acc = terms[0]
    for t in terms[1:]:
        acc = Apply(Op.BITWISE_XOR, (acc, t))
    return acc


@pytest.mark.parametrize("dt", [DType.F32, DType.F16, DType.BF16])
def test_float_elementwise_ops_compile_sm90(dt: DType) -> None:
    spec = S.elementwise_spec(_float_expr(dt), [(4, 32), (32,)], [dt, dt], (4, 32))
    ck = K.build(spec, "sm_90")
    assert ck.cubin and all(f in ck.source for f in ("floorf(", "ceilf(", "rintf(", "fmodf("))


@pytest.mark.parametrize("dt", [DType.I32, DType.I64])
def test_integer_elementwise_ops_compile_sm90(dt: DType) -> None:
    spec = S.elementwise_spec(_int_expr(dt), [(4, 32), (32,)], [dt, dt], (4, 32))
    ck = K.build(spec, "sm_90")
    assert ck.cubin and "<<" in ck.source and ">>" in ck.source and "~" in ck.source


def test_bool_xor_compiles_sm90() -> None:
    spec = S.elementwise_spec(Apply(Op.XOR, (In(0), In(1))), [(8, 16), (16,)], [DType.BOOL, DType.BOOL], (8, 16))
    assert K.build(spec, "sm_90").cubin


@pytest.mark.parametrize("dt", [DType.F32, DType.F16, DType.BF16])
def test_non_finite_constants_compile_sm90(dt: DType) -> None:
    # where(mask, x, -inf) (a causal mask), + inf, + nan: IEEE bit patterns, not literals
    e = Apply(Op.WHERE, (In(0), In(1), Const(float("-inf"), dt)))
    e = Apply(Op.MAX, (e, Apply(Op.MUL, (Const(float("inf"), dt), Const(float("nan"), dt)))))
    spec = S.elementwise_spec(e, [(4, 8), (4, 8)], [DType.BOOL, dt], (4, 8))
    ck = K.build(spec, "sm_90")
    for bits in ("0xff800000", "0x7f800000", "0x7fc00000"):
        assert bits in ck.source
    assert ck.cubin


def test_causal_mask_with_minus_inf_compiles_from_onnx() -> None:
    # where(mask, scores * scale, -inf) + bias: a fused elementwise body holding the scalar -inf
    m = masked_scores_model()
    staged = stage(import_onnx(m), "fp32", "sm_90")
    sources = [v.decode() for k, v in staged.lowered.blobs.items() if k.startswith("source/")]
    assert any("__int_as_float((int)0xff800000)" in src for src in sources)


def _stage(m: Any) -> Any:
    return stage(import_onnx(m), "fp32", "sm_90")


@pytest.mark.parametrize("op,ins,consts,attrs,irop", [
    ("ArgMax", {"x": np.zeros((3, 4), np.float32)}, {}, {"axis": 1}, "argmax"),
    ("ArgMin", {"x": np.zeros((3, 4), np.float32)}, {}, {"axis": 0}, "argmin"),
    ("TopK", {"x": np.zeros((3, 4), np.float32)}, {"k": np.array([2], np.int64)}, {}, "topk"),
    ("Pad", {"x": np.zeros((3, 4), np.float32)}, {"pads": np.array([1, 0, 0, 1], np.int64)}, {"mode": "reflect"}, "pad"),
    ("ReduceMin", {"x": np.zeros((3, 4), np.float32)}, {"axes": np.array([1], np.int64)}, {}, "reduce_min"),
    ("ReduceProd", {"x": np.zeros((3, 4), np.float32)}, {"axes": np.array([1], np.int64)}, {}, "reduce_prod"),
])
def test_non_elementwise_ops_compile_or_are_refused_naming_the_op(op: str, ins: dict, consts: dict, attrs: dict,
                                                                  irop: str) -> None:
    # each has a GPU lowering (kernels compiled by NVRTC) or a one-line FusecError naming it
    try:
        staged = _stage(model(op, ins, consts, n_out=2 if op == "TopK" else 1, **attrs))
    except FusecError as e:
        assert irop in str(e) and "\n" not in str(e), str(e)
    else:
        assert staged.lowered.launches and all(k["entry"] for k in staged.lowered.kernels)


@pytest.mark.parametrize("op,dt,name", [("Floor", np.float64, "f64"), ("BitwiseNot", np.uint8, "u8"),
                                        ("Sign", np.int8, "i8"), ("Abs", np.int16, "i16")])
def test_reference_only_dtypes_are_refused_naming_op_and_dtype(op: str, dt: Any, name: str) -> None:
    ir = {"Floor": "floor", "BitwiseNot": "bitwise_not", "Sign": "sign", "Abs": "abs"}[op]
    with pytest.raises(FusecError, match=f"{ir} on {name}"):
        _stage(model(op, {"x": np.zeros((3, 4), dt)}))


def test_elementwise_ops_compile_from_onnx() -> None:
    # the lowering's own path: one unfused node per op, each compiled by NVRTC
    x = np.zeros((3, 8), np.int32)
    for op, attrs in [("Mod", {"fmod": 0}), ("BitShift", {"direction": "LEFT"}), ("BitwiseXor", {})]:
        assert _stage(model(op, {"a": x, "b": x}, **attrs)).lowered.kernels
    f = np.zeros((3, 8), np.float32)
    for op in ("Floor", "Ceil", "Round", "Sign"):
        assert _stage(model(op, {"x": f})).lowered.kernels


def test_empty_outputs_launch_nothing_and_empty_inputs_are_refused() -> None:
    staged = _stage(model("Add", {"a": np.zeros((0, 3), np.float32), "b": np.zeros((3,), np.float32)}))
    assert not staged.lowered.launches  # nothing to compute
    with pytest.raises(FusecError, match="empty"):
        _stage(model("ReduceSum", {"x": np.zeros((3, 0), np.float32)}, {"axes": np.array([1], np.int64)}))


class _Recorder:
    """A lowering context that records each launch's spec and arguments instead of compiling."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, list[Any]]] = []

    def kernel(self, spec: Any, args: list[Any], label: str) -> None:
        self.launches.append((spec, args))


def _emulate(launches: list[tuple[Any, list[Any]]], env: dict[Any, np.ndarray], out: Any) -> np.ndarray:
    """Run recorded fill (elementwise of a constant or a broadcast scalar) and copy launches on numpy,
    per the kernels' documented index maps (templates/copy.cu.jinja's header)."""
    from fusec.codegen.copyspecs import CopySpec

    flat = np.full(int(np.prod(out.shape)), 77, out.dtype.np)  # poison: unwritten elements show
    for spec, args in launches:
        if isinstance(spec, CopySpec):
            src = env[args[0]].reshape(-1)
            for c in np.ndindex(*spec.shape):
                flat[spec.dst_offset + int(np.dot(c, spec.dst_strides))] = src[spec.src_offset + int(np.dot(c, spec.src_strides))]
        else:
            flat[:] = spec.expr.value if isinstance(spec.expr, Const) else env[args[0]].reshape(-1)[0]
    return flat.reshape(out.shape)


@pytest.mark.parametrize("pads,fill", [((1, 2, 0, 1), None), ((2, -1, -1, 3), 2.5), ((0, 0, 0, 0), None),
                                       ((-1, -2, 1, 0), -1.0)])
def test_constant_pad_lowering_computes_the_reference(pads: tuple[int, ...], fill: float | None) -> None:
    from fusec import reference
    from fusec.lower.pad import lower_pad

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    consts = {"pads": np.array(pads, np.int64)} | ({"v": np.array(fill, np.float32)} if fill is not None else {})
    g = import_onnx(model("Pad", {"x": x}, consts))
    node = g.nodes[0]
    rec = _Recorder()
    lower_pad(rec, node, "pad")  # type: ignore[arg-type]
    env = {node.inputs[0]: x} | ({node.inputs[1]: node.inputs[1].data} if len(node.inputs) > 1 else {})
    got = _emulate(rec.launches, env, node.output)
    np.testing.assert_array_equal(got, reference.run(g, {"x": x})[g.outputs[0].name])


def test_pad_lowering_refuses_a_wrap_of_too_many_periods_naming_the_mode() -> None:
    with pytest.raises(FusecError, match="pad in wrap mode over 1 axes needs"):
        _stage(model("Pad", {"x": np.zeros((3, 4), np.float32)}, {"pads": np.array([0, 0, 0, 400], np.int64)}, mode="wrap"))
