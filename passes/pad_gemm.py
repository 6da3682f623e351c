"""Pad the N of matrix products with a constant 2-D weight to a 16-byte multiple.

Rows of C (and of a [K, N] B) that are not 16-byte multiples push cuBLAS off its tensor-core
fast path: on an H200, 1024x50257x768 fp16 (GPT-2's lm_head) ran at 128 TFLOP/s, padded to
50264 at 620. So a product ``y = x @ W`` whose N is not a multiple of ``16 / itemsize`` becomes

    y_pad = x @ W_pad            # W's N padded with zeros: [K, Npad] (or [Npad, K] with trans_b)
    [y_pad = y_pad + bias_pad]   # a constant bias ADD right after the product is padded too
    y = slice(y_pad, last axis, 0:N)

in the IR, so the padded weight is an ordinary constant (counted in the weight bytes), the padded
product an ordinary arena value (no scratch space in the lowering), and the SLICE is fusion's
and the views' business: read in place by an elementwise consumer, or one copy kernel when ``y``
is a graph output (the logits).

A padded weight replaces the original for every reader that allows it: other products, and
GATHERs of a [V, D] table read with ``trans_b`` by the lm_head (a tied embedding: the rows added
are never read by a token id in [0, V), so the table is stored once; an id outside [0, V), which
is out of the model's input bound, reads a zero row instead of the embedding kernel's NaN row,
and a negative id counts from Npad instead of V). A weight something else still reads is kept
beside the padded one; those bytes are counted in ``stats["pad_gemm_extra_bytes"]``.

Packed products (``QMATMUL``) are left alone: the quantized GEMV takes any N, and the prefill's
path dequantizes the weight into scratch and hands cuBLAS the output with ``ldc = N`` block by
block (``fusec.lower.quant``); padding packed rows would only add bytes every decode step reads.
"""

from __future__ import annotations

import numpy as np

from fusec.bulk import derived
from fusec.ir import Graph, Node, Value
from fusec.ops import MatMulAttrs, NoAttrs, Op, SliceAttrs
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "pad_gemm"
REQUIRES = ("transpose_cache", "merge_gemms")  # pad the layout and N the products finally read
ALIGN_BYTES = 16


def _trans_b(node: Node) -> bool:
    return bool(getattr(node.attrs, "trans_b", False))


def _bias_add(ctx: Ctx, mm: Node) -> tuple[Node, Value] | None:
    """The constant bias ADD [N] right after ``mm`` (its only reader), if any."""
    out = mm.outputs[0]
    users = ctx.users(out)
    if not ctx.single_use(out) or users[0].op != Op.ADD:
        return None
    add = users[0]
    b = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    n = out.shape[-1]
    if b is out or b.data is None or b.numel != n or b.shape[-1:] != (n,) or b.dtype != out.dtype \
            or add.outputs[0].shape != out.shape:
        return None
    return add, b


def run(graph: Graph, options: PassOptions) -> PassResult:
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    padded_weights: dict[int, Value] = {}
    repointed: set[Node] = set()
    padded = extra = 0
    for node in graph.nodes:
        if node.op != Op.MATMUL or rw.claimed([node]):
            continue
        x, w = node.inputs
        out = node.outputs[0]
        if w.data is None or len(w.shape) != 2 or len(x.shape) < 2 or not out.dtype.is_float \
                or getattr(node.attrs, "trans_a", False):
            continue
        align = max(1, ALIGN_BYTES // out.dtype.itemsize)
        tb = _trans_b(node)
        n = w.shape[0] if tb else w.shape[1]
        if n % align == 0:
            continue
        npad = -(-n // align) * align
        wp = padded_weights.get((id(w), tb))
        if wp is None:
            pad = ((0, npad - n), (0, 0)) if tb else ((0, 0), (0, npad - n))
            data = np.asarray(w.data)
            wp = padded_weights[(id(w), tb)] = rw.const(derived("pad", [data], tuple(pad), lambda d=data, p=pad: np.pad(d, p)),
                                                        f"{w.name}.pad{npad}")
            others = [u for u in ctx.users(w) if not (u.op == Op.MATMUL and u.inputs[1] is w
                                                      and u.inputs[0] is not w and _trans_b(u) == tb)]
            gathers = [u for u in others if u.op == Op.GATHER and u.inputs[0] is w and u.inputs[1] is not w
                       and u.attrs.axis == 0 and tb]
            if ctx.is_output(w) or len(gathers) != len(others):
                extra += w.nbytes  # something else reads the unpadded weight: it stays too
            for g in gathers:  # rows past V are never read by an id in [0, V)
                rw.replace(g, [Node(Op.GATHER, [wp, g.inputs[1]], g.outputs, g.attrs, g.name)], [g])
                repointed.add(g)
        mm = rw.node(Op.MATMUL, [x, wp], MatMulAttrs(trans_b=tb), base=f"{out.name}_pad")
        new = [mm]
        matched = [node]
        y, last = mm.outputs[0], mm.outputs[0]
        bias = _bias_add(ctx, node)
        if bias is not None:
            add, b = bias
            bp = rw.const(np.pad(np.asarray(b.data).reshape(n), (0, npad - n)), f"{b.name}.pad{npad}")
            add_node = rw.node(Op.ADD, [y, bp], NoAttrs(), base=f"{y.name}_bias")
            new.append(add_node)
            matched.append(add)
            last, out = add_node.outputs[0], add.outputs[0]
        ax = len(last.shape) - 1
        new.append(rw.node(Op.SLICE, [last], SliceAttrs((ax,), (0,), (n,), (1,)), out=out))
        rw.replace(node, new, matched)
        padded += 1
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["gemms_padded"] = padded
    options.bump("gemms_padded", padded)
    if extra:
        options.bump("pad_gemm_extra_bytes", extra)
    return PassResult(g, padded > 0)
