"""Weight-only quantization of matrix products with constant weights (``PassOptions.quantize``).

``fusec compile MODEL --quantize int8|int4`` (``fusec.quantize``: per-channel int8, or group-wise
int4 with ``PassOptions.quantize_group`` 32 or 128, both round-to-nearest) turns every
``MATMUL(x, W)`` whose W is a constant 2-D weight, in any of the layouts an importer leaves
([K, N], ``trans_b`` [N, K], or ``TRANSPOSE`` of an [N, K] nn.Linear weight; each also as the CAST to fp32
of a weight stored in bf16/fp16, which constant folding keeps for the precision pass), into one
``QMATMUL`` over the packed weight (``fusec.quant``). It runs before ``precision`` so the codes
come from the weights as the model holds them (fp32, or the bf16/fp16 a large matrix is stored in),
not from a rounding the precision pass would add.

Kept in higher precision (each recorded as a decline with the reason):

- the model's output projections (the LM head): products whose result reaches a user output or a
  ``sample`` node through ops that are not products (``_output_products``); the logits are the
  most sensitive product. ``PassOptions.quantize_head`` quantizes them too;
- embedding tables (GATHER reads them: fusec has no packed gather); a tied LM head reading the
  table is a head above, and with ``quantize_head`` reads a packed copy (the table stays);
- weights whose K is not a multiple of 32, or, for int4, of the group.

Records ``meta["quantized"]`` ({format, method, group, products, weight_bytes_fp32/packed, kept: {reason: products
kept in higher precision for it}}).
"""

from __future__ import annotations

from collections import Counter

from fusec.ir import Graph, Node, Value
from fusec.ops import OP_INFO, FusionKind, Op, QMatMulAttrs
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "quantize"


def _output_products(graph: Graph) -> set[Node]:
    """MATMULs whose result reaches a user output or a SAMPLE through non-product ops only."""
    feeds = set(graph.user_outputs())
    heads: set[Node] = set()
    for n in reversed(graph.nodes):
        reaches = n.op == Op.SAMPLE or any(o in feeds for o in n.outputs)
        if not reaches:
            continue
        if OP_INFO[n.op].kind == FusionKind.GEMM:
            if n.op == Op.MATMUL:
                heads.add(n)
            continue  # a product ends the path: what feeds it is not an output projection
        feeds.update(v for v in n.inputs if v.data is None)
    return heads


def _stored(ctx: Ctx, v: Value) -> tuple[Value, Node | None] | None:
    """(the constant ``v`` holds, the CAST read through) or None: ``v`` itself, or a CAST of a float constant (a
    weight stored in bf16/fp16 while the model was built: constant folding keeps that CAST for the precision pass,
    passes/constant_fold.py)."""
    if v.data is not None:
        return v, None
    c = ctx.prod(v)
    if c is not None and c.op == Op.CAST and c.inputs[0].data is not None and c.inputs[0].dtype.is_float:
        return c.inputs[0], c
    return None


def _weight(ctx: Ctx, node: Node) -> tuple[Value, bool, list[Node]] | None:
    """(constant weight, stored [N, K]?, the TRANSPOSE and CAST read through) of a product, or None."""
    x, b = node.inputs
    trans_b = bool(getattr(node.attrs, "trans_b", False))
    if len(b.shape) == 2 and (found := _stored(ctx, b)) is not None:
        w, cast = found
        return w, trans_b, [cast] if cast is not None else []
    t = ctx.prod(b)
    if not trans_b and t is not None and t.op == Op.TRANSPOSE and t.attrs.perm == (1, 0) \
            and len(t.inputs[0].shape) == 2 and (found := _stored(ctx, t.inputs[0])) is not None:
        w, cast = found
        return w, True, [t] + ([cast] if cast is not None else [])
    return None


def run(graph: Graph, options: PassOptions) -> PassResult:
    method = options.quantize
    if not method:
        return PassResult(graph.copy(), False)
    from fusec.quantize import quantize_shared, why_not

    ctx = Ctx(graph)
    rw = Rewriter(graph)
    heads = _output_products(graph)
    packed: dict[tuple[int, bool], list[Value]] = {}  # one packed copy per weight (and layout)
    count = before = after = 0
    fmt = ""
    kept: Counter[str] = Counter()  # reason -> products kept in higher precision for it (fusec inspect shows them)
    for node in graph.nodes:
        if node.op != Op.MATMUL or getattr(node.attrs, "precision", "f32") != "f32":
            continue
        x = node.inputs[0]
        found = _weight(ctx, node)
        if found is None or x.data is not None or not x.dtype.is_float:
            continue
        w, nk, via = found
        where = ctx.where(node)
        if node in heads and not options.quantize_head:
            options.decline(NAME, where, f"output projection {w.name!r} (the LM head) kept in higher precision "
                                         "(--quantize-head quantizes it)")
            kept["the LM head (--quantize-head packs it)"] += 1
            continue
        n, k = w.shape if nk else w.shape[::-1]
        reason = why_not(method, k, options.quantize_group)
        if reason is not None:
            options.decline(NAME, where, f"weight {w.name!r} kept in higher precision: {reason}")
            kept[reason] += 1
            continue
        key = (id(w), nk)
        if key not in packed:
            assert w.data is not None
            data = w.data if nk else w.data.T
            qw = quantize_shared(data, method, options.quantize_group, w.name)  # once for the plan's entries
            packed[key] = [rw.const(a, f"{w.name}.{role}") for role, a in zip(qw.roles, qw.arrays)]
            before += n * k * 4
            after += qw.nbytes
            fmt = qw.format
        consts = packed[key]
        group = k if method == "int8" else options.quantize_group
        new = rw.node(Op.QMATMUL, [x, *consts], QMatMulAttrs(fmt, n, k, group), out=node.outputs[0], name=node.name)
        rw.replace(node, [new], [node] + via)
        count += 1
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["quantized"] = {"method": method, "format": fmt or None, "group": options.quantize_group if method == "int4"
                           else None, "products": count, "weight_bytes_fp32": before, "weight_bytes_packed": after,
                           "kept": dict(kept)}
    options.bump("products_quantized", count)
    return PassResult(g, count > 0)
