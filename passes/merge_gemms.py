"""Horizontal GEMM merges: matrix products that read the same activation with constant [K, N_i]
weights become ONE product with the weights concatenated along N, followed by SLICEs.

Q/K/V projections (and Llama's gate/up) all read the normed hidden state: one [K, sum N_i] GEMM
reads the activation once and launches once instead of three times. A constant bias ADD right
after a branch (Qwen2's q/k/v bias, BERT's) is merged too, as one concatenated bias (zeros for a
branch without one), so the epilogue fusion sees a single "GEMM + bias". Each SLICE re-produces
its branch's original output Value, so readers are untouched; whether a SLICE costs a kernel is
for fusion and ``views`` to decide (attention and elementwise groups read them in place).

Requires ``transpose_cache``: weights must already be constants, in [K, N] layout or read with
``trans_b`` ([N_i, K], concatenated along their rows); products of the two layouts do not merge.
Packed products (``QMATMUL``) of one activation merge too when their format, K, group and
operand dtypes agree: every packed operand is [N, ...], so the merged weight is their row
concatenation (a Q4_K_M file's q/k (Q4_K) merge; its v (Q6_K) stays apart). Weights that already
lie one after another in one buffer (models/gguf.py packs a merge group so) merge as a view of it
(``fusec.bulk.concat_rows``), not a second copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fusec.bulk import concat_rows, derived
from fusec.ir import Graph, Node, Value
from fusec.ops import MatMulAttrs, NoAttrs, Op, SliceAttrs
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter

NAME = "merge_gemms"
REQUIRES = ("transpose_cache",)


def _branch(ctx: Ctx, mm: Node) -> tuple[Node, Node | None, Value]:
    """(matmul, bias ADD or None, the branch's output value)."""
    out = mm.outputs[0]
    users = ctx.users(out)
    n = out.shape[-1]
    if ctx.single_use(out) and users[0].op == Op.ADD:
        add = users[0]
        b = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        if b.data is not None and b.numel == n and b.shape[-1:] == (n,) and add.outputs[0].shape == out.shape \
                and b.dtype == out.dtype:
            return mm, add, add.outputs[0]
    return mm, None, out


def run(graph: Graph, options: PassOptions) -> PassResult:
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    groups: dict[tuple[Any, ...], list[Node]] = {}
    for node in graph.nodes:
        if node.op == Op.QMATMUL:  # packed weights: every operand is [N, ...], merged by concatenation
            x, packed = node.inputs[0], node.inputs[1:]
            if x.data is None and len(x.shape) >= 2 and all(p.data is not None for p in packed):
                a = node.attrs
                groups.setdefault((x, "packed", a.format, a.k, a.group, tuple(p.dtype for p in packed)), []).append(node)
            continue
        if node.op != Op.MATMUL:
            continue
        x, w = node.inputs
        if w.data is None or len(w.shape) != 2 or x.data is not None or len(x.shape) < 2 \
                or getattr(node.attrs, "trans_a", False):
            continue
        groups.setdefault((x, bool(getattr(node.attrs, "trans_b", False))), []).append(node)
    merged = 0
    for key, mms in groups.items():
        x = key[0]
        if len(mms) < 2:
            continue
        if len({m.inputs[1].dtype for m in mms}) != 1:
            options.decline("merge_gemms", ctx.where(mms[0]), "products of one input have different weight dtypes")
            continue
        branches = [_branch(ctx, m) for m in mms]
        first = mms[0]
        if key[1] == "packed":
            mm = _merge_packed(rw, mms)
        else:
            trans_b = bool(key[1])
            weights = [m.inputs[1].data for m in mms]
            axis = 0 if trans_b else 1
            big = rw.const(derived("concatenate", weights, axis,  # type: ignore[arg-type]
                                   lambda w=weights, a=axis: concat_rows(w) if a == 0 else np.concatenate(w, axis=a)),
                           _merged_name([m.inputs[1].name for m in mms]))
            mm = rw.node(Op.MATMUL, [x, big], MatMulAttrs(trans_b=trans_b), base=f"{first.outputs[0].name}_merged")
        new: list[Node] = [mm]
        y = mm.outputs[0]
        if any(add is not None for _, add, _ in branches):
            parts = []
            for (m, add, _) in branches:
                n = m.outputs[0].shape[-1]
                if add is None:
                    parts.append(np.zeros((n,), m.outputs[0].dtype.np))
                else:
                    b = add.inputs[1] if add.inputs[0] is m.outputs[0] else add.inputs[0]
                    parts.append(np.asarray(b.data).reshape(n))
            bias = rw.const(np.concatenate(parts), _merged_name([f"{m.inputs[1].name}.bias" for m in mms]))
            add_node = rw.node(Op.ADD, [y, bias], NoAttrs(), base=f"{y.name}_bias")
            new.append(add_node)
            y = add_node.outputs[0]
        off, last = 0, len(y.shape) - 1
        matched: list[Node] = []
        for (m, add, out) in branches:
            n = m.outputs[0].shape[-1]
            new.append(rw.node(Op.SLICE, [y], SliceAttrs((last,), (off,), (off + n,), (1,)), out=out))
            off += n
            matched += [m] + ([add] if add is not None else [])
        rw.replace(first, new, matched)
        merged += 1
        options.bump("gemms_merged_branches", len(mms))
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["gemms_merged"] = merged
    options.bump("gemms_merged", merged)
    return PassResult(g, merged > 0)


def _merge_packed(rw: Rewriter, mms: list[Node]) -> Node:
    """One QMATMUL over the packed weights of ``mms`` stacked along N (same format, K, group)."""
    first = mms[0]
    packed = []
    for j in range(1, len(first.inputs)):
        parts = [m.inputs[j] for m in mms]
        role = parts[0].name.rsplit(".", 1)[-1]  # codes, scale...: one name per operand
        data = [p.data for p in parts]
        stacked = derived("concatenate", data, 0, lambda d=data: concat_rows(d))  # type: ignore[arg-type]
        packed.append(rw.const(stacked, f"{_merged_name([p.name for p in parts])}.{role}"))
    n = sum(m.attrs.n for m in mms)
    return rw.node(Op.QMATMUL, [first.inputs[0], *packed], dataclasses.replace(first.attrs, n=n),
                   base=f"{first.outputs[0].name}_merged")


def _merged_name(names: list[str]) -> str:
    """``layers.0.self_attn.{q,k,v}_proj.weight``-style name: the common prefix plus the parts."""
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[:-1]
    return f"{prefix}merged{len(names)}" if prefix else "merged_weight"
