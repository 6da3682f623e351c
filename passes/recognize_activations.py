"""Recognize decomposed activations: GELU (erf and tanh forms) -> GELU, x*sigmoid(x) -> SILU; count
SwiGLU (``silu(gate) * up``), which fusion then groups (no op of its own: it is two inputs).

Forms (any operand order and grouping; ``match.factors``/``terms`` flatten products and sums):

- GELU erf: ``0.5 * x * (1 + erf(x / sqrt(2)))`` (also ``x * 0.7071...`` inside the erf);
- GELU tanh (HF gelu_new): ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))``, the cube as
  ``pow(x, 3)`` or ``x*x*x``, or the inner factored as ``x * (1 + 0.044715 * x^2)``;
- SiLU: ``x * sigmoid(x)``.
"""

from __future__ import annotations

import math

from fusec.ir import Graph, Node, Value
from fusec.ops import GeluAttrs, NoAttrs, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter, close, factors, recognize, terms

NAME = "recognize_activations"
REQUIRES = ("constant_fold",)

_SQRT2 = math.sqrt(2.0)
_TANH_C = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715


def _is_power(ctx: Ctx, leaves: list[Value], x: Value, k: int, nodes: list[Node]) -> bool:
    """``leaves`` multiply to x^k: [x]*k, or [pow(x, k)] (or a mix such as [x, pow(x, 2)])."""
    total = 0
    for v in leaves:
        if v is x:
            total += 1
            continue
        p = ctx.prod(v, Op.POW)
        e = ctx.scalar(p.inputs[1]) if p is not None else None
        if p is None or p.inputs[0] is not x or e is None or e != int(e) or not ctx.single_use(v):
            return False
        nodes.append(p)
        total += int(e)
    return total == k


def _tanh_inner(ctx: Ctx, u: Value, x: Value, nodes: list[Node]) -> bool:
    """``u == sqrt(2/pi) * (x + 0.044715 x^3)`` in either of the two usual groupings."""
    coef, fs = factors(ctx, u, nodes, root=False)
    if len(fs) == 1:  # c * (x + a x^3)
        c0, ts = terms(ctx, fs[0], nodes, root=False)
        if c0 != 0.0 or len(ts) != 2 or x not in ts:
            return False
        other = ts[1] if ts[0] is x else ts[0]
        a, cube = factors(ctx, other, nodes, root=False)
        return close(coef, _TANH_C) and close(a, _CUBIC) and _is_power(ctx, cube, x, 3, nodes)
    if len(fs) == 2 and x in fs:  # c * x * (1 + a x^2)
        other = fs[1] if fs[0] is x else fs[0]
        c0, ts = terms(ctx, other, nodes, root=False)
        if len(ts) != 1 or not close(c0, 1.0):
            return False
        a, sq = factors(ctx, ts[0], nodes, root=False)
        return close(coef, _TANH_C) and close(a, _CUBIC) and _is_power(ctx, sq, x, 2, nodes)
    return False


def _match_gelu(ctx: Ctx, rw: Rewriter, root: Node, opts: PassOptions) -> bool:
    out = root.outputs[0]
    nodes: list[Node] = []
    coef, fs = factors(ctx, out, nodes)
    if len(fs) != 2 or not out.dtype.is_float:
        return False
    for x, s in ((fs[0], fs[1]), (fs[1], fs[0])):
        c1, ts = terms(ctx, s, nodes_s := [], root=False)
        if len(ts) != 1 or ctx.prod(s) is None:
            continue
        f = ctx.prod(ts[0])
        if f is None or f.op not in (Op.ERF, Op.TANH) or not ctx.single_use(ts[0]):
            continue
        # near match from here on: decline with a reason
        where, form = ctx.where(root), "erf" if f.op == Op.ERF else "tanh"
        inner: list[Node] = [f]
        if form == "erf":
            k, us = factors(ctx, f.inputs[0], inner, root=False)
            ok = us == [x] and close(k, 1 / _SQRT2)
        else:
            ok = _tanh_inner(ctx, f.inputs[0], x, inner)
        if not ok:
            opts.decline("gelu", where, f"the {form} argument is not the GELU polynomial of the multiplied value")
            return False
        if not (close(c1, 1.0) and close(coef, 0.5)):
            opts.decline("gelu", where, f"constants {coef:g} * x * ({c1:g} + {form}) are not 0.5 * x * (1 + {form})")
            return False
        if x.shape != out.shape:
            opts.decline("gelu", where, f"the product broadcasts x {list(x.shape)} to {list(out.shape)}")
            return False
        matched = nodes + nodes_s + inner
        if rw.claimed(matched):
            return False
        approx = "none" if form == "erf" else "tanh"
        rw.replace(root, [rw.node(Op.GELU, [x], GeluAttrs(approx), out=out)], matched)
        return True
    return False


def _match_silu(ctx: Ctx, rw: Rewriter, root: Node, opts: PassOptions) -> bool:
    out = root.outputs[0]
    nodes: list[Node] = []
    coef, fs = factors(ctx, out, nodes)
    for x, s in ((fs[0], fs[1]), (fs[1], fs[0])) if len(fs) == 2 else ():
        sg = ctx.prod(s, Op.SIGMOID)
        if sg is None:
            continue
        if sg.inputs[0] is not x:
            return False  # x * sigmoid(y): a gate, not SiLU
        where = ctx.where(root)
        if coef != 1.0:
            opts.decline("silu", where, f"an extra constant factor {coef:g}")
            return False
        if not ctx.single_use(s):
            opts.decline("silu", where, f"sigmoid output {s.name!r} has other readers")
            return False
        if x.shape != out.shape or rw.claimed(nodes + [sg]):
            return False
        rw.replace(root, [rw.node(Op.SILU, [x], NoAttrs(), out=out)], nodes + [sg])
        return True
    return False


def _count_swiglu(graph: Graph) -> int:
    """``silu(gate) * up``: a MUL with exactly one SILU operand whose input is not the other one."""
    ctx = Ctx(graph)
    n = 0
    for node in graph.nodes:
        if node.op != Op.MUL:
            continue
        a, b = node.inputs
        pa, pb = ctx.prod(a, Op.SILU), ctx.prod(b, Op.SILU)
        if (pa is None) != (pb is None) and a.shape == b.shape:
            n += 1
    return n


def run(graph: Graph, options: PassOptions) -> PassResult:
    # Outermost product first.
    return recognize(graph, options, (Op.MUL,),
                     lambda ctx, rw, n, o: _match_gelu(ctx, rw, n, o) or _match_silu(ctx, rw, n, o),
                     {"gelu": Op.GELU, "silu": Op.SILU, "swiglu": _count_swiglu}, "activations_recognized",
                     outermost_first=True)
