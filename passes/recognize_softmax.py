"""Recognize decomposed softmax, ``exp(x - max(x)) / sum(exp(x - max(x)))`` over one axis (the max
subtraction optional; ``e * reciprocal(sum)`` accepted), and replace it by one SOFTMAX op.

torch exports ``softmax`` as the ONNX op, so this mostly serves hand-written or older graphs;
it runs before attention recognition so that the attention matcher sees one form. The count in
``graph.meta["patterns"]["softmax"]`` is the number of SOFTMAX ops after the pass.
"""

from __future__ import annotations

from fusec.ir import Graph, Node, Value
from fusec.ops import AxisAttrs, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter, factors, recognize

NAME = "recognize_softmax"
REQUIRES = ("constant_fold",)


def _axis(node: Node) -> int | None:
    a = node.attrs
    return a.axes[0] if len(a.axes) == 1 and a.keepdims else None


def _match(ctx: Ctx, rw: Rewriter, root: Node, opts: PassOptions) -> bool:
    out = root.outputs[0]
    nodes: list[Node] = []
    inv: list[Value] = []
    coef, fs = factors(ctx, out, nodes, inv=inv)
    if len(fs) != 1 or len(inv) != 1:
        return False
    e_node = ctx.prod(fs[0], Op.EXP)
    red = ctx.prod(inv[0], Op.REDUCE_SUM)
    if e_node is None or red is None or red.inputs[0] is not fs[0]:
        return False
    where = ctx.where(root)
    axis = _axis(red)
    if axis is None:
        opts.decline("softmax", where, f"the sum runs over axes {list(red.attrs.axes)} (need one, keepdims)")
        return False
    if coef != 1.0:
        opts.decline("softmax", where, f"an extra constant factor {coef:g}")
        return False
    if not ctx.only_used_by(fs[0], nodes + [red]) or not ctx.single_use(inv[0]):
        opts.decline("softmax", where, "exp or its sum has readers outside the softmax")
        return False
    nodes += [e_node, red]
    x = e_node.inputs[0]
    sub = ctx.prod(x, Op.SUB)
    if sub is not None and ctx.single_use(x):
        mx = ctx.prod(sub.inputs[1], Op.REDUCE_MAX)
        if mx is not None and mx.inputs[0] is sub.inputs[0] and _axis(mx) == axis:
            nodes += [sub] + ([mx] if ctx.single_use(sub.inputs[1]) else [])
            x = sub.inputs[0]  # softmax is shift-invariant: the max subtraction is SOFTMAX's own
    if x.shape != out.shape or rw.claimed(nodes):
        return False
    rw.replace(root, [rw.node(Op.SOFTMAX, [x], AxisAttrs(axis), out=out)], nodes)
    return True


def run(graph: Graph, options: PassOptions) -> PassResult:
    return recognize(graph, options, (Op.DIV, Op.MUL), _match, {"softmax": Op.SOFTMAX}, "softmax_recognized",
                     outermost_first=True)
