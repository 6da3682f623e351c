"""Fused nodes: which bodies one template covers (``can_lower``), and their lowering.

A body of elementwise/broadcast ops with one output becomes one elementwise kernel whose
expression tree is the body (scalar constants become literals, tensor constants extra operands;
``expand`` is the identity there, since broadcasting composes). Bodies that no template covers
are split back into their members before memory planning (``fusec.lower.legalize``).
"""

from __future__ import annotations

from typing import Any

from fusec.codegen.elementwise import CUDA_EXPR, Apply, Const, Expr, In
from fusec.ir import Graph, Node, Value
from fusec.lower import Context, LoweringError
from fusec.ops import OP_INFO, FusionKind, Op


def body_expr(body: Graph) -> tuple[Expr, list[Value]] | None:
    """The body as one expression over its inputs (+ tensor constants), or None if it is not one."""
    if len(body.outputs) != 1:
        return None
    env: dict[Value, Expr] = {v: In(i) for i, v in enumerate(body.inputs)}
    extra: list[Value] = []
    for c in body.constants:
        assert c.data is not None
        if c.numel == 1:
            env[c] = Const(c.data.reshape(()).item(), c.dtype)
        else:
            env[c] = In(len(body.inputs) + len(extra))
            extra.append(c)
    for n in body.nodes:
        if n.op == Op.EXPAND:
            env[n.output] = env[n.inputs[0]]
            continue
        if OP_INFO[n.op].kind not in (FusionKind.ELEMENTWISE, FusionKind.BROADCAST) or n.op not in CUDA_EXPR:
            return None
        env[n.output] = Apply(n.op, tuple(env[v] for v in n.inputs), n.attrs)
    return env[body.outputs[0]], extra


def plan_for(node: Node) -> Any:
    """How a fused node is lowered, or None when no single template covers its body."""
    body = node.attrs.body
    found = body_expr(body)
    if found is not None:
        return ("elementwise", found)
    return None


def can_lower(node: Node) -> bool:
    return plan_for(node) is not None


def lower_fused(ctx: Context, node: Node, label: str) -> None:
    plan = plan_for(node)
    if plan is None:
        raise LoweringError(f"{label}: fused group ({node.attrs.rule}) has no single-kernel lowering; "
                            f"legalize should have split it")
    kind, detail = plan
    if kind == "elementwise":
        from fusec.lower.nodes import elementwise

        expr, extra = detail
        elementwise(ctx, expr, [*node.inputs, *extra], node.output, label + f" fused[{node.attrs.rule}]")
        ctx.count("fused_one_kernel")
