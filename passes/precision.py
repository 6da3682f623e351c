"""Storage precision: store every fp32 tensor of the graph as ``options.storage_dtype``.

Runs after pattern recognition, so the high-level ops (norms, softmax, attention, RoPE) compute
in fp32 inside their kernels and only their inputs and outputs are stored in half precision.
The graph is rebuilt with new Value objects (the caller's graph is left untouched); each node's
output types are re-inferred from its op's rule, and ``cast`` nodes that targeted fp32 now target
the storage dtype (``simplify`` then drops the ones that became no-ops).

Constants are converted with saturation to the finite range of the storage dtype
(``fusec.bulk.to_storage``): HF models add ``finfo(float32).min`` as a mask value, which fp16 would
turn into -inf, and a fully masked row would then produce NaN (-inf - -inf) that spreads through
the next layer. A model built for a half-precision compile holds its large weights already in the
storage dtype, each read through a CAST to fp32 (``fusec.models.weights.StoredWeights``, so the
fp32 copy of the weights is never held); such a CAST, now from the storage dtype to itself, is
dropped here and its readers read the weight.

Packed quantized weights (the operands of ``qmatmul``/``qgather`` after the first) keep their
dtypes: their scales are part of the format (an fp32 scale of an ONNX MatMulNBits stays exact).

One computation stays in fp32: rotary angles computed in the graph (HF's ``position_ids.float() @
inv_freq``, then ``cos``/``sin``). Positions are integers cast to float; fp16 holds integers exactly
only up to 2048 and bf16 up to 256, and an angle of thousands of radians stored in half precision
is off by whole radians (cos errors of 0.1 at position 1000 in fp16). So every value on a path from
an integer-to-float ``cast`` to a ``cos``/``sin`` through arithmetic and layout ops (``_ANGLE_OPS``),
with small constants (``inv_freq``) as the only other float operands, keeps fp32; the ``cos``/``sin``
output is cast to the storage dtype. Paths that end elsewhere (an attention mask made from an
integer mask) are stored as before.

Parameters stay fp32 too: a graph input (a state) read only as an operand listed in
``_FP32_OPERANDS`` (``sample``'s per-row temperature and top-p: 0.7 would be 0.69921875 in bf16) keeps
its dtype. ``fp32_inputs`` names them; ``fusec.compiler.state_layout`` stores those states as fp32.
"""

from __future__ import annotations

import dataclasses

from fusec.bulk import derived, to_storage
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import CastAttrs, Op, QGatherAttrs, infer
from fusec.passes.base import PassOptions, PassResult

NAME = "precision"


def _convert_const(c: Value, dt: DType) -> Value:
    assert c.data is not None
    data = c.data  # converted once for the entries of a plan that hold the same array (fusec.bulk.derived)
    return Value(c.name, c.shape, dt, derived("storage", [data], dt.value, lambda: to_storage(data, dt.np)))


# Ops a rotary angle passes through between the position cast and cos/sin; constants that join it
# are small (inv_freq: head_dim / 2 values), and stay fp32 copies.
_ANGLE_OPS = frozenset({Op.MUL, Op.ADD, Op.SUB, Op.DIV, Op.NEG, Op.MATMUL, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND,
                        Op.CONCAT, Op.SLICE, Op.GATHER, Op.TILE})
_ANGLE_ENDS = frozenset({Op.COS, Op.SIN})
_SMALL_CONST = 1 << 16
# operands that are exact parameters, never activations: (op -> input positions) read as fp32
_FP32_OPERANDS = {Op.SAMPLE: frozenset({3, 5})}


def _uses(graph: Graph) -> dict[Value, list[tuple[Op, int]]]:
    """(op, input position) of every read of each value, seen through fused bodies (a fused node's
    operand is read where its body reads the matching body input)."""
    uses: dict[Value, list[tuple[Op, int]]] = {}
    for n in graph.nodes:
        body = getattr(n.attrs, "body", None) if n.op == Op.FUSED else None
        inner = _uses(body) if body is not None else {}
        for i, v in enumerate(n.inputs):
            uses.setdefault(v, []).extend(inner.get(body.inputs[i], []) if body is not None else [(n.op, i)])
    return uses


def fp32_inputs(graph: Graph) -> set[str]:
    """Names of the fp32 graph inputs this pass leaves fp32: read only as ``_FP32_OPERANDS`` (also
    inside fused bodies, so that the state layout of an optimized graph agrees)."""
    uses = _uses(graph)
    outputs = set(graph.outputs)
    return {v.name for v in graph.inputs if v.dtype == DType.F32 and v not in outputs and uses.get(v)
            and all(i in _FP32_OPERANDS.get(op, ()) for op, i in uses[v])}


def _angle_values(graph: Graph) -> set[Value]:
    """Values on a path from an integer-to-fp32 cast to a cos/sin through ``_ANGLE_OPS`` (see the
    module docstring), whose other float operands are small constants."""
    def joins(v: Value) -> bool:
        return not v.dtype.is_float or (v.data is not None and v.numel <= _SMALL_CONST)

    fwd: set[Value] = set()
    for n in graph.nodes:
        if n.op == Op.CAST and n.attrs.to == DType.F32 and not n.inputs[0].dtype.is_float:
            fwd.add(n.outputs[0])
        elif n.op in _ANGLE_OPS and any(v in fwd for v in n.inputs) \
                and all(v in fwd or joins(v) for v in n.inputs):
            fwd.update(o for o in n.outputs if o.dtype == DType.F32)
    back: set[Value] = set()
    producer = {o: n for n in graph.nodes for o in n.outputs}
    stack = [n.inputs[0] for n in graph.nodes if n.op in _ANGLE_ENDS and n.inputs[0] in fwd]
    while stack:
        v = stack.pop()
        if v in back or v not in fwd:
            continue
        back.add(v)
        p = producer.get(v)
        if p is not None and p.op in _ANGLE_OPS:
            stack.extend(p.inputs)
    return back


def run(graph: Graph, options: PassOptions) -> PassResult:
    target = DType(options.storage_dtype)
    if target == DType.F32:
        return PassResult(graph.copy(), False)
    if not target.is_float:
        raise ValueError(f"storage dtype must be a float type, got {target.value}")

    def retype(dt: DType) -> DType:
        return target if dt == DType.F32 else dt

    mapping: dict[Value, Value] = {}
    params = fp32_inputs(graph)
    for v in graph.inputs:
        mapping[v] = Value(v.name, v.shape, v.dtype if v.name in params else retype(v.dtype))
    # packed weights keep their format's dtypes (fp32 scales of an ONNX MatMulNBits stay exact)
    packed = {v for n in graph.nodes if n.op in (Op.QMATMUL, Op.QGATHER) for v in n.inputs[1:]}
    consts = []
    for c in graph.constants:
        nc = _convert_const(c, target) if c.dtype == DType.F32 and c not in packed else c
        mapping[c] = nc
        consts.append(nc)
    wide = _angle_values(graph)
    wide32: dict[Value, Value] = {}  # fp32 values of the angle paths, and fp32 copies of their constants
    outputs = set(graph.outputs)
    nodes = []

    def narrow(v: Value) -> Value:  # the storage-dtype value a reader outside the angle path gets
        if v not in mapping:
            node = Node(Op.CAST, [wide32[v]], [Value(f"{v.name}_{target.value}", v.shape, target)],
                        CastAttrs(target), f"{v.name}_{target.value}")
            nodes.append(node)
            mapping[v] = node.outputs[0]
        return mapping[v]

    def as32(v: Value) -> Value:
        if v not in wide32:  # a small constant joining an angle: its fp32 data
            wide32[v] = Value(f"{v.name}_f32", v.shape, v.dtype, v.data) if v.dtype == DType.F32 else mapping[v]
            if v.dtype == DType.F32:
                consts.append(wide32[v])
        return wide32[v]

    for n in graph.nodes:
        attrs = n.attrs
        keep32 = n.outputs[0] in wide or (n.op in _ANGLE_ENDS and n.inputs[0] in wide)
        if keep32:  # computed in fp32: its fp32 operands as they are, cos/sin cast to storage after
            ins = [as32(v) for v in n.inputs]
            types = infer(n.op, attrs, [(v.shape, v.dtype) for v in ins])
            ends = n.op in _ANGLE_ENDS
            outs = [Value(o.name if not (ends or o in outputs) else f"{o.name}_f32", shape, dt)
                    for o, (shape, dt) in zip(n.outputs, types)]
            nodes.append(Node(n.op, ins, outs, attrs, n.name))
            wide32.update(zip(n.outputs, outs))
            for o in n.outputs:
                if ends or o in outputs:
                    node = Node(Op.CAST, [wide32[o]], [Value(o.name, o.shape, target)], CastAttrs(target),
                                f"{o.name}_cast")
                    nodes.append(node)
                    mapping[o] = node.outputs[0]
            continue
        if isinstance(attrs, CastAttrs) and attrs.to == DType.F32:
            attrs = dataclasses.replace(attrs, to=target)
        if isinstance(attrs, QGatherAttrs) and attrs.out_dtype == DType.F32:  # rows of a packed table: stored too
            attrs = dataclasses.replace(attrs, out_dtype=target)
        ins = [narrow(v) if v in wide32 else mapping[v] for v in n.inputs]
        if n.op == Op.CAST and ins[0].is_const and ins[0].dtype == attrs.to and n.outputs[0] not in outputs:
            mapping[n.outputs[0]] = ins[0]  # a weight stored narrow, cast to fp32: now a no-op, its readers read it
            continue
        types = infer(n.op, attrs, [(v.shape, v.dtype) for v in ins])
        outs = [Value(o.name, shape, dt) for o, (shape, dt) in zip(n.outputs, types)]
        mapping.update(zip(n.outputs, outs))
        nodes.append(Node(n.op, ins, outs, attrs, n.name))
    meta = dict(graph.meta)
    meta["storage_dtype"] = target.value
    g = Graph([mapping[v] for v in graph.inputs], [mapping[v] for v in graph.outputs], nodes, consts, graph.name, meta)
    return PassResult(g, True)
