"""Numpy definitions of the reference's model-level ops: the norms, the packed-weight product and gather
(``fusec.quant`` dequantizes exactly as each format defines), attention, RoPE, the KV cache's write, decode attention
over the cache, and sampling; ``fusec.reference.IMPL`` maps the ops to them. High-level ops compute in fp32 (fp64
stays fp64, for gradient checks) and return the dtype the kernels store."""

from __future__ import annotations

import numpy as np

from fusec import ops as O
from fusec import reference_ops as RO


def layernorm(a: O.LayerNormAttrs, x: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    axes = tuple(range(a.axis, x.ndim))
    mean = np.mean(x, axis=axes, keepdims=True)
    var = np.mean(np.square(x - mean), axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + np.float32(a.eps)) * scale
    return y if bias is None else y + bias


def rmsnorm(a: O.RMSNormAttrs, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    wide = RO.wide(x)
    xf = x.astype(wide)
    ms = np.mean(np.square(xf), axis=-1, keepdims=True)
    y = (xf / np.sqrt(ms + np.float32(a.eps))).astype(x.dtype)  # HF: normalize, cast back, then scale
    out = (w.astype(wide) + np.float32(a.weight_offset)) * y.astype(wide)
    return out.astype(w.dtype)


def qmatmul(a: O.QMatMulAttrs, x: np.ndarray, *packed: np.ndarray) -> np.ndarray:
    """x @ W^T with W dequantized exactly as its format defines (fusec.quant), a block of rows at a
    time: a packed weight is never expanded to fp32 whole."""
    from fusec import quant

    y = quant.matmul(x.astype(np.float32, copy=False), quant.get_format(a.format), a.k, a.group, packed)
    return y.astype(x.dtype, copy=False)


def qgather(a: O.QGatherAttrs, ids: np.ndarray, *packed: np.ndarray) -> np.ndarray:
    from fusec import quant

    idx = RO._checked_index(ids.reshape(-1), a.n, "qgather")
    w = quant.dequantize(quant.get_format(a.format), a.k, a.group, [p[idx] for p in packed])
    return w.reshape(*ids.shape, a.k).astype(a.out_dtype.np)


def attention(a: O.AttentionAttrs, q: np.ndarray, k: np.ndarray, v: np.ndarray,
               mask: np.ndarray | None = None) -> np.ndarray:
    out_dt = v.dtype
    wide = RO.wide(q)
    q, k, v = (x.astype(wide) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # q head h reads kv head h // rep
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.float32(a.scale)
    if a.softcap:
        s = np.float32(a.softcap) * np.tanh(s / np.float32(a.softcap))
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == np.bool_ else s + mask.astype(wide)
    if a.causal:
        qlen, klen = s.shape[-2:]
        s = np.where(np.tril(np.ones((qlen, klen), bool), k=klen - qlen), s, -np.inf)
    p = RO.softmax(O.AxisAttrs(3), s.astype(wide))
    if a.nan_to_zero:
        p = np.where(np.isnan(p), np.float32(0), p)
    return np.matmul(p, v).astype(out_dt)


def rope(a: O.RopeAttrs, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    rd, half = a.rotary_dim, a.rotary_dim // 2
    xr = x[..., :rd]
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    y = xr * cos + rot * sin
    return np.concatenate([y, x[..., rd:]], axis=-1)


def cache_write(a: O.CacheWriteAttrs, cache: np.ndarray, new: np.ndarray, pos: np.ndarray,
                 rows: np.ndarray | None = None) -> np.ndarray:
    out = np.array(cache, copy=True)  # functional here; in place on the GPU (the output is the cache's storage)
    length = cache.shape[a.axis]
    for i in range(new.shape[0]):
        b = i if rows is None else int(rows[i])
        if not 0 <= b < cache.shape[0]:
            continue  # a destination outside the cache: dropped, as on the GPU
        start = int(pos[i])
        n = max(0, min(new.shape[a.axis], length - start))
        if n:
            dst = out[b].swapaxes(0, a.axis - 1)
            dst[start:start + n] = new[i].swapaxes(0, a.axis - 1)[:n]
    return out


def kv_attention(a: O.KVAttentionAttrs, q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> np.ndarray:
    bsz, _, slen, _ = q.shape
    total = k.shape[2]
    keys = np.arange(total)[None, :]
    last = np.asarray(pos).reshape(bsz, 1, 1, 1) + np.arange(slen).reshape(1, 1, slen, 1)  # each query's position
    allowed = keys <= last
    if a.window:
        allowed = allowed & (keys > last - a.window)
    return attention(O.AttentionAttrs(a.scale, nan_to_zero=True, softcap=a.softcap), q, k, v, allowed)


def sample(a: O.NoAttrs, logits: np.ndarray, seed: np.ndarray, counter: np.ndarray, temperature: np.ndarray,
            top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    from fusec.sampling import sample

    return sample(logits, seed, counter, temperature, top_k, top_p)
