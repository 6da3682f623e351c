"""IR -> ONNX: write a fusec Graph as an ONNX model that onnxruntime runs and onnx.checker accepts.

Target: default domain, opset 17 (the opset torch exports transformers at, and the first with
LayerNormalization), IR version 8. Every IR op is mapped; ops ONNX 17 lacks are written as their
defining decomposition, the same math as ``fusec.reference``:

- RMSNORM: Cast to f32, x*x, ReduceMean(last axis), Add eps, Sqrt, Div, Cast back, Mul weight;
- GELU: the erf or tanh formula (ONNX Gelu only exists from opset 20); SILU: x * Sigmoid(x).

Constants become initializers. When the weights would not fit protobuf's 2 GiB limit, the large
ones go to one external-data file next to the model, named ``<model file name>.data``. The export
is atomic: both files are written and checked in a temporary folder beside ``path`` and renamed
into place only when complete, so a failure leaves no new file behind.

IR value names may hold anything; ONNX names are made unique and restricted to
``[A-Za-z0-9_.:/-]`` (other characters become ``_``). Input and output names are kept when
they already fit, which they do for every built-in model.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusec import onnx_export_ext
from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.fsutil import OutputError
from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op

OPSET = 17
IR_VERSION = 8
_PROTO_LIMIT = 2**31 - 2**27  # protobuf refuses > 2 GiB; keep room for the graph itself
_EXTERNAL_MIN_BYTES = 1024  # tensors below this stay inline even in external-data mode
_ALIGN = 64

_ONNX_DTYPE = {DType.F32: TensorProto.FLOAT, DType.F16: TensorProto.FLOAT16, DType.BF16: TensorProto.BFLOAT16,
               DType.I64: TensorProto.INT64, DType.I32: TensorProto.INT32, DType.BOOL: TensorProto.BOOL}

_SIMPLE = {
    Op.NEG: "Neg", Op.ABS: "Abs", Op.EXP: "Exp", Op.LOG: "Log", Op.SQRT: "Sqrt", Op.RECIPROCAL: "Reciprocal",
    Op.ERF: "Erf", Op.TANH: "Tanh", Op.SIGMOID: "Sigmoid", Op.RELU: "Relu", Op.COS: "Cos", Op.SIN: "Sin",
    Op.NOT: "Not", Op.ISNAN: "IsNaN", Op.ADD: "Add", Op.SUB: "Sub", Op.MUL: "Mul", Op.DIV: "Div", Op.POW: "Pow",
    Op.MAX: "Max", Op.MIN: "Min", Op.EQUAL: "Equal", Op.LESS: "Less", Op.LESS_EQUAL: "LessOrEqual",
    Op.GREATER: "Greater", Op.GREATER_EQUAL: "GreaterOrEqual", Op.AND: "And", Op.OR: "Or", Op.WHERE: "Where",
    Op.SCATTER_ND: "ScatterND",
}


class _Ctx:
    """Names, helper initializers and emitted nodes of one export."""

    def __init__(self) -> None:
        self.names: dict[Value, str] = {}
        self.used: set[str] = set()
        self.nodes: list[onnx.NodeProto] = []
        self.extra_inits: list[onnx.TensorProto] = []

    def fresh(self, base: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_.:/-]", "_", base) or "v"
        name, k = base, 1
        while name in self.used:
            name = f"{base}_{k}"
            k += 1
        self.used.add(name)
        return name

    def name(self, v: Value) -> str:
        n = self.names.get(v)
        if n is None:
            n = self.names[v] = self.fresh(v.name)
        return n

    def const(self, arr: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.extra_inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def i64(self, values: Any, hint: str) -> str:
        return self.const(np.asarray(values, dtype=np.int64), hint)

    def scalar(self, x: float, dtype: DType, hint: str) -> str:
        return self.const(np.array(x, dtype=dtype.np), hint)

    def add(self, op_type: str, inputs: list[str], outputs: list[str] | None = None, hint: str = "t",
            **attrs: Any) -> str:
        outs = outputs if outputs is not None else [self.fresh(hint)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(f"n_{op_type}"), **attrs))
        return outs[0]


def _cast(ctx: _Ctx, x: str, frm: DType, to: DType) -> str:
    return x if frm == to else ctx.add("Cast", [x], hint=f"{x}_cast", to=_ONNX_DTYPE[to])


def _emit(ctx: _Ctx, n: Node) -> None:
    ins = [ctx.name(v) for v in n.inputs]
    out = ctx.name(n.outputs[0]) if n.outputs else ""
    a = n.attrs
    op = n.op
    if op in _SIMPLE:
        ctx.add(_SIMPLE[op], ins, [out])
    elif op in _SPECIAL:
        _SPECIAL[op](ctx, n, ins, out, a)
    else:  # pragma: no cover - every Op is mapped; test_onnx_export checks the table is complete
        raise NotImplementedError(f"ONNX export has no mapping for {op.value}")


def _gelu(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    x, dt = ins[0], n.inputs[0].dtype
    c = lambda v: ctx.scalar(v, dt, "gelu_c")
    if a.approximate == "tanh":
        cube = ctx.add("Mul", [c(0.044715), ctx.add("Pow", [x, c(3.0)])])
        inner = ctx.add("Mul", [c(math.sqrt(2.0 / math.pi)), ctx.add("Add", [x, cube])])
        one_plus = ctx.add("Add", [c(1.0), ctx.add("Tanh", [inner])])
        ctx.add("Mul", [ctx.add("Mul", [c(0.5), x]), one_plus], [out])
    else:
        e = ctx.add("Erf", [ctx.add("Div", [x, c(math.sqrt(2.0))])])
        ctx.add("Mul", [ctx.add("Mul", [x, ctx.add("Add", [e, c(1.0)])]), c(0.5)], [out])


def _rmsnorm(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    (x, w), xdt, wdt = ins, n.inputs[0].dtype, n.inputs[1].dtype
    xf = _cast(ctx, x, xdt, DType.F32)
    ms = ctx.add("ReduceMean", [ctx.add("Mul", [xf, xf])], axes=[len(n.inputs[0].shape) - 1], keepdims=1)
    y = ctx.add("Div", [xf, ctx.add("Sqrt", [ctx.add("Add", [ms, ctx.scalar(a.eps, DType.F32, "rms_eps")])])])
    y = _cast(ctx, _cast(ctx, y, DType.F32, xdt), xdt, DType.F32)  # HF: normalize, cast back, scale
    wf = _cast(ctx, w, wdt, DType.F32)
    if a.weight_offset:
        wf = ctx.add("Add", [wf, ctx.scalar(a.weight_offset, DType.F32, "rms_offset")])
    if wdt == DType.F32:
        ctx.add("Mul", [wf, y], [out])
    else:
        ctx.add("Cast", [ctx.add("Mul", [wf, y])], [out], to=_ONNX_DTYPE[wdt])


def _slice(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    # IR slices use range() semantics; a negative end with a negative step means "through index
    # 0", which ONNX spells as a very negative end (it clamps to -1 after adding the dim).
    ends = [e if e >= 0 else -(2**63 - 1) for e in a.ends]
    ctx.add("Slice", [ins[0], ctx.i64(a.starts, "starts"), ctx.i64(ends, "ends"), ctx.i64(a.axes, "axes"),
                      ctx.i64(a.steps, "steps")], [out])


def _reshape(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    extra = {"allowzero": 1} if 0 in a.shape else {}  # a literal 0 dim, not "copy the input dim"
    ctx.add("Reshape", [ins[0], ctx.i64(a.shape, "shape")], [out], **extra)


def _matmul(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    b = ins[1]
    x = ins[0]
    if getattr(a, "trans_a", False):  # A stored [.., K, M]
        r = len(n.inputs[0].shape)
        x = ctx.add("Transpose", [x], hint=f"{x}_t", perm=[*range(r - 2), r - 1, r - 2])
    if a.trans_b:  # B stored [.., N, K]: ONNX MatMul reads [.., K, N]
        r = len(n.inputs[1].shape)
        b = ctx.add("Transpose", [b], hint=f"{b}_t", perm=[*range(r - 2), r - 1, r - 2])
    ctx.add("MatMul", [x, b], [out])


_SPECIAL: dict[Op, Callable[[_Ctx, Node, list[str], str, Any], None]] = {
    Op.ISINF: lambda c, n, i, o, a: c.add("IsInf", i, [o], detect_positive=int(a.detect_positive),
                                          detect_negative=int(a.detect_negative)),
    Op.CAST: lambda c, n, i, o, a: c.add("Cast", i, [o], to=_ONNX_DTYPE[a.to]),
    Op.GELU: _gelu,
    Op.SILU: lambda c, n, i, o, a: c.add("Mul", [i[0], c.add("Sigmoid", i)], [o]),
    Op.REDUCE_SUM: lambda c, n, i, o, a: c.add("ReduceSum", [i[0], c.i64(a.axes, "axes")], [o],
                                               keepdims=int(a.keepdims)),
    Op.REDUCE_MEAN: lambda c, n, i, o, a: c.add("ReduceMean", i, [o], axes=list(a.axes), keepdims=int(a.keepdims)),
    Op.REDUCE_MAX: lambda c, n, i, o, a: c.add("ReduceMax", i, [o], axes=list(a.axes), keepdims=int(a.keepdims)),
    Op.SOFTMAX: lambda c, n, i, o, a: c.add("Softmax", i, [o], axis=a.axis),
    Op.CUMSUM: lambda c, n, i, o, a: c.add("CumSum", [i[0], c.i64(a.axis, "axis")], [o],
                                           exclusive=int(a.exclusive), reverse=int(a.reverse)),
    Op.LAYERNORM: lambda c, n, i, o, a: c.add("LayerNormalization", i, [o], axis=a.axis, epsilon=a.eps),
    Op.RMSNORM: _rmsnorm,
    Op.RESHAPE: _reshape,
    Op.TRANSPOSE: lambda c, n, i, o, a: c.add("Transpose", i, [o], perm=list(a.perm)),
    Op.MATMUL: _matmul,
    Op.EXPAND: lambda c, n, i, o, a: c.add("Expand", [i[0], c.i64(a.shape, "shape")], [o]),
    Op.CONCAT: lambda c, n, i, o, a: c.add("Concat", i, [o], axis=a.axis),
    Op.SLICE: _slice,
    Op.GATHER: lambda c, n, i, o, a: c.add("Gather", i, [o], axis=a.axis),
    Op.GATHER_ELEMENTS: lambda c, n, i, o, a: c.add("GatherElements", i, [o], axis=a.axis),
    Op.GATHER_ND: lambda c, n, i, o, a: c.add("GatherND", i, [o], batch_dims=a.batch_dims),
    Op.TILE: lambda c, n, i, o, a: c.add("Tile", [i[0], c.i64(a.repeats, "repeats")], [o]),
    Op.TRILU: lambda c, n, i, o, a: c.add("Trilu", [i[0], c.i64(a.k, "k")], [o], upper=int(a.upper)),
}



def _attention(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    """ATTENTION as the eager form: [repeat_kv], MatMul(q, k^T) * scale, mask, Softmax, MatMul."""
    q, k, v = n.inputs[:3]
    f32 = DType.F32
    qn, kn, vn = (_cast(ctx, name, val.dtype, f32) for name, val in zip(ins[:3], (q, k, v)))
    bsz, heads, seq, _ = q.shape
    kv, klen = k.shape[1], k.shape[2]
    rep = heads // kv
    if rep > 1:  # q head h reads kv head h // rep, as HF repeat_kv lays them out
        def repeat(x: str, d: int) -> str:
            x = ctx.add("Reshape", [x, ctx.i64([bsz, kv, 1, klen, d], "shape")])
            x = ctx.add("Expand", [x, ctx.i64([bsz, kv, rep, klen, d], "shape")])
            return ctx.add("Reshape", [x, ctx.i64([bsz, heads, klen, d], "shape")])
        kn, vn = repeat(kn, k.shape[3]), repeat(vn, v.shape[3])
    s = ctx.add("MatMul", [qn, ctx.add("Transpose", [kn], perm=[0, 1, 3, 2])])
    s = ctx.add("Mul", [s, ctx.scalar(a.scale, f32, "attn_scale")])
    if a.softcap:  # cap * tanh(s / cap) on the scaled scores, before the masks
        cap = ctx.scalar(a.softcap, f32, "attn_softcap")
        s = ctx.add("Mul", [ctx.add("Tanh", [ctx.add("Div", [s, cap])]), cap])
    neg_inf = lambda: ctx.scalar(-np.inf, f32, "neg_inf")
    if len(ins) == 4:
        mask = n.inputs[3]
        if mask.dtype == DType.BOOL:
            s = ctx.add("Where", [ins[3], s, neg_inf()])
        else:
            s = ctx.add("Add", [s, _cast(ctx, ins[3], mask.dtype, f32)])
    if a.causal:
        keep = np.tril(np.ones((seq, klen), bool), k=klen - seq)
        s = ctx.add("Where", [ctx.const(keep, "causal"), s, neg_inf()])
    p = ctx.add("Softmax", [s], axis=3)
    if a.nan_to_zero:
        p = ctx.add("Where", [ctx.add("IsNaN", [p]), ctx.scalar(0.0, f32, "zero"), p])
    if v.dtype == f32:
        ctx.add("MatMul", [p, vn], [out])
    else:
        ctx.add("Cast", [ctx.add("MatMul", [p, vn])], [out], to=_ONNX_DTYPE[v.dtype])


def _rope(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    """ROPE as rotate-half: x_rot * cos + cat(-x2, x1) * sin on the first rotary_dim features."""
    x, cos, sin = n.inputs
    f32 = DType.F32
    xn, cn, sn = (_cast(ctx, name, val.dtype, f32) for name, val in zip(ins, (x, cos, sin)))
    ax, dim, rd = len(x.shape) - 1, x.shape[-1], a.rotary_dim

    def part(lo: int, hi: int) -> str:
        return ctx.add("Slice", [xn, ctx.i64([lo], "starts"), ctx.i64([hi], "ends"), ctx.i64([ax], "axes")])

    xr = xn if rd == dim else part(0, rd)
    rot = ctx.add("Concat", [ctx.add("Neg", [part(rd // 2, rd)]), part(0, rd // 2)], axis=ax)
    y = ctx.add("Add", [ctx.add("Mul", [xr, cn]), ctx.add("Mul", [rot, sn])])
    if rd < dim:
        y = ctx.add("Concat", [y, part(rd, dim)], axis=ax)
    if x.dtype == f32:
        ctx.add("Identity", [y], [out])
    else:
        ctx.add("Cast", [y], [out], to=_ONNX_DTYPE[x.dtype])


def _fused(ctx: _Ctx, n: Node, ins: list[str], out: str, a: Any) -> None:
    """A fused node is exported as its body, inlined: ONNX has no kernel boundary to keep.

    Body values get names in a scope of their own, so a body object shared by several fused
    nodes is inlined afresh each time."""
    body: Graph = a.body
    outs = [ctx.name(ov) for ov in n.outputs]
    saved = dict(ctx.names)
    for bv, name in zip(body.inputs, ins):
        ctx.names[bv] = name
    for c in body.constants:
        ctx.names[c] = ctx.fresh(c.name)
        ctx.extra_inits.append(numpy_helper.from_array(np.ascontiguousarray(c.data), ctx.names[c]))
    produced = {v for bn in body.nodes for v in bn.outputs}
    named: set[Value] = set()
    for bv, name in zip(body.outputs, outs):
        if bv in produced and bv not in named:  # written straight into the outer output's name
            ctx.names[bv] = name
            named.add(bv)
    for bn in body.nodes:
        _emit(ctx, bn)
    for bv, name in zip(body.outputs, outs):
        if ctx.names[bv] != name:  # a body input, constant or repeated value passed straight out
            ctx.add("Identity", [ctx.names[bv]], [name])
    ctx.names = saved


# High-level ops the pattern passes produce; looked up by name so this module also imports
# against an IR that does not (yet) define them.
for _name, _fn in (("ATTENTION", _attention), ("ROPE", _rope), ("FUSED", _fused)):
    if hasattr(Op, _name):
        _SPECIAL[Op[_name]] = _fn

_SIMPLE.update(onnx_export_ext.SIMPLE)
_SPECIAL.update(onnx_export_ext.SPECIAL)
_ONNX_DTYPE.update(onnx_export_ext.DTYPES)
MAPPED_OPS = frozenset(_SIMPLE) | frozenset(_SPECIAL)
# Made by passes for the GPU only (3xTF32's operand split reads fp32 bit patterns): refused in one line.
PASS_ONLY_OPS = frozenset({Op.TF32_SPLIT})
TRAINING_OPS = frozenset({Op.SCATTER_ADD, Op.CROSS_ENTROPY, Op.SOFTMAX_GRAD, Op.LAYERNORM_GRAD, Op.CROSS_ENTROPY_GRAD})  # a backward pass and its loss: not exported
# Products over packed quantized weights (GGUF K-quants, fusec's int4/int8): no opset-17 form.
PACKED_OPS = frozenset({Op.QMATMUL, Op.QGATHER})
UNEXPORTABLE_OPS = frozenset(onnx_export_ext.NOT_IN_OPSET) | PASS_ONLY_OPS | TRAINING_OPS | PACKED_OPS  # refused in one line
# Generation ops read and write plan state (a KV cache, the seed) in place; an ONNX graph has no
# state, so a generation graph is refused as a whole (ONNX decoders carry the cache as
# past/present tensors instead: fusec.frontend.kv_cache turns those into state on import).
STATEFUL_OPS = frozenset({Op.CACHE_WRITE, Op.KV_ATTENTION, Op.SAMPLE, Op.ADAMW, Op.INIT})


def _vinfo(name: str, v: Value) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, _ONNX_DTYPE[v.dtype], list(v.shape))


def _external_tensor(name: str, v: Value, location: str, offset: int) -> onnx.TensorProto:
    t = TensorProto()
    t.name = name
    t.data_type = _ONNX_DTYPE[v.dtype]
    t.dims.extend(v.shape)
    t.data_location = TensorProto.EXTERNAL
    for k, val in (("location", location), ("offset", str(offset)), ("length", str(v.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = k, val
    return t


def export_onnx(graph: Graph, path: str | os.PathLike[str], *, external_data: bool | None = None) -> None:
    """Write ``graph`` to ``path`` as an ONNX model (opset 17), atomically.

    ``external_data``: None decides by size (weights over ~1.9 GiB go to ``<path name>.data``),
    True/False forces it. Raises IRError for an invalid graph and onnx's errors if the checker
    rejects the result; in every failure case nothing new is left at ``path``.
    """
    verify(graph)
    stateful = sorted({n.op.value for n in graph.nodes if n.op in STATEFUL_OPS})
    if stateful or graph.meta.get("states"):
        raise ModelError(f"graph {graph.name!r} holds plan state ({', '.join(stateful) or 'declared states'}); "
                         f"ONNX export writes stateless graphs only")
    onnx_export_ext.check_opset(graph)
    pass_only = sorted({n.op.value for n in graph.nodes if n.op in PASS_ONLY_OPS})
    if pass_only:
        raise ModelError(f"graph {graph.name!r} holds {pass_only[0]}, an op the passes make for the GPU; "
                         f"export the graph before the passes")
    training = sorted({n.op.value for n in graph.nodes if n.op in TRAINING_OPS})
    if training:
        raise ModelError(f"graph {graph.name!r} holds {training[0]}, a training op; export the forward graph")
    packed = sorted({n.op.value for n in graph.nodes if n.op in PACKED_OPS})
    if packed:
        raise ModelError(f"graph {graph.name!r} holds {packed[0]}, a product over packed quantized weights, which "
                         f"ONNX opset 17 cannot express; export the model before quantizing (or load the GGUF file "
                         f"with its weights dequantized)")
    path = Path(path)
    ctx = _Ctx()
    # Inputs and outputs claim their names first, so sanitizing never renames them needlessly.
    for v in graph.inputs:
        ctx.name(v)
    out_names: list[str] = []
    for v in graph.outputs:
        if v in ctx.names or v.is_const or v.name in out_names:
            out_names.append(ctx.fresh(v.name))  # an input/constant/repeat as output: Identity below
        else:
            out_names.append(ctx.name(v))
    for c in graph.constants:
        ctx.name(c)
    for n in graph.nodes:
        _emit(ctx, n)
    for v, oname in zip(graph.outputs, out_names):
        if oname != ctx.name(v):
            ctx.add("Identity", [ctx.names[v]], [oname])

    external = graph.weight_bytes > _PROTO_LIMIT if external_data is None else external_data
    data_name = path.name + ".data"
    parent = path.parent if str(path.parent) else Path(".")
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        raise OutputError(f"cannot write ONNX file {os.fspath(path)!r}: {e.strerror or e}") from None
    placed_data = False
    try:
        inits: list[onnx.TensorProto] = []
        if external:
            with open(tmpdir / data_name, "wb") as f:
                for c in graph.constants:
                    if c.nbytes < _EXTERNAL_MIN_BYTES:
                        inits.append(numpy_helper.from_array(c.data, ctx.names[c]))
                        continue
                    offset = -f.tell() % _ALIGN
                    f.write(b"\0" * offset)
                    inits.append(_external_tensor(ctx.names[c], c, data_name, f.tell()))
                    f.write(np.ascontiguousarray(c.data).data)
        else:
            inits = [numpy_helper.from_array(np.ascontiguousarray(c.data), ctx.names[c]) for c in graph.constants]
        io = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
        value_info = [_vinfo(ctx.name(v), v) for n in graph.nodes for v in n.outputs if v not in io]
        g = helper.make_graph(
            ctx.nodes, ctx.fresh(graph.name) if graph.name else "graph",
            [_vinfo(ctx.names[v], v) for v in graph.inputs],
            [_vinfo(o, v) for o, v in zip(out_names, graph.outputs)],
            initializer=inits + ctx.extra_inits, value_info=value_info)
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="fusec")
        model.ir_version = IR_VERSION
        tmp_model = tmpdir / path.name
        with open(tmp_model, "wb") as f:
            f.write(model.SerializeToString())
        onnx.checker.check_model(os.fspath(tmp_model))
        if external:
            os.replace(tmpdir / data_name, parent / data_name)
            placed_data = True
        os.replace(tmp_model, path)
    except BaseException as e:
        if placed_data:  # the model never landed: do not leave its data file behind
            (parent / data_name).unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, OutputError):  # a full disk, a read-only directory
            raise OutputError(f"cannot write ONNX file {os.fspath(path)!r}: {e.strerror or e}") from None
        raise
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
