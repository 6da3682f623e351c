"""Einsum lowered to TRANSPOSE / RESHAPE / MATMUL (two operands) or REDUCE_SUM / TRANSPOSE (one).

Two-operand forms are classified per letter: batch (both operands and the output), contracted
(both operands, not the output), left-free / right-free (one operand and the output), and summed
(one operand only: reduced away first). Then A is laid out as [batch, M, K], B as [batch, K, N],
one MATMUL runs, and the result is reshaped and transposed into the output's letter order. This
covers attention ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd") and every matmul-like form; diagonals
(a letter repeated inside one operand) are refused.
"""

from __future__ import annotations

import math

from fusec.frontend.emit import Sym
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_ops_data import reshape
from fusec.ops import Op


def _parse(cx: NodeCtx, eq: str, ranks: list[int]) -> tuple[list[str], str]:
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise cx.fail(f"equation {eq!r} names {len(terms)} operands, node has {len(ranks)}")
    used = set(eq) - set(",->.")
    spare = iter(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used)
    ell = ""
    if "..." in eq:  # give the ellipsis dims letters of their own (right-aligned, as numpy does)
        n = max(r - (len(t) - 3) for t, r in zip(terms, ranks) if "..." in t)
        ell = "".join(next(spare) for _ in range(max(n, 0)))
        terms = [t.replace("...", ell[len(ell) - (r - (len(t) - 3)):] if r - (len(t) - 3) > 0 else "")
                 if "..." in t else t for t, r in zip(terms, ranks)]
        rhs = rhs.replace("...", ell)
    for t, r in zip(terms, ranks):
        if len(t) != r or not t.isalpha():
            raise cx.fail(f"equation term {t!r} does not fit an operand of rank {r}")
        if len(set(t)) != len(t):
            raise cx.fail(f"equation {eq!r}: repeated letter in one operand (diagonal) is not supported")
    if not arrow:  # implicit output: letters that appear once, in alphabetical order
        letters = "".join(terms)
        rhs = ell + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ell))
    if not rhs.isalpha() and rhs:
        raise cx.fail(f"equation {eq!r}: output {rhs!r} holds a character that is not a letter")
    missing = sorted(set(rhs) - set("".join(terms)))
    if missing:
        raise cx.fail(f"equation {eq!r}: output letter(s) {', '.join(missing)} appear in no operand")
    if len(set(rhs)) != len(rhs):
        raise cx.fail(f"equation {eq!r}: output {rhs!r} repeats a letter")
    return terms, rhs


def _sum_out(cx: NodeCtx, x: Sym, term: str, keep: set[str]) -> tuple[Sym, str]:
    axes = tuple(i for i, c in enumerate(term) if c not in keep)
    if not axes:
        return x, term
    return cx.emit(Op.REDUCE_SUM, x, axes=axes, keepdims=False), "".join(c for c in term if c in keep)


def _permute(cx: NodeCtx, x: Sym, term: str, order: str, final: bool = False) -> Sym:
    perm = tuple(term.index(c) for c in order)
    if perm == tuple(range(len(perm))):
        return x
    return cx.emit(Op.TRANSPOSE, x, perm=perm, final=final)


@handler("Einsum")
def _einsum(cx: NodeCtx) -> list[Sym | None]:
    xs = [cx.x(i) for i in range(len(cx.ins))]
    terms, out = _parse(cx, str(cx.attr("equation")), [len(x.shape) for x in xs])
    if len(xs) == 1:
        x, t = _sum_out(cx, xs[0], terms[0], set(out))
        return [_permute(cx, x, t, out, final=True)]
    if len(xs) != 2:
        raise cx.fail(f"Einsum with {len(xs)} operands is not supported (one or two)")
    (a, b), (ta, tb) = xs, terms
    size = {c: d for t, x in ((ta, a), (tb, b)) for c, d in zip(t, x.shape) if d != 1}
    size.update({c: 1 for c in ta + tb if c not in size})
    a, ta = _sum_out(cx, a, ta, set(tb) | set(out))
    b, tb = _sum_out(cx, b, tb, set(ta) | set(out))
    batch = [c for c in out if c in ta and c in tb]
    contr = [c for c in ta if c in tb and c not in out]
    lfree = [c for c in ta if c not in tb]
    rfree = [c for c in tb if c not in ta]
    a = _permute(cx, a, ta, "".join(batch + lfree + contr))
    b = _permute(cx, b, tb, "".join(batch + contr + rfree))
    m, k, n = (math.prod(size[c] for c in g) for g in (lfree, contr, rfree))
    a = reshape(cx, a, tuple(a.shape[:len(batch)]) + (m, k), final=False)
    b = reshape(cx, b, tuple(b.shape[:len(batch)]) + (k, n), final=False)
    y = cx.emit(Op.MATMUL, a, b)
    mid = "".join(batch + lfree + rfree)
    y = reshape(cx, y, tuple(y.shape[:len(batch)]) + tuple(size[c] for c in lfree + rfree), final=False)
    if mid == out:
        return [y]
    return [_permute(cx, y, mid, out, final=True)]
