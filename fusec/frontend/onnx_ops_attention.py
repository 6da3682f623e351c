"""ONNX ``Attention`` (opsets 23 to 25), what the torch dynamo exporter and onnxscript emit.

The common form (only ``Y`` used; no sliding window or ``nonpad_kv_seqlen``) becomes one
IR ``ATTENTION`` node (``softcap`` included: ONNX caps the scaled scores before the mask, as the IR does), the op the GPU runs as one kernel: ONNX's causal mask is written as a
constant boolean mask unless it is the IR's own bottom-right form, a float mask and the causal
mask are combined into one additive mask, and ``nan_to_zero`` gives fully masked rows the zeros
ONNX specifies. Everything else is decomposed the way ONNX's function body does it: 3-D inputs
split into heads, Q and K each scaled by sqrt(scale), past K/V concatenated, GQA by repeating KV
heads, softcap, an additive bias (mask, causal, window, padding), a softmax in
``softmax_precision``, rows whose bias is all -inf zeroed, and the optional ``present_key``,
``present_value`` and ``qk_matmul_output`` outputs.
"""

from __future__ import annotations

import math

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_load import np_dtype_of
from fusec.frontend.onnx_ops_data import reshape
from fusec.ops import Op


def _c(x: Sym, v: float | np.ndarray) -> Const:
    return Const(np.asarray(v).astype(np_dtype(x)))


def _heads(cx: NodeCtx, x: Sym, n: int | None, what: str) -> Sym:
    """[B, S, n*D] -> [B, n, S, D]; a 4-D input is already split."""
    if len(x.shape) == 4:
        return x
    if len(x.shape) != 3 or not n or x.shape[2] % n:
        raise cx.fail(f"{what} of shape {list(x.shape)} needs rank 4, or rank 3 with a hidden size divisible by "
                      f"the head count attribute ({n})")
    b, s, h = x.shape
    return cx.emit(Op.TRANSPOSE, reshape(cx, x, (b, s, n, h // n), final=False), perm=(0, 2, 1, 3))


def _repeat_heads(cx: NodeCtx, x: Sym, rep: int) -> Sym:
    """[B, H, T, D] -> [B, H*rep, T, D], each head repeated ``rep`` times in place (h0 h0 h1 h1)."""
    if rep == 1:
        return x
    b, h, t, d = x.shape
    y = cx.emit(Op.EXPAND, reshape(cx, x, (b, h, 1, t, d), final=False), shape=(b, h, rep, t, d))
    return reshape(cx, y, (b, h * rep, t, d), final=False)


def _bool_to_bias(cx: NodeCtx, m: Sym, like: Sym) -> Sym:
    return cx.emit(Op.WHERE, m, _c(like, 0.0), _c(like, -np.inf))


def _frontier_bias(cx: NodeCtx, like: Sym, s: int, t: int, offset: int | Sym, causal: bool,
                   left: int = -1, right: int = -1) -> Sym:
    """0 where query i may read key j, -inf elsewhere: causal ``j <= i + offset`` and/or the sliding
    window ``i + offset - left <= j <= i + offset + right``. ``offset`` is a number or a run-time
    [B] tensor (then the result is [B, 1, S, T])."""
    i = Const(np.arange(s, dtype=np.int64).reshape(s, 1))
    j = Const(np.arange(t, dtype=np.int64).reshape(1, t))
    if isinstance(offset, int):
        pos: Sym = Const(i.array + offset)
    else:
        off = reshape(cx, offset, (offset.shape[0], 1, 1), final=False)
        pos = cx.emit(Op.ADD, i, cx.emit(Op.CAST, off, to=DType.I64) if np_dtype(off) != np.int64 else off)
    allowed: Sym | None = cx.emit(Op.LESS_EQUAL, j, pos) if causal else None
    for bound, sign in ((left, -1), (right, 1)):
        if bound < 0:
            continue
        edge = cx.emit(Op.ADD, pos, Const(np.asarray(sign * bound, np.int64)))
        ok = cx.emit(Op.GREATER_EQUAL if sign < 0 else Op.LESS_EQUAL, j, edge)
        allowed = ok if allowed is None else cx.emit(Op.AND, allowed, ok)
    assert allowed is not None
    bias = _bool_to_bias(cx, allowed, like)
    if len(bias.shape) == 3:
        bias = reshape(cx, bias, (bias.shape[0], 1, s, t), final=False)
    return bias


def _pad_mask(cx: NodeCtx, m: Sym, t: int) -> Sym:
    """A mask shorter than the key length is padded with False / -inf up to it."""
    short = t - m.shape[-1]
    if short < 0:
        raise cx.fail(f"attn_mask's last dim {m.shape[-1]} exceeds the key length {t}")
    if short == 0:
        return m
    fill = False if np_dtype(m) == np.bool_ else -np.inf
    pad = Const(np.full(tuple(m.shape[:-1]) + (short,), fill, dtype=np_dtype(m)))
    return cx.emit(Op.CONCAT, m, pad, axis=len(m.shape) - 1)


def _is_const_false(x: Sym) -> bool:
    return isinstance(x, Const) and not bool(np.asarray(x.array).any())


@handler("Attention")
def _attention(cx: NodeCtx) -> list[Sym | None]:
    q_in, k_in, v_in = cx.x(0), cx.x(1), cx.x(2)
    rank3 = len(q_in.shape) == 3
    qh, kvh = cx.attr("q_num_heads"), cx.attr("kv_num_heads")
    q = _heads(cx, q_in, qh, "Q")
    k = _heads(cx, k_in, kvh, "K")
    v = _heads(cx, v_in, kvh, "V")
    if np_dtype(k) != np_dtype(q) or np_dtype(v) != np_dtype(q):
        raise cx.fail("Q, K and V must have one dtype")
    b, hq, s, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[3] != d or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise cx.fail(f"Q {list(q.shape)}, K {list(k.shape)} and V {list(v.shape)} do not fit one attention")
    past = cx.has(4) or cx.has(5)
    if past and not (cx.has(4) and cx.has(5)):
        raise cx.fail("past_key and past_value must be given together")
    nonpad = cx.x(6) if cx.has(6) else None
    if nonpad is not None and past:
        raise cx.fail("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    past_len = 0
    if past:
        pk, pv = cx.x(4), cx.x(5)
        if len(pk.shape) != 4 or len(pv.shape) != 4:
            raise cx.fail("past_key and past_value must be rank 4")
        past_len = pk.shape[2]
        k = cx.emit(Op.CONCAT, pk, k, axis=2)
        v = cx.emit(Op.CONCAT, pv, v, axis=2)
    present_k, present_v = k, v
    t, hk = k.shape[2], k.shape[1]
    if hq != hk and (hk == 0 or hq % hk):
        raise cx.fail(f"{hq} query heads is not a multiple of {hk} key/value heads")

    scale = cx.attr("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    softcap = float(cx.attr("softcap", 0.0) or 0.0)
    if not math.isfinite(softcap):
        raise cx.fail(f"softcap must be finite, got {softcap}")
    softcap = max(softcap, 0.0)  # ONNX: a cap <= 0 is none
    causal = bool(cx.attr("is_causal", 0))
    mode = int(cx.attr("qk_matmul_output_mode", 0))
    left, right = int(cx.attr("left_window_size", -1)), int(cx.attr("right_window_size", -1))
    precision = cx.attr("softmax_precision")
    mask = _pad_mask(cx, cx.x(3), t) if cx.has(3) else None
    if mask is not None and np_dtype(mask) != np.bool_ and np_dtype(mask) != np_dtype(q):
        mask = cx.emit(Op.CAST, mask, to=DType.from_np(np_dtype(q)))

    qk_out: Sym | None = None
    if not (cx.used(1) or cx.used(2) or cx.used(3)) and left < 0 and right < 0 and nonpad is None \
            and precision in (None, 1) and np_dtype(q) != np.float64:
        y = _fused(cx, q, k, v, mask, causal, past_len, scale, softcap, final=not rank3)
    else:
        y, qk_out = _decomposed(cx, q, k, v, mask, causal, past_len, scale, softcap, mode, (left, right), nonpad,
                                precision, final=not rank3)
    if rank3:  # back to [B, S, H*Dv]
        y = cx.emit(Op.TRANSPOSE, y, perm=(0, 2, 1, 3))
        y = reshape(cx, y, (b, s, y.shape[2] * y.shape[3]), name=cx.node.output[0])
    return [y, present_k if cx.used(1) else None, present_v if cx.used(2) else None, qk_out if cx.used(3) else None]


def _fused(cx: NodeCtx, q: Sym, k: Sym, v: Sym, mask: Sym | None, causal: bool, past_len: int, scale: float,
           softcap: float, final: bool) -> Sym:
    """One IR ATTENTION node: the causal frontier j <= i + past_len is the IR's own (bottom-right,
    offset T - S) when past_len == T - S, else a constant boolean mask."""
    s, t = q.shape[2], k.shape[2]
    ir_causal = causal and past_len == t - s
    if causal and not ir_causal:
        allowed = Const(np.arange(t)[None, :] <= np.arange(s)[:, None] + past_len)
        if mask is None:
            mask = allowed
        elif np_dtype(mask) == np.bool_:
            mask = cx.emit(Op.AND, mask, allowed)
        else:
            mask = cx.emit(Op.ADD, mask, _bool_to_bias(cx, allowed, q))
    ins = [q, k, v] + ([mask] if mask is not None else [])
    rank_fix = mask is not None and len(mask.shape) < 4
    if rank_fix:  # the IR's mask broadcasts like numpy: leading 1s are implied, written out here
        ins[3] = reshape(cx, mask, (1,) * (4 - len(mask.shape)) + tuple(mask.shape), final=False)
    return cx.emit(Op.ATTENTION, *ins, final=final, scale=scale, causal=ir_causal, nan_to_zero=True, softcap=softcap)


def _decomposed(cx: NodeCtx, q: Sym, k: Sym, v: Sym, mask: Sym | None, causal: bool, past_len: int, scale: float,
                softcap: float, mode: int, window: tuple[int, int], nonpad: Sym | None,
                precision: int | None, final: bool) -> tuple[Sym, Sym]:
    s, t, hq, hk = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    left, right = window
    # the bias: mask, causal frontier, sliding window, key padding (ONNX's order; -inf = masked)
    offset: int | Sym = past_len
    if nonpad is not None:
        offset = cx.emit(Op.SUB, nonpad, Const(np.asarray(s, np_dtype(nonpad))))
    bias: Sym = Const(np.zeros((s, t), np_dtype(q)))
    if mask is not None and np_dtype(mask) == np.bool_:
        mask = _bool_to_bias(cx, mask, q)
    if causal:
        base = bias if mask is None else mask
        if left >= 0 or right >= 0:
            base = cx.emit(Op.ADD, bias, base)
        bias = cx.emit(Op.ADD, base, _frontier_bias(cx, q, s, t, offset, True))
    elif mask is not None:
        bias = cx.emit(Op.ADD, bias, mask)
    if left >= 0 or right >= 0:
        bias = cx.emit(Op.ADD, Const(np.zeros((s, t), np_dtype(q))), bias)
        bias = cx.emit(Op.ADD, bias, _frontier_bias(cx, q, s, t, offset, False, left, right))
    if nonpad is not None:
        keep = cx.emit(Op.LESS, Const(np.arange(t, dtype=np.int64)),
                       reshape(cx, cx.emit(Op.CAST, nonpad, to=DType.I64) if np_dtype(nonpad) != np.int64 else nonpad,
                               (nonpad.shape[0], 1), final=False))
        bias = cx.emit(Op.ADD, bias, reshape(cx, _bool_to_bias(cx, keep, q), (nonpad.shape[0], 1, 1, t), final=False))

    rep = hq // hk
    k, v = _repeat_heads(cx, k, rep), _repeat_heads(cx, v, rep)
    half = np.asarray(math.sqrt(scale)).astype(np_dtype(q))
    qs = cx.emit(Op.MUL, q, Const(half))
    ks = cx.emit(Op.MUL, k, Const(half))
    qk = cx.emit(Op.MATMUL, qs, cx.emit(Op.TRANSPOSE, ks, perm=(0, 1, 3, 2)))
    if softcap > 0:
        qk = cx.emit(Op.MUL, cx.emit(Op.TANH, cx.emit(Op.DIV, qk, _c(qk, softcap))), _c(qk, softcap))
    all_zero = isinstance(bias, Const) and not np.asarray(bias.array).any()
    with_bias = qk if all_zero else cx.emit(Op.ADD, qk, bias)
    qk_out = with_bias if mode == 2 else qk
    sm_in = with_bias
    if precision is not None and np_dtype_of(int(precision)) != np_dtype(q):
        try:
            sm_in = cx.emit(Op.CAST, sm_in, to=DType.from_np(np_dtype_of(int(precision))))
        except ValueError:
            raise cx.fail(f"softmax_precision {np_dtype_of(int(precision))} is not supported") from None
    p = cx.emit(Op.SOFTMAX, sm_in, axis=3)
    # rows whose bias is -inf everywhere attend to nothing: ONNX makes them 0 (not NaN)
    dead = cx.emit(Op.ISINF, cx.emit(Op.REDUCE_MAX, bias, axes=(len(bias.shape) - 1,), keepdims=True),
                   detect_positive=False, detect_negative=True)
    if not _is_const_false(dead):
        p = cx.emit(Op.WHERE, dead, _c(p, 0.0), p)
    if np_dtype(p) != np_dtype(q):
        p = cx.emit(Op.CAST, p, to=DType.from_np(np_dtype(q)))
    if mode == 3:
        qk_out = p
    y = cx.emit(Op.MATMUL, p, v, final=final)
    return y, qk_out


def _step(cx: NodeCtx, x: Sym, i: int) -> Sym:
    """x[:, :, i:i+1, :] of a [B, H, T, D] tensor."""
    return cx.emit(Op.SLICE, x, axes=(2,), starts=(i,), ends=(i + 1,), steps=(1,))


MAX_LINEAR_ATTENTION_STEPS = 512  # the recurrence is unrolled: one group of nodes per token


@handler("LinearAttention")
def _linear_attention(cx: NodeCtx) -> list[Sym | None]:
    """The recurrence of ONNX LinearAttention (opset 27), unrolled over the static sequence length,
    in fp32: S = exp(g_t) S (gated); v_t = beta_t (v_t - S^T k_t) (delta); S += k_t v_t^T;
    o_t = scale q_t^T S (each KV head's state read by its group of query heads)."""
    rule = str(cx.attr("update_rule", "gated_delta"))
    qh, kvh = int(cx.attr("q_num_heads", 0) or 0), int(cx.attr("kv_num_heads", 0) or 0)
    if rule not in ("linear", "gated", "delta", "gated_delta") or qh <= 0 or kvh <= 0 or qh % kvh:
        raise cx.fail(f"update_rule {rule!r} with q_num_heads {qh} and kv_num_heads {kvh} is not valid")
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if gating != cx.has(4) or delta != cx.has(5):
        raise cx.fail(f"update_rule {rule!r} takes decay: {gating}, beta: {delta}")
    f32 = np.dtype(np.float32)
    out_dt = np_dtype(cx.x(0))

    def f(x: Sym) -> Sym:
        return x if np_dtype(x) == f32 else cx.emit(Op.CAST, x, to=DType.F32)

    q, k, v = (f(_heads(cx, cx.x(i), n, w)) for i, n, w in ((0, qh, "query"), (1, kvh, "key"), (2, kvh, "value")))
    b, _, t, dk = q.shape
    dv = v.shape[3]
    if len(cx.x(0).shape) != 3 or k.shape[3] != dk or t > MAX_LINEAR_ATTENTION_STEPS:
        raise cx.fail(f"query/key/value must be [B, T, H*D] with one head size and T <= "
                      f"{MAX_LINEAR_ATTENTION_STEPS}, got {list(cx.x(0).shape)}, {list(cx.x(1).shape)}")
    gate = beta = None
    if gating:
        g = f(cx.x(4))
        if g.shape[-1] == kvh:
            g = cx.emit(Op.TRANSPOSE, reshape(cx, g, (b, t, kvh, 1), final=False), perm=(0, 2, 1, 3))
        else:
            g = _heads(cx, g, kvh, "decay")
        gate = cx.emit(Op.EXP, g)  # [B, Hkv, T, 1 or dk]
    if delta:
        bt = f(cx.x(5))
        if len(bt.shape) != 3 or bt.shape[-1] not in (kvh, 1):
            raise cx.fail(f"beta of shape {list(bt.shape)} must be [B, T, kv_num_heads or 1]")
        beta = cx.emit(Op.TRANSPOSE, reshape(cx, bt, (b, t, bt.shape[-1], 1), final=False), perm=(0, 2, 1, 3))
    state_dt = np_dtype(cx.x(3)) if cx.has(3) else out_dt
    state: Sym = f(cx.x(3)) if cx.has(3) else Const(np.zeros((b, kvh, dk, dv), np.float32))
    if tuple(state.shape) != (b, kvh, dk, dv):
        raise cx.fail(f"past_state of shape {list(state.shape)} must be [{b}, {kvh}, {dk}, {dv}]")
    scale = float(cx.attr("scale", 0.0) or 0.0) or 1.0 / math.sqrt(dk)
    outs = []
    for i in range(t):
        k_t, v_t = _step(cx, k, i), _step(cx, v, i)
        if gate is not None:  # decay over d_k: [B, H, 1, X] -> [B, H, X, 1], broadcast over d_v
            state = cx.emit(Op.MUL, state, cx.emit(Op.TRANSPOSE, _step(cx, gate, i), perm=(0, 1, 3, 2)))
        if beta is not None:
            v_t = cx.emit(Op.MUL, _step(cx, beta, i), cx.emit(Op.SUB, v_t, cx.emit(Op.MATMUL, k_t, state)))
        state = cx.emit(Op.ADD, state, cx.emit(Op.MATMUL, cx.emit(Op.TRANSPOSE, k_t, perm=(0, 1, 3, 2)), v_t))
        read = _repeat_heads(cx, state, qh // kvh)
        outs.append(cx.emit(Op.MUL, cx.emit(Op.MATMUL, _step(cx, q, i), read), Const(np.float32(scale))))
    y = outs[0] if len(outs) == 1 else cx.emit(Op.CONCAT, *outs, axis=2)
    y = reshape(cx, cx.emit(Op.TRANSPOSE, y, perm=(0, 2, 1, 3)), (b, t, qh * dv), final=False)
    y = y if out_dt == f32 else cx.emit(Op.CAST, y, to=DType.from_np(out_dt))
    if cx.used(1) and state_dt != f32:
        state = cx.emit(Op.CAST, state, to=DType.from_np(state_dt))
    return [y, state if cx.used(1) else None]
