"""Numpy definitions of the training ops (``fusec.ops_train``): scatter_add, cross_entropy, adamw,
init, and the learning-rate schedule. The CUDA kernels follow the same arithmetic step by step
(fp32, the same order of operations), so a plan's training step matches this one to rounding."""

from __future__ import annotations

import math

import numpy as np

from fusec.errors import InputError
from fusec import reference_ops as RO
from fusec.ops_train import (
    AdamWAttrs,
    CrossEntropyAttrs,
    InitAttrs,
    LayerNormGradAttrs,
    ScatterAddAttrs,
    SoftmaxGradAttrs,
)
from fusec.sampling import GOLDEN, TOKEN_MUL, mix64

_M64 = (1 << 64) - 1
INIT_SALT = 0x5851F42D4C957F2D  # keeps init's stream apart from sampling's for one seed


def _indices(idx: np.ndarray, size: int, what: str) -> np.ndarray:
    if idx.size and (idx.min() < -size or idx.max() >= size):
        raise InputError(f"{what}: index out of range [{-size}, {size}) (min {idx.min()}, max {idx.max()})")
    return np.where(idx < 0, idx + size, idx).astype(np.int64)


def scatter_add(a: ScatterAddAttrs, upd: np.ndarray, idx: np.ndarray) -> np.ndarray:
    pre = upd.shape[:a.axis]
    post = upd.shape[a.axis + idx.ndim:]
    n_pre, n_post = math.prod(pre), math.prod(post)
    wide = RO.wide(upd)
    out = np.zeros((n_pre, a.size, n_post), wide)
    flat = _indices(idx.reshape(-1), a.size, "scatter_add")
    np.add.at(out, (slice(None), flat), upd.reshape(n_pre, flat.size, n_post).astype(wide))
    return out.reshape(pre + (a.size,) + post).astype(upd.dtype)


def _labels(a: CrossEntropyAttrs, classes: int, labels: np.ndarray, what: str) -> np.ndarray:
    """Where the labels count (not the ignore index); InputError for one out of [0, classes)."""
    keep = labels != a.ignore_index
    bad = keep & ((labels < 0) | (labels >= classes))
    if bad.any():
        raise InputError(f"{what}: label {int(labels[bad].reshape(-1)[0])} is out of range [0, {classes}) "
                         f"(and not the ignore index {a.ignore_index})")
    return keep


def cross_entropy(a: CrossEntropyAttrs, x: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """loss[r] = logsumexp(x[r]) - x[r, labels[r]]; 0 where labels[r] == ignore_index."""
    keep = _labels(a, x.shape[-1], labels, "cross_entropy")
    xw = x.astype(RO.wide(x))
    m = np.max(xw, axis=-1, keepdims=True)
    lse = np.log(np.sum(np.exp(xw - m), axis=-1)) + m[..., 0]
    picked = np.take_along_axis(xw, np.where(keep, labels, 0)[..., None].astype(np.int64), axis=-1)[..., 0]
    return np.where(keep, lse - picked, 0).astype(x.dtype)


def softmax_grad(a: SoftmaxGradAttrs, p: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """scale * p * (dp - sum(dp * p)) along the axis, in fp32 (fp64 stays fp64)."""
    w = RO.wide(p)
    pw, dw = p.astype(w), dp.astype(w)
    s = np.sum(dw * pw, axis=a.axis, keepdims=True)
    return (w.type(a.scale) * (pw * (dw - s))).astype(p.dtype)


def layernorm_grad(a: LayerNormGradAttrs, x: np.ndarray, scale: np.ndarray, dy: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(dx, dy * xhat): dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * scale."""
    w = RO.wide(x)
    axes = tuple(range(a.axis, x.ndim))
    xw, dw = x.astype(w), dy.astype(w)
    sw = scale.astype(w).reshape(x.shape[a.axis:])
    mean = np.mean(xw, axis=axes, keepdims=True)
    xc = xw - mean
    rstd = 1 / np.sqrt(np.mean(xc * xc, axis=axes, keepdims=True) + w.type(a.eps))
    xhat = xc * rstd
    g = dw * sw
    dx = rstd * (g - (np.mean(g, axis=axes, keepdims=True) + xhat * np.mean(g * xhat, axis=axes, keepdims=True)))
    return dx.astype(x.dtype), (dw * xhat).astype(x.dtype)


def cross_entropy_grad(a: CrossEntropyAttrs, x: np.ndarray, labels: np.ndarray, dloss: np.ndarray) -> np.ndarray:
    """(softmax(x) - onehot(label)) * dloss per row; 0 on rows whose label is the ignore index."""
    keep = _labels(a, x.shape[-1], labels, "cross_entropy_grad")
    w = RO.wide(x)
    xw = x.astype(w)
    e = np.exp(xw - np.max(xw, axis=-1, keepdims=True))
    p = e / np.sum(e, axis=-1, keepdims=True)
    onehot = (np.arange(x.shape[-1]) == np.where(keep, labels, -1)[..., None]).astype(w)
    g = np.where(keep, dloss.astype(w), 0)[..., None]
    return ((p - onehot) * g).astype(x.dtype)


def lr_factor(a: AdamWAttrs, t: int) -> float:
    """The schedule's multiplier of ``a.lr`` at step ``t`` (1-based), in double precision."""
    if a.warmup_steps and t <= a.warmup_steps:
        return t / a.warmup_steps
    if a.schedule == "constant":
        return 1.0
    span = a.total_steps - a.warmup_steps
    if a.schedule == "linear":
        return max(0.0, (a.total_steps - t) / span)
    progress = min(1.0, (t - a.warmup_steps) / span)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def step_scalars(a: AdamWAttrs, t: int) -> tuple[np.float32, np.float32, np.float32, np.float32]:
    """(step size lr_t / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr_t * weight_decay, lr_t) as fp32,
    computed in double precision first (the kernel does the same)."""
    lr_t = a.lr * lr_factor(a, t)
    bc1 = 1.0 - a.beta1 ** t
    bc2 = 1.0 - a.beta2 ** t
    return (np.float32(lr_t / bc1), np.float32(math.sqrt(bc2)), np.float32(1.0 - lr_t * a.weight_decay),
            np.float32(lr_t))


def clip_coef(a: AdamWAttrs, grads: list[np.ndarray]) -> np.float32:
    """min(1, max_grad_norm / (||g|| + 1e-6)) over all gradients together (1 without clipping)."""
    if a.max_grad_norm <= 0:
        return np.float32(1.0)
    sq = sum(float(np.sum(np.square(g.astype(np.float64)))) for g in grads)
    norm = np.float32(math.sqrt(sq))
    return np.float32(min(np.float32(1.0), np.float32(a.max_grad_norm) / (norm + np.float32(1e-6))))


def adamw(a: AdamWAttrs, p: np.ndarray, m: np.ndarray, v: np.ndarray, step: np.ndarray,
          *grads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    dt = p.dtype.type
    t = int(step.reshape(-1)[0]) + 1
    step_size, bc2_sqrt, decay_mult, _ = step_scalars(a, t)
    gs = [g.astype(p.dtype).reshape(-1) for g in grads]
    coef = dt(clip_coef(a, gs))
    b1, b2, eps = dt(a.beta1), dt(a.beta2), dt(a.eps)
    omb1, omb2 = dt(1.0 - a.beta1), dt(1.0 - a.beta2)  # 1 - beta in double, then rounded (as torch)
    p, m, v = p.copy(), m.copy(), v.copy()  # functional here; in place on the GPU
    off = 0
    for g, decay in zip(gs, a.decay):
        sl = slice(off, off + g.size)
        off += g.size
        if a.max_grad_norm > 0:
            g = g * coef
        m[sl] = b1 * m[sl] + omb1 * g
        v[sl] = b2 * v[sl] + omb2 * (g * g)
        if decay:
            p[sl] = p[sl] * dt(decay_mult)
        denom = np.sqrt(v[sl]) / dt(bc2_sqrt) + eps
        p[sl] = p[sl] - dt(step_size) * (m[sl] / denom)
    return p, m, v, np.array([t], np.int64)


def uniform_bits(seed: int, start: int, n: int) -> np.ndarray:
    """23-bit integers k[i] for elements start..start+n-1: mix64(key ^ (i * TOKEN_MUL + 1)) >> 41,
    key = mix64(seed + GOLDEN + INIT_SALT) (all mod 2^64)."""
    with np.errstate(over="ignore"):
        key = mix64(np.array([(int(seed) + GOLDEN + INIT_SALT) & _M64], np.uint64))[0]
        i = np.arange(start, start + n, dtype=np.uint64)
        h = mix64((i * np.uint64(TOKEN_MUL) + np.uint64(1)) ^ key)
    return (h >> np.uint64(41)).astype(np.int64)


def init(a: InitAttrs, seed: np.ndarray) -> np.ndarray:
    """Segments end to end: zeros, ones, or bound * ((2k + 1 - 2^23) * 2^-23), k = uniform_bits
    (each step exact in fp32 but the last, one rounded product: the same on every backend)."""
    out = np.zeros(a.numel, a.dtype.np)
    s = int(np.asarray(seed).reshape(-1)[0])
    off = 0
    for n, kind, bound in a.segments:
        if kind == "ones":
            out[off:off + n] = 1
        elif kind == "uniform":
            k = uniform_bits(s, off, n)
            r = (2 * k + 1 - (1 << 23)).astype(np.float32) * np.float32(2.0 ** -23)
            out[off:off + n] = (np.float32(bound) * r).astype(a.dtype.np)
        off += n
    return out
