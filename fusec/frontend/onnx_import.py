"""ONNX -> fusec IR. Entry point: ``import_onnx(model, shapes=None) -> Graph`` (verified).

Contract:
- graph inputs are the ONNX graph inputs that are not initializers, with their ONNX names; graph
  outputs keep their ONNX names;
- shapes are static: symbolic dims are bound from ``shapes`` ({input name: dims}); every problem
  with ``shapes`` is a one-line ``InputError`` naming the input;
- every problem with the file (unreadable, unsafe external data, unsupported opset / ops / dtypes)
  is a one-line ``ModelError`` naming the file; all unsupported ops are listed in one error;
- shape arithmetic on constants is folded at import (see ``emit.py``), weights are not folded into;
- dead nodes and unused constants are dropped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import onnx

from fusec.errors import InputError, ModelError
from fusec.frontend import onnx_einsum, onnx_ops, onnx_ops_data, onnx_ops_ext  # noqa: F401  (they register handlers)
from fusec.frontend import onnx_ops_conv, onnx_ops_pool  # noqa: F401  (Conv and pooling handlers)
from fusec.frontend import onnx_ops_act, onnx_ops_attention, onnx_ops_loss, onnx_ops_misc  # noqa: F401  (decomposed)
from fusec.frontend import onnx_ops_norm, onnx_ops_quant, onnx_ops_resize, onnx_ops_seq  # noqa: F401  (decomposed)
from fusec.frontend import onnx_qweights  # noqa: F401  (MatMulNBits; DequantizeLinear -> MatMul as QMATMUL)
from fusec.frontend.emit import WEIGHT_MIN_ELEMS, Const, Emitter, Sym
from fusec.frontend.onnx_ctx import NodeCtx, handler_of
from fusec.frontend.onnx_load import ONNX_TO_DTYPE, LoadedModel, load_model, onnx_type_name
from fusec.frontend.onnx_ops_act import InexactConstant
from fusec.ir import Graph, Node, Value, verify
from fusec.shapes import check_size, normalize_shapes
from fusec.ops import Op

MIN_OPSET = 13
_DEFAULT_DOMAINS = ("", "ai.onnx")


def import_onnx(model: str | os.PathLike | onnx.ModelProto,
                shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """Import an ONNX model as a verified fusec Graph with static shapes (see the module doc)."""
    loaded = load_model(model)
    opset = _check_opsets(loaded)
    _check_supported(loaded, opset)
    return _Importer(loaded, opset).run(shapes or {})


def _opsets(proto: onnx.ModelProto) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in proto.opset_import:
        out["" if o.domain == "ai.onnx" else o.domain] = int(o.version)
    return out


def _check_opsets(loaded: LoadedModel) -> int:
    opset = _opsets(loaded.model).get("")
    top = onnx.defs.onnx_opset_version()
    if opset is None:
        raise ModelError(f"{loaded.label} imports no default-domain opset")
    if not MIN_OPSET <= opset <= top:
        raise ModelError(f"{loaded.label} uses unsupported opset {opset} (fusec supports {MIN_OPSET} to {top})")
    return opset


def _check_supported(loaded: LoadedModel, opset: int) -> None:
    """Collect every unsupported node first, then raise ONE error that lists them all."""
    versions = _opsets(loaded.model)
    bad: dict[tuple[str, str, object], list[str]] = {}
    for node in loaded.model.graph.node:
        dom = "" if node.domain == "ai.onnx" else node.domain
        if handler_of(dom, node.op_type) is not None:
            continue
        bad.setdefault((node.op_type, node.domain, versions.get(dom)), []).append(node.name)
    if not bad:
        return
    parts = []
    for (op, dom, ver), names in bad.items():
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        parts.append(f"{op!r} (domain {dom or 'ai.onnx'!r}, opset {ver}) at node(s) {shown}")
    raise ModelError(f"{loaded.label} has {sum(len(v) for v in bad.values())} unsupported node(s): " + "; ".join(parts))


def _bind_shapes(inputs: list[onnx.ValueInfoProto], shapes: Mapping[str, Sequence[int]],
                 bound: dict[str, tuple[int, str]]) -> dict[str, tuple[int, ...]]:
    """Static shapes of the graph inputs; every mistake is an InputError naming the input.

    ``bound`` receives each symbolic dim's size and the input that bound it."""
    names = [vi.name for vi in inputs]
    for n in shapes:
        if n not in names:
            raise InputError(f"--shapes names unknown input {n!r} (the model takes {', '.join(repr(x) for x in names)})")
    out: dict[str, tuple[int, ...]] = {}
    for vi in inputs:
        tt = vi.type.tensor_type
        dims = list(tt.shape.dim) if tt.HasField("shape") else None
        if vi.name not in shapes:
            if dims is None:
                raise InputError(f"input {vi.name!r} has no shape in the model; give it with --shapes NAME:DxD... (Python: shapes=)")
            sym = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
            if sym:
                raise InputError(f"input {vi.name!r} has symbolic dims {sym}; give its shape with --shapes NAME:DxD... (Python: shapes=)")
            fixed = tuple(int(d.dim_value) for d in dims)
            for i, d in enumerate(fixed):
                if d < 0:
                    raise InputError(f"input {vi.name!r}: dim {i} is {d} in the model; fusec needs dims >= 0 "
                                     "(give the shape with --shapes; Python: shapes=)")
            check_size(fixed, f"input {vi.name!r}")
            out[vi.name] = fixed
            continue
        given = normalize_shapes({vi.name: shapes[vi.name]}, allow_zero=True)[vi.name]  # type: ignore[index]
        if dims is not None and len(given) != len(dims):
            raise InputError(f"input {vi.name!r} has rank {len(dims)}, --shapes gives {list(given)}")
        for i, g in enumerate(given):
            if g <= 0 and not (g == 0 and dims is not None and dims[i].HasField("dim_value") and dims[i].dim_value == 0):
                raise InputError(f"input {vi.name!r}: dim {i} must be positive, got {g}")
            if dims is None:
                continue
            d = dims[i]
            if d.HasField("dim_value") and d.dim_value != g:
                raise InputError(f"input {vi.name!r}: dim {i} is {d.dim_value} in the model, --shapes gives {g}")
            if d.dim_param:
                prev = bound.setdefault(d.dim_param, (g, vi.name))
                if prev[0] != g:
                    raise InputError(f"input {vi.name!r}: symbolic dim {d.dim_param!r} = {g}, but input "
                                     f"{prev[1]!r} binds it to {prev[0]}")
        out[vi.name] = given
    return out


class _Importer:
    def __init__(self, loaded: LoadedModel, opset: int):
        self.loaded = loaded
        self.opset = opset
        self.g = loaded.model.graph
        reserved = {vi.name for vi in self.g.input} | {t.name for t in self.g.initializer}
        reserved |= {o for n in self.g.node for o in n.output} | {vi.name for vi in self.g.output}
        self.em = Emitter(loaded.label, reserved)
        self.env: dict[str, Sym] = {}

    def run(self, shapes: Mapping[str, Sequence[int]]) -> Graph:
        label = self.loaded.label
        _check_names(self.g, label)
        init_names = {t.name for t in self.g.initializer}
        for t in self.g.initializer:
            arr = self.loaded.to_array(t, t.name)
            self.env[t.name] = Const(arr, weight=arr.size > WEIGHT_MIN_ELEMS, name=t.name)
        real_inputs = [vi for vi in self.g.input if vi.name not in init_names]
        self.bound: dict[str, tuple[int, str]] = {}
        static = _bind_shapes(real_inputs, shapes, self.bound)
        inputs = []
        for vi in real_inputs:
            et = vi.type.tensor_type.elem_type
            if et not in ONNX_TO_DTYPE:
                raise ModelError(f"{label}: input {vi.name!r} has dtype {onnx_type_name(et)}, "
                                 "which fusec does not support (fp32, fp16, bf16, fp64, int8-64, uint8-64, bool)")
            v = Value(self.em.claim(vi.name), static[vi.name], ONNX_TO_DTYPE[et])
            inputs.append(v)
            self.env[vi.name] = v
        used = {i for n in self.g.node for i in n.input} | {o.name for o in self.g.output}
        refused: list[ModelError] = []  # every node fusec cannot import, said in one error at the end
        lost: set[str] = set()  # values of refused nodes: their users are not tried (nothing to say)
        for node in self.g.node:
            if any(i in lost for i in node.input if i):
                lost.update(o for o in node.output if o)
                continue
            try:
                self._node(node, used)
            except ModelError as e:
                refused.append(e)
                lost.update(o for o in node.output if o)
        if refused:
            raise _all_refusals(refused, label)
        outputs = self._outputs()
        nodes, consts = _live(self.em.nodes, self.em.constants, outputs)
        graph = Graph(inputs, outputs, nodes, consts, name=self.g.name or "onnx")
        verify(graph)
        return graph

    def _node(self, node: onnx.NodeProto, used: set[str]) -> None:
        ins: list[Sym | None] = []
        for name in node.input:
            if not name:
                ins.append(None)
            elif name in self.env:
                ins.append(self.env[name])
            else:
                raise ModelError(f"{self.loaded.label}: node {node.name!r} uses {name!r}, which nothing defines")
        cx = NodeCtx(self.em, self.loaded, node, ins, self.opset, used)
        try:
            results = list(handler_of(node.domain, node.op_type)(cx))  # type: ignore[misc]  (checked at load)
        except InexactConstant as e:
            raise cx.fail(str(e)) from None
        for i, name in enumerate(node.output):
            if not name:
                continue
            res = results[i] if i < len(results) else None
            if res is None:
                if name in used:
                    raise cx.fail(f"output {i} ({name!r}) is used but fusec does not produce it")
                continue
            if isinstance(res, Const) and res.name is None:
                res.name = name
            self.env[name] = res

    def _outputs(self) -> list[Value]:
        outs: list[Value] = []
        input_vals = set(self.env[vi.name] for vi in self.g.input if vi.name in self.env)
        for vi in self.g.output:
            sym = self.env.get(vi.name)
            if sym is None:
                raise ModelError(f"{self.loaded.label}: graph output {vi.name!r} is never computed")
            if isinstance(sym, Const):
                sym = Const(sym.array, name=vi.name)  # a folded output: a constant of its own name
            v = self.em.value(sym, vi.name)
            if v in input_vals and v.name == vi.name and v not in outs:
                outs.append(v)  # a graph input that is also an output under its own name: passed through as it is
                continue
            if v.name != vi.name or v in outs or v in input_vals:
                # an alias (Identity, no-op reshape, input passed through): copy it under its own name
                v = self.em.op(Op.RESHAPE, [v], name=vi.name, node_name=vi.name, shape=v.shape)  # type: ignore[assignment]
            self._check_declared(vi, v)  # type: ignore[arg-type]
            outs.append(v)  # type: ignore[arg-type]
        return outs

    def _check_declared(self, vi: onnx.ValueInfoProto, v: Value) -> None:
        """The file's declared output type must agree with what the import computed."""
        tt = vi.type.tensor_type
        declared = ONNX_TO_DTYPE.get(tt.elem_type)
        problem = ""
        if tt.elem_type and declared != v.dtype:
            problem = f"dtype {onnx_type_name(tt.elem_type)}"
        elif tt.HasField("shape"):
            dims = list(tt.shape.dim)
            want = [d.dim_value if d.HasField("dim_value") else self.bound.get(d.dim_param, (None,))[0]
                    for d in dims]
            if len(dims) != len(v.shape) or any(w is not None and w != g for w, g in zip(want, v.shape)):
                problem = "shape [" + ", ".join("?" if w is None else str(w) for w in want) + "]"
        if problem:
            raise ModelError(f"{self.loaded.label}: graph output {vi.name!r} is declared with {problem}, "
                             f"but the model computes {v.type_str}")


def _all_refusals(refused: list[ModelError], label: str, shown: int = 8) -> ModelError:
    """One error for every node that could not be imported (the first ``shown`` of them in full)."""
    if len(refused) == 1:
        return refused[0]
    prefix = f"{label}: "
    parts = [str(e)[len(prefix):] if str(e).startswith(prefix) else str(e) for e in refused[:shown]]
    more = f"; and {len(refused) - shown} more" if len(refused) > shown else ""
    return ModelError(f"{label}: {len(refused)} nodes cannot be imported: " + "; ".join(parts) + more)


def _check_names(g: onnx.GraphProto, label: str) -> None:
    """Graph outputs are what plans, archives and callers key results by: refuse an output named
    twice and an empty output name (an output that is also a graph input is the input passed through)."""
    seen: set[str] = set()
    for vi in g.output:
        name = vi.name
        if not name:
            raise ModelError(f"{label}: a graph output has an empty name")
        if name in seen:
            raise ModelError(f"{label}: graph output {name!r} is listed twice; output names must be unique")
        seen.add(name)


def _live(nodes: list[Node], consts: list[Value], outputs: list[Value]) -> tuple[list[Node], list[Value]]:
    """Drop nodes and constants no output depends on (exporters leave unused shape chains behind)."""
    need = set(outputs)
    keep: list[Node] = []
    for n in reversed(nodes):
        if any(o in need for o in n.outputs):
            keep.append(n)
            need.update(n.inputs)
    return keep[::-1], [c for c in consts if c in need]
