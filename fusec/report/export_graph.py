"""The fused graph as ONNX, one node per kernel, for Netron and other ONNX viewers.

``fusec.onnx_export`` writes a graph that runs (fused bodies inlined back into standard ops).
This module writes the graph as the plan executes it: every node of the fused graph is one node
of the ONNX model. Each is one kernel, except views (a reshape that reads its input in place:
``doc_string`` says so), so the nodes less the views are the plan's kernel count.

- a fused node becomes a node of the custom domain ``ai.fusec`` (declared in ``opset_import``);
  its ``op_type`` is its short name (``matmul+add+gelu``) and its attributes list the fused ops,
  the fusion rule and kind, and, for a plan, the kernels it launches;
- an op that ONNX writes as one standard node stays that node (``onnx_export``'s own mapping);
  an op that ONNX can only spell as several (RMSNorm, attention, RoPE) becomes one ``ai.fusec``
  node named after the op, with its attributes;
- weights are initializers, or, with ``weights=False``, graph inputs of the same name, shape and
  dtype (the file stays small; Netron shows them as inputs).

The model passes ``onnx.checker.check_model``; onnxruntime cannot run it (``ai.fusec`` has no
kernels there): it is a picture of the plan, ``fusec export-model`` writes the runnable one.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
from onnx import helper

from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.ir import Graph, Node, verify
from fusec.onnx_export import _ONNX_DTYPE, _PROTO_LIMIT, IR_VERSION, OPSET, _Ctx, _emit, _vinfo
from fusec.ops import Op
from fusec.passes.views import view_of
from fusec.report.subject import node_ops, short_name

DOMAIN = "ai.fusec"
DOMAIN_VERSION = 1
VIEW_DOC = "a view: no kernel, no launch (reads its input's storage in place)"


def fused_model(graph: Graph, *, weights: bool = True, kernels: Mapping[int, Sequence[str]] | None = None,
                meta: Mapping[str, str] | None = None) -> onnx.ModelProto:
    """``graph`` (the fused graph) as an ONNX ModelProto, checked. ``kernels``: {node index: the
    kernels its launches run} (a plan's); ``meta``: extra ``metadata_props``."""
    verify(graph)
    ctx = _Ctx()
    for v in graph.inputs:
        ctx.name(v)
    for c in graph.constants:
        ctx.name(c)
    out_names = []
    for v in graph.outputs:  # an input or constant passed straight out gets an Identity below
        out_names.append(ctx.fresh(v.name) if v in ctx.names or v.name in out_names else ctx.name(v))
    kernels = kernels or {}
    for i, node in enumerate(graph.nodes):
        _node(ctx, node, list(kernels.get(i, ())))
    for v, oname in zip(graph.outputs, out_names):
        if oname != ctx.name(v):
            ctx.add("Identity", [ctx.names[v]], [oname])
    consts = [c for c in graph.constants if c in ctx.names]
    if weights:
        inits = [onnx.numpy_helper.from_array(_np(c.data), ctx.names[c]) for c in consts]
        extra_inputs = []
    else:
        inits, extra_inputs = [], [_vinfo(ctx.names[c], c) for c in consts]
    io = set(graph.inputs) | set(graph.outputs) | set(graph.constants)
    value_info = [_vinfo(ctx.name(v), v) for n in graph.nodes for v in n.outputs if v not in io]
    g = helper.make_graph(ctx.nodes, ctx.fresh(graph.name or "graph"),
                          [_vinfo(ctx.names[v], v) for v in graph.inputs] + extra_inputs,
                          [_vinfo(o, v) for o, v in zip(out_names, graph.outputs)],
                          initializer=inits + ctx.extra_inits, value_info=value_info)
    model = helper.make_model(g, producer_name="fusec", opset_imports=[
        helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)])
    model.ir_version = IR_VERSION
    model.doc_string = "fusec fused graph: one node per kernel; ai.fusec nodes list the ops they fuse (not runnable)"
    for k, v in {"fusec.kernels": str(len(graph.nodes)), **dict(meta or {})}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, str(v)
    if model.ByteSize() > _PROTO_LIMIT:
        raise ModelError(f"the fused graph of {graph.name!r} with its weights ({graph.weight_bytes:,} bytes) does not "
                         "fit one ONNX file (protobuf's 2 GiB limit); export it without weights (--no-weights)")
    onnx.checker.check_model(model)
    return model


def export_fused(graph: Graph, path: str | os.PathLike[str], **kw: Any) -> onnx.ModelProto:
    """Write ``fused_model(graph, **kw)`` to ``path`` atomically; returns the model."""
    from fusec.fsutil import atomic_write

    model = fused_model(graph, **kw)
    with atomic_write(path, what="ONNX file") as f:
        f.write(model.SerializeToString())
    return model


def _np(a: Any) -> Any:
    import numpy as np

    return np.ascontiguousarray(a)


def _node(ctx: _Ctx, node: Node, kernels: list[str]) -> None:
    """One ONNX node for one fused-graph node (see the module docstring)."""
    if node.op == Op.FUSED:
        ops = node_ops(node)
        attrs: dict[str, Any] = {"ops": ops, "rule": node.attrs.rule, "kind": node.attrs.kind.name.lower()}
        _custom(ctx, node, short_name(ops), attrs, kernels)
        return
    mark = (len(ctx.nodes), len(ctx.extra_inits), set(ctx.used))
    names = dict(ctx.names)
    try:
        _emit(ctx, node)
    except NotImplementedError:
        pass
    if len(ctx.nodes) == mark[0] + 1:  # one standard ONNX node: keep it
        if view_of(node) is not None:
            ctx.nodes[-1].doc_string = VIEW_DOC
        elif kernels:
            ctx.nodes[-1].doc_string = "kernels: " + ", ".join(kernels)
        return
    # several (or no) standard nodes: roll them back, one ai.fusec node instead
    del ctx.nodes[mark[0]:]
    del ctx.extra_inits[mark[1]:]
    ctx.used, ctx.names = mark[2], names
    _custom(ctx, node, _camel(node.op.value), {"ops": [node.op.value], **_attrs(node.attrs)}, kernels)


def _custom(ctx: _Ctx, node: Node, op_type: str, attrs: dict[str, Any], kernels: list[str]) -> None:
    if kernels:
        attrs["kernels"] = kernels
    ins = [ctx.name(v) for v in node.inputs]
    outs = [ctx.name(v) for v in node.outputs]
    ctx.nodes.append(helper.make_node(op_type, ins, outs, name=ctx.fresh(f"k_{op_type}"), domain=DOMAIN, **attrs))


def _camel(op: str) -> str:
    special = {"rmsnorm": "RMSNorm", "kv_attention": "KVAttention", "rope": "RoPE"}
    return special.get(op, "".join(p.capitalize() for p in op.split("_")))


def _attrs(attrs: Any) -> dict[str, Any]:
    """The IR attributes ONNX can hold (ints, floats, strings, lists of ints), by field name."""
    out: dict[str, Any] = {}
    if not dataclasses.is_dataclass(attrs):
        return out
    for f in dataclasses.fields(attrs):
        v = getattr(attrs, f.name)
        if isinstance(v, DType):
            v = _ONNX_DTYPE.get(v, v.value)
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float, str)) or (isinstance(v, (tuple, list)) and all(type(x) is int for x in v)
                                                and len(v) > 0):
            out[re.sub(r"\W", "_", f.name)] = list(v) if isinstance(v, tuple) else v
    return out
