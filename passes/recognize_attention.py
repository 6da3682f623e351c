"""Recognize scaled dot-product attention and replace it by ONE ATTENTION op (all heads, GQA/MQA).

The match starts at the second matrix product ``P @ V`` and walks back:

- P: SOFTMAX over the last axis, optionally through float CASTs (HF's fp32 softmax) and torch's
  SDPA guard ``where(isnan(p), 0, p)`` (-> ``nan_to_zero``);
- the scores path from the softmax back to ``Q @ K^T``: constant multiplies/divides anywhere on it
  and on Q and K before the product (torch's SDPA export scales Q and K by sqrt(scale) each) fold
  into ``scale``; each ADD contributes an additive mask; ``where(cond, s, fill)`` with a -inf /
  finfo.min fill contributes the additive mask ``where(cond, 0, fill)``; masks combine by ADD. A
  constant causal mask becomes ``causal=True`` instead of a tensor. One TANH with only constant
  scales between it and Q @ K^T is a soft-cap (Gemma-2): ``c * tanh(a * qk)`` is
  ``softcap * tanh(scale * qk / softcap)`` with softcap = |c|, scale = a * c;
- K and V are traced back through their layout chain (RESHAPE/TRANSPOSE/EXPAND: the K^T
  transpose, HF's repeat_kv, torch's 3-D reshapes) to a [B, Hkv, T, D] tensor. Whether a chain
  really is "transpose + repeat heads" is decided by running it on an index tensor and comparing
  with the expected index map: one check for every way an exporter spells the same layout.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np

from fusec import reference
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import AttentionAttrs, AxisAttrs, CastAttrs, MatMulAttrs, NoAttrs, Op, PermAttrs, ShapeAttrs
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter, count_ops, recognize, set_pattern_count

NAME = "recognize_attention"
REQUIRES = ("constant_fold", "recognize_softmax")

_MASK_FILL = -1e30  # a where-fill at or below this masks: s + fill == fill in fp32
_LAYOUT_OPS = (Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND)
_MAX_CHAIN = 8
_ID = (0, 1, 2, 3)


class Decline(Exception):
    """A near match failed a check; the message is the one-line reason."""


def _float_cast(ctx: Ctx, v: Value) -> Node | None:
    n = ctx.prod(v, Op.CAST)
    return n if n is not None and n.inputs[0].dtype.is_float and v.dtype.is_float else None


def _probs(ctx: Ctx, p: Value, nodes: list[Node]) -> tuple[Node, bool] | None:
    """(softmax node, nan_to_zero) behind the P operand, or None if P is not a softmax."""
    nan_to_zero = False
    for _ in range(6):
        if not ctx.only_used_by(p, nodes):
            return None
        n = ctx.prod(p)
        if n is None:
            return None
        if n.op == Op.SOFTMAX:
            if n.attrs.axis != len(p.shape) - 1:
                return None
            nodes.append(n)
            return n, nan_to_zero
        if _float_cast(ctx, p) is not None:
            nodes.append(n)
            p = n.inputs[0]
        elif n.op == Op.WHERE and ctx.scalar(n.inputs[1]) == 0.0:
            isnan = ctx.prod(n.inputs[0], Op.ISNAN)
            if isnan is None or isnan.inputs[0] is not n.inputs[2]:
                return None
            nodes += [n, isnan]
            nan_to_zero, p = True, n.inputs[2]
        else:
            return None
    return None


def _plain_matmul(n: Node | None) -> bool:
    """A product read as it is stored, in exact fp32 (attention computes A @ B, not A @ B^T)."""
    return n is not None and n.op == Op.MATMUL and not n.attrs.trans_b and not n.attrs.trans_a and n.attrs.precision == "f32"


def _is_qk(n: Node | None) -> bool:
    return _plain_matmul(n) and len(n.outputs[0].shape) == 4 and all(v.data is None for v in n.inputs)


def _leads_to_qk(ctx: Ctx, v: Value, depth: int = 8) -> bool:
    n = ctx.prod(v)
    if n is None or depth == 0:
        return False
    if _is_qk(n):
        return True
    if n.op in (Op.CAST, Op.MUL, Op.DIV, Op.ADD, Op.WHERE, Op.TANH):
        return any(_leads_to_qk(ctx, x, depth - 1) for x in n.inputs if x.data is None)
    return False


def _scores(ctx: Ctx, rw: Rewriter, s: Value, nodes: list[Node],
            new: list[Node]) -> tuple[Node, float, list[Value], float]:
    """Walk from the softmax input to Q @ K^T: (qk node, scale, additive masks already multiplied
    by any scale applied after them, soft-cap or 0). Mask nodes it has to create go to ``new``."""
    scale = 1.0
    masks: list[tuple[Value, float]] = []  # (mask, the scale applied after it on the path)
    cap_at: tuple[float, int] | None = None  # at the TANH: (the scale after it, masks seen)
    for _ in range(12):
        n = ctx.prod(s)
        if n is None:
            raise Decline(f"scores {s.name!r} are not computed from a Q @ K^T product")
        if not ctx.single_use(s):
            raise Decline(f"scores {s.name!r} have readers outside the attention")
        nodes.append(n)
        if _is_qk(n):
            cap = 0.0
            if cap_at is not None:
                if len(masks) > cap_at[1]:
                    raise Decline("a mask between Q @ K^T and the tanh soft-cap (the kernel caps before masking)")
                cap, scale = abs(cap_at[0]), scale * cap_at[0]
            return n, scale, [_scaled_mask(rw, m, f, new) for m, f in masks], cap
        a = n.inputs
        if _float_cast(ctx, s) is not None:
            s = a[0]
        elif n.op in (Op.MUL, Op.DIV):
            c = ctx.scalar(a[1])
            if n.op == Op.MUL and c is None and ctx.scalar(a[0]) is not None:
                c, a = ctx.scalar(a[0]), (a[1], a[0])
            if c is None or c == 0.0:
                raise Decline(f"scores are scaled by a non-constant {n.op.value} ({a[1].name!r})")
            scale = scale * c if n.op == Op.MUL else scale / c  # upstream of the masks seen so far
            s = a[0]
        elif n.op == Op.ADD:
            on = [x for x in a if _leads_to_qk(ctx, x)]
            if len(on) != 1:
                raise Decline("cannot tell the scores from the mask in an ADD")
            s = on[0]
            masks.append((a[1] if a[0] is s else a[0], scale))
        elif n.op == Op.WHERE:
            cond, t, f = a
            ft, ff = ctx.scalar(t), ctx.scalar(f)
            if ff is not None and ff <= _MASK_FILL:
                s, m = t, _where_mask(rw, cond, 0.0, ff, s.dtype, new)
            elif ft is not None and ft <= _MASK_FILL:
                s, m = f, _where_mask(rw, cond, ft, 0.0, s.dtype, new)
            else:
                raise Decline("a WHERE on the scores does not fill with -inf or finfo.min")
            masks.append((m, scale))
        elif n.op == Op.TANH:  # soft-cap: c * tanh(a * qk), c the scale so far, a what follows
            if cap_at is not None:
                raise Decline("two tanh on the scores path (one soft-cap only)")
            cap_at, scale, s = (scale, len(masks)), 1.0, a[0]
        else:
            raise Decline(f"unexpected {n.op.value} between Q @ K^T and the softmax")
    raise Decline("scores path too long")


def _where_mask(rw: Rewriter, cond: Value, yes: float, no: float, dt: DType, new: list[Node]) -> Value:
    """The additive mask ``where(cond, yes, no)``: a constant when cond is, else a new node."""
    if cond.data is not None:
        return rw.const(np.where(cond.data, np.asarray(yes, dt.np), np.asarray(no, dt.np)), "attn_mask")
    zero = rw.const(np.asarray(yes, dt.np), "attn_mask_yes")
    fill = rw.const(np.asarray(no, dt.np), "attn_mask_no")
    node = rw.node(Op.WHERE, [cond, zero, fill], NoAttrs(), base="attn_mask")
    new.append(node)
    return node.outputs[0]


def _scaled_mask(rw: Rewriter, m: Value, f: float, new: list[Node]) -> Value:
    if f == 1.0:
        return m
    node = rw.node(Op.MUL, [m, rw.const(np.asarray(f, m.dtype.np), "attn_mask_scale")], NoAttrs(), base="attn_mask")
    new.append(node)
    return node.outputs[0]


def _peel_scale(ctx: Ctx, v: Value, nodes: list[Node]) -> tuple[Value, float]:
    scale = 1.0
    while ctx.single_use(v):
        n = ctx.prod(v)
        if n is None or n.op not in (Op.MUL, Op.DIV):
            break
        c, x = ctx.scalar(n.inputs[1]), n.inputs[0]
        if n.op == Op.MUL and c is None:
            c, x = ctx.scalar(n.inputs[0]), n.inputs[1]
        if c is None or c == 0.0:
            break
        scale = scale * c if n.op == Op.MUL else scale / c
        nodes.append(n)
        v = x
    return v, scale


def _heads_base(ctx: Ctx, v: Value, heads: int, transposed: bool) -> tuple[Value, tuple[int, ...], list[Node]] | None:
    """Trace ``v`` ([B, Hq, T, D], or [B, Hq, D, T] if ``transposed``) back through layout ops to a
    tensor ``x`` with ``transpose(x, perm)`` = [B, Hkv, T, D] of which ``v`` is a head-repeated
    (and transposed) view. Prefers the furthest ``x`` needing no transpose; else the furthest one
    that does (a merged transpose, as simplify leaves GPT-2's K^T, has no [B, H, T, D] value: one
    new transpose of the head-split reshape replaces the chain)."""
    permuted = None
    best = None
    chain: list[Node] = []
    cur = v
    for _ in range(_MAX_CHAIN):
        if len(cur.shape) == 4:
            steps = tuple((n.op, n.attrs) for n in reversed(chain))  # the layout ops from cur to v
            try:
                perm = _layout_perm(cur.shape, steps, v.shape, heads, transposed)
            except TypeError:  # attrs holding a list (unhashable): checked without the cache
                perm = _layout_perm.__wrapped__(cur.shape, steps, v.shape, heads, transposed)
            if perm == _ID:
                best = (cur, perm, list(chain))
            elif perm is not None:
                permuted = (cur, perm, list(chain))
        n = ctx.prod(cur)
        if n is None or n.op not in _LAYOUT_OPS:
            break
        chain.append(n)
        cur = n.inputs[0]
    return best or permuted


@functools.lru_cache(maxsize=64)
def _layout_perm(x_shape: tuple[int, ...], steps: tuple[tuple[Op, object], ...], v_shape: tuple[int, ...],
                 heads: int, transposed: bool) -> tuple[int, ...] | None:
    """The first ``perm`` for which a value of ``x_shape`` taken through the layout ``steps`` (ops and attrs, in
    order) is ``repeat(transpose(x, perm), heads / Hkv, axis=1)`` (its last two axes swapped if ``transposed``), or
    None. Cached: a decoder's layers repeat one chain of shapes and attrs, so a plan checks each once (the check
    replays the chain on an index array as large as the value: at a batch-32, 4,096-token prefill, once a layer
    and layout took 245 of a plan's 274 s to compile)."""
    got = None  # the chain replayed on x's element indices, once for every layout tried
    for perm in itertools.permutations(range(4)):
        if not _fits(x_shape, perm, v_shape, heads, transposed):
            continue
        if got is None:
            got = _replay(x_shape, steps)
        if _same_layout(x_shape, perm, got, v_shape, heads, transposed):
            return perm
    return None


def _heads(v_shape: tuple[int, ...], heads: int) -> int:
    return 1 if v_shape[1] == 1 else heads  # one head the matmul broadcasts (Falcon's MQA: no repeat_kv)


def _fits(x_shape: tuple[int, ...], perm: tuple[int, ...], v_shape: tuple[int, ...], heads: int,
          transposed: bool) -> bool:
    """Whether ``transpose(x, perm)`` = [B, Hkv, T, D] has the shape of which v would be the head-repeated (and
    transposed) view."""
    b, hkv, t, d = (x_shape[p] for p in perm)
    heads = _heads(v_shape, heads)
    want = (v_shape[0], heads) + ((d, t) if transposed else (t, d))
    return v_shape == want and hkv > 0 and heads % hkv == 0


def _replay(x_shape: tuple[int, ...], steps: tuple[tuple[Op, object], ...]) -> np.ndarray:
    """The element indices of x after the layout ``steps``: v's element i is x's element got[i]."""
    numel = math.prod(x_shape)
    got = np.arange(numel, dtype=np.int32 if numel < 2**31 else np.int64).reshape(x_shape)
    for op, attrs in steps:
        got = reference.IMPL[op](attrs, got)
    return got


def _same_layout(x_shape: tuple[int, ...], perm: tuple[int, ...], got: np.ndarray, v_shape: tuple[int, ...],
                 heads: int, transposed: bool) -> bool:
    """Whether v's element indices ``got`` (``_replay``) are those of ``repeat(transpose(x, perm), heads / Hkv,
    axis=1)`` (its last two axes swapped if ``transposed``). The expected index of v[a0, a1, a2, a3] is a sum of one
    term an axis from x's strides, compared a slice of a0 at a time (not an index array as large as v, transposed
    and repeated)."""
    if got.shape != v_shape:
        return False
    rep = _heads(v_shape, heads) // x_shape[perm[1]]
    strides = [math.prod(x_shape[i + 1:]) for i in range(4)]
    s = [strides[p] for p in perm]  # x's element stride of each axis of transpose(x, perm)
    if transposed:  # v's axes 2 and 3 are transpose(x, perm)'s 3 and 2
        s = [s[0], s[1], s[3], s[2]]
    a1 = (np.arange(v_shape[1], dtype=np.int64) // rep * s[1])[:, None, None]
    rest = a1 + (np.arange(v_shape[2], dtype=np.int64) * s[2])[:, None] + np.arange(v_shape[3], dtype=np.int64) * s[3]
    return all(np.array_equal(got[a0], rest + a0 * s[0]) for a0 in range(v_shape[0]))


def _transposed(rw: Rewriter, x: Value, perm: tuple[int, ...], new: list[Node]) -> Value:
    if perm == _ID:
        return x
    node = rw.node(Op.TRANSPOSE, [x], PermAttrs(perm), base=f"{x.name}_heads")
    new.append(node)
    return node.outputs[0]


def _is_causal(m: Value, s: int, t: int) -> bool:
    """A constant mask that is exactly causal (query i sees keys up to i + t - s). Not with more
    queries than keys: their first rows would see no key (NaN in attention) where the additive
    mask's finite fill still averages over all of them."""
    if m.data is None or m.numel != s * t or m.shape[-2:] != (s, t) or s > t:
        return False
    a = m.data.reshape(s, t).astype(np.float32)
    keep = np.tril(np.ones((s, t), bool), k=t - s)
    return bool(np.all(a[keep] == 0) and np.all(a[~keep] <= _MASK_FILL))


def _match(ctx: Ctx, rw: Rewriter, root: Node, opts: PassOptions) -> bool:
    out = root.outputs[0]
    nodes: list[Node] = [root]
    found = _probs(ctx, root.inputs[0], nodes)
    if found is None or len(out.shape) != 4 or not _plain_matmul(root):
        return False
    sm, nan_to_zero = found
    where = ctx.where(root)
    new: list[Node] = []
    try:
        qk, scale, masks, softcap = _scores(ctx, rw, sm.inputs[0], nodes, new)
        q, sq = _peel_scale(ctx, qk.inputs[0], nodes)
        kt, sk = _peel_scale(ctx, qk.inputs[1], nodes)
        if len(q.shape) != 4:
            raise Decline(f"query {q.name!r} is rank {len(q.shape)}, need [B, H, S, D]")
        heads = q.shape[1]
        kb = _heads_base(ctx, kt, heads, transposed=True)
        vb = _heads_base(ctx, root.inputs[1], heads, transposed=False)
        if kb is None:
            raise Decline(f"K operand {kt.name!r} is not K^T of a [B, Hkv, T, D] tensor (with heads repeated)")
        if vb is None:
            raise Decline(f"V operand {root.inputs[1].name!r} is not a [B, Hkv, T, D] tensor (with heads repeated)")
        (k, kperm, kchain), (v, vperm, vchain) = kb, vb
        k, v = _transposed(rw, k, kperm, new), _transposed(rw, v, vperm, new)
        if k.shape[1] != v.shape[1]:
            raise Decline(f"K has {k.shape[1]} heads but V has {v.shape[1]}")
        s_len, t_len = q.shape[2], k.shape[2]
        causal = False
        kept = []
        for m in masks:
            if not causal and _is_causal(m, s_len, t_len):
                causal = True
            else:
                kept.append(m)
        ins = [q, k, v]
        for m in kept:
            if not m.dtype.is_float:
                raise Decline(f"mask {m.name!r} is {m.dtype.value}, expected an additive float mask")
        mask = kept[0] if kept else None
        for m in kept[1:]:
            node = rw.node(Op.ADD, [mask, m], NoAttrs(), base="attn_mask")  # type: ignore[list-item]
            new.append(node)
            mask = node.outputs[0]
        if mask is not None:
            ins.append(mask)
        attrs = AttentionAttrs(scale=float(scale * sq * sk), causal=causal, nan_to_zero=nan_to_zero, softcap=softcap)
        why = _unsupported(q, k, attrs.scale, opts)
        if why:
            raise Decline(f"{why}; left unfused")
        try:
            att = rw.node(Op.ATTENTION, ins, attrs, out=out)
        except ValueError as e:
            raise Decline(str(e)) from None
    except Decline as e:
        opts.decline("attention", where, str(e))
        return False
    matched = nodes + kchain + vchain
    if rw.claimed(matched):
        return False
    rw.replace(root, new + [att], matched)
    return True


def _unsupported(q: Value, k: Value, scale: float, opts: PassOptions) -> str:
    """Why the attention kernel cannot take this q/k in the plan's storage dtype ("" if it can)."""
    from fusec.codegen.build_attention import unsupported

    dt = DType(opts.storage_dtype) if q.dtype == DType.F32 else q.dtype
    (b, hq, s, d), (hkv, t) = q.shape, k.shape[1:3]
    return unsupported(b, hq, hkv, s, t, d, dt, scale) if dt.is_float else f"attention in {dt.value}"


def _decompose(rw: Rewriter, n: Node) -> list[Node]:
    """An ATTENTION node as the ops it stands for (repeat KV heads, q @ k^T * scale [soft-capped] + masks,
    softmax, @ v): for a node the attention kernel cannot take, e.g. one made before the storage
    dtype was known. Causal and bool masks fill with finfo(fp32).min, not -inf: a causal row always
    sees key 0; a row a bool mask hides entirely averages V where the reference gives NaN (rows that
    see no key are unspecified, as in the kernel)."""
    q, k, v, *mask = n.inputs
    a, new = n.attrs, []

    def add(op: Op, ins: list[Value], attrs: object, out: Value | None = None) -> Value:
        new.append(rw.node(op, ins, attrs, base="attn_unfused", out=out))
        return new[-1].outputs[0]

    b, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    if hkv != hq:
        k, v = ((add(Op.RESHAPE, [add(Op.EXPAND, [add(Op.RESHAPE, [x], ShapeAttrs((b, hkv, 1, t, d)))],
                                      ShapeAttrs((b, hkv, hq // hkv, t, d)))], ShapeAttrs((b, hq, t, d))))
                for x in (k, v))
    sc = add(Op.MATMUL, [q, add(Op.TRANSPOSE, [k], PermAttrs((0, 1, 3, 2)))], MatMulAttrs())
    sc = add(Op.MUL, [sc, rw.const(np.asarray(a.scale, sc.dtype.np), "attn_scale")], NoAttrs())
    if a.softcap:
        cap = rw.const(np.asarray(a.softcap, sc.dtype.np), "attn_softcap")
        sc = add(Op.MUL, [add(Op.TANH, [add(Op.DIV, [sc, cap], NoAttrs())], NoAttrs()), cap], NoAttrs())
    low = np.asarray(np.finfo(np.float32).min, sc.dtype.np)
    for m in mask:
        if m.dtype == DType.BOOL:
            sc = add(Op.WHERE, [m, sc, rw.const(low, "attn_fill")], NoAttrs())
        else:
            sc = add(Op.ADD, [sc, m if m.dtype == sc.dtype else add(Op.CAST, [m], CastAttrs(sc.dtype))], NoAttrs())
    if a.causal:
        keep = np.tril(np.ones((s, t), bool), k=t - s)
        sc = add(Op.ADD, [sc, rw.const(np.where(keep, 0, low).astype(sc.dtype.np), "attn_causal")], NoAttrs())
    p = add(Op.SOFTMAX, [sc], AxisAttrs(3))
    if a.nan_to_zero:
        p = add(Op.WHERE, [add(Op.ISNAN, [p], NoAttrs()), rw.const(np.asarray(0, p.dtype.np), "attn_zero"), p],
                NoAttrs())
    if p.dtype != v.dtype:
        p = add(Op.CAST, [p], CastAttrs(v.dtype))
    add(Op.MATMUL, [p, v], MatMulAttrs(), out=n.outputs[0])
    return new


def _legalize(graph: Graph, options: PassOptions) -> Graph:
    """Unfuse the ATTENTION nodes already in the graph that the kernel cannot take."""
    rw = Rewriter(graph)
    for n in graph.nodes:
        if n.op == Op.ATTENTION and (why := _unsupported(n.inputs[0], n.inputs[1], n.attrs.scale, options)):
            options.decline("attention", n.name or n.outputs[0].name, f"{why}; unfused")
            rw.replace(n, _decompose(rw, n), [])
    return rw.finish() if rw.changed else graph


def run(graph: Graph, options: PassOptions) -> PassResult:
    res = recognize(graph, options, (Op.MATMUL,), _match, {"attention": Op.ATTENTION}, "attention_recognized")
    g = _legalize(res.graph, options)
    if g is not res.graph:
        set_pattern_count(g, "attention", count_ops(g, Op.ATTENTION))
    return PassResult(g, res.changed or g is not res.graph)
