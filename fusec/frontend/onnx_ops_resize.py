"""ONNX Resize with import-time scales/sizes (opsets 13 to 19), on IR ops.

Resize is separable: along each resized axis every output element is a fixed weighted sum of
input elements, so the axis is resized by a product with a constant [in, out] weight matrix
(nearest mode: a GATHER of the chosen indices, any dtype). The weights follow ONNX's definition:
the output coordinate mapped back by ``coordinate_transformation_mode``, the taps nearest to it
(edge-clamped), their coefficients from the mode (nearest rounding, linear, cubic with
``cubic_coeff_a``; ``antialias`` widens the linear/cubic kernel when downsampling), renormalized
over in-range taps with ``exclude_outside``; tf_crop_and_resize writes ``extrapolation_value``
where the mapped coordinate falls outside the input.
"""

from __future__ import annotations

import math

import numpy as np

from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.frontend.onnx_ops_act import is_float
from fusec.ops import Op

_COORD_MODES = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
                "tf_crop_and_resize")


def _source_coords(mode: str, n_in: int, n_out: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    y = np.arange(n_out, dtype=np.float64)
    out_w = scale * n_in
    if mode == "align_corners":
        return np.zeros(n_out) if out_w == 1 else y * (n_in - 1) / (out_w - 1)
    if mode == "asymmetric":
        return y / scale
    if mode == "tf_crop_and_resize":
        lo, hi = roi
        x = np.full(n_out, (hi - lo) * (n_in - 1) / 2) if out_w == 1 else y * (hi - lo) * (n_in - 1) / (out_w - 1)
        return x + lo * (n_in - 1)
    if mode == "pytorch_half_pixel":
        return np.full(n_out, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        return n_in / 2 * (1 - n_out / out_w) + (y + 0.5) / scale - 0.5
    return (y + 0.5) / scale - 0.5  # half_pixel


def _coeffs(cx: NodeCtx, ratio: float, scale: float) -> np.ndarray:
    mode = str(cx.attr("mode", "nearest"))
    anti = bool(cx.attr("antialias", 0))
    if mode == "nearest":
        how = str(cx.attr("nearest_mode", "round_prefer_floor"))
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        pick = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5, "floor": False,
                "ceil": True}.get(how)
        if pick is None:
            raise cx.fail(f"nearest_mode {how!r} is not one of round_prefer_floor, round_prefer_ceil, floor, ceil")
        return np.array([0.0, 1.0]) if pick else np.array([1.0, 0.0])
    if mode == "linear":
        if not anti:
            return np.array([1.0 - ratio, ratio])
        s = min(scale, 1.0)
        start = math.floor(-1 / s) + 1
        w = np.clip(1 - np.abs((np.arange(start, 2 - start) - ratio) * s), 0, 1)
        return w / w.sum()
    if mode == "cubic":
        a = float(cx.attr("cubic_coeff_a", -0.75))

        def k(t: np.ndarray) -> np.ndarray:
            t = np.abs(t)
            return np.where(t <= 1, ((a + 2) * t - (a + 3)) * t * t + 1,
                            np.where(t < 2, ((a * t - 5 * a) * t + 8 * a) * t - 4 * a, 0.0))

        if not anti:
            return k(np.array([ratio + 1, ratio, 1 - ratio, 2 - ratio]))
        s = min(scale, 1.0)
        start = math.floor(-2 / s) + 1
        w = k((np.arange(start, 2 - start) - ratio) * s)
        return w / w.sum()
    raise cx.fail(f"mode {mode!r} is not one of nearest, linear, cubic")


def _weights(cx: NodeCtx, n_in: int, n_out: int, scale: float,
             roi: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """The [n_in, n_out] weight matrix of one axis, and the outputs mapped outside the input
    (tf_crop_and_resize's extrapolated positions)."""
    mode = str(cx.attr("coordinate_transformation_mode", "half_pixel"))
    if mode not in _COORD_MODES:
        raise cx.fail(f"coordinate_transformation_mode {mode!r} is not supported")
    x = _source_coords(mode, n_in, n_out, scale, roi)
    outside = (x < 0) | (x > n_in - 1) if mode == "tf_crop_and_resize" else np.zeros(n_out, bool)
    m = np.zeros((n_in, n_out))
    for o, xo in enumerate(x):
        base = math.floor(xo)
        ratio = 1.0 if xo == base else xo - base
        c = np.asarray(_coeffs(cx, ratio, scale), np.float64)
        n = len(c)
        # the n taps nearest xo, ties to the lower index (ONNX's neighbour rule)
        pad = math.ceil(n / 2)
        frac = (xo + pad) - math.floor(xo + pad)
        if n % 2 == 0:
            first = math.floor(xo + pad) + (-(n // 2) if frac == 0 else -(n // 2) + 1) - pad
        else:
            first = math.floor(xo + pad) + (-((n - 1) // 2) + (0 if frac <= 0.5 else 1)) - pad
        taps = np.arange(first, first + n)
        if cx.attr("exclude_outside", 0):
            c = np.where((taps < 0) | (taps >= n_in), 0.0, c)
            c = c / (c.sum() or 1.0)
        for t, w in zip(np.clip(taps, 0, n_in - 1), c):
            m[t, o] += w
    m[:, outside] = 0.0
    return m, outside


def _sizes(cx: NodeCtx, x: Sym) -> tuple[list[int], list[float], list[int], np.ndarray | None]:
    """(axes, scale per axis, output size per axis, roi [starts..., ends...] or None)."""
    rank = len(x.shape)
    axes = [cx.axis(int(a), rank) for a in (cx.attr("axes") or range(rank))]
    roi = cx.const(1) if cx.has(1) else None
    roi = None if roi is None or np.asarray(roi).size == 0 else np.asarray(roi, np.float64).reshape(-1)
    scales = cx.const(2) if cx.has(2) else None
    scales = None if scales is None or np.asarray(scales).size == 0 else np.asarray(scales, np.float64).reshape(-1)
    sizes = cx.ints(3) if cx.has(3) else None
    ins = [x.shape[a] for a in axes]
    if (scales is None) == (not sizes):
        raise cx.fail("exactly one of scales and sizes must be given")
    if scales is not None:
        if len(scales) != len(axes) or (scales <= 0).any():
            raise cx.fail(f"scales {scales.tolist()} do not fit axes {axes}")
        return axes, scales.tolist(), [int(s * n) for s, n in zip(scales, ins)], roi
    assert sizes is not None
    if len(sizes) != len(axes) or min(sizes) < 1:
        raise cx.fail(f"sizes {sizes} do not fit axes {axes}")
    sc = [o / n for o, n in zip(sizes, ins)]
    policy = str(cx.attr("keep_aspect_ratio_policy", "stretch"))
    if policy in ("not_larger", "not_smaller"):
        s = min(sc) if policy == "not_larger" else max(sc)
        return axes, [s] * len(axes), [int(s * n + 0.5) for n in ins], roi
    if policy != "stretch":
        raise cx.fail(f"keep_aspect_ratio_policy {policy!r} is not supported")
    return axes, sc, list(sizes), roi


@handler("Resize")
def _resize(cx: NodeCtx) -> list[Sym | None]:
    x = cx.x(0)
    rank = len(x.shape)
    axes, scales, outs, roi = _sizes(cx, x)
    mode = str(cx.attr("mode", "nearest"))
    if mode != "nearest" and not is_float(np_dtype(x)):
        raise cx.fail(f"{mode} resize of a {np_dtype(x)} tensor is not supported (floating point only)")
    cx.em.check_size([outs[axes.index(i)] if i in axes else d for i, d in enumerate(x.shape)],
                     f"node {cx.node.name!r} (Resize)", np_dtype(x).itemsize)
    y, dead = x, None
    for a, s, n_out in zip(axes, scales, outs):
        n_in = x.shape[a]
        span = (float(roi[a if len(roi) == 2 * rank else axes.index(a)]),
                float(roi[(rank + a) if len(roi) == 2 * rank else len(axes) + axes.index(a)])) if roi is not None \
            else (0.0, 1.0)
        if n_in == n_out and math.isclose(s, 1.0) and span == (0.0, 1.0):
            continue
        m, outside = _weights(cx, n_in, n_out, s, span)
        if outside.any():
            shape = tuple(n_out if i == a else 1 for i in range(rank))
            mask = outside.reshape(shape)
            dead = mask if dead is None else (dead | mask)
        if mode == "nearest":
            y = cx.emit(Op.GATHER, y, Const(m.argmax(axis=0).astype(np.int64)), axis=a)
            continue
        last = (a == rank - 1)
        perm = tuple(i for i in range(rank) if i != a) + (a,)
        inv = tuple(int(p) for p in np.argsort(perm))
        t = y if last else cx.emit(Op.TRANSPOSE, y, perm=perm)
        t = cx.emit(Op.MATMUL, t, Const(m.astype(np_dtype(x))))
        y = t if last else cx.emit(Op.TRANSPOSE, t, perm=inv)
    if dead is not None:
        fill = Const(np.asarray(float(cx.attr("extrapolation_value", 0.0))).astype(np_dtype(x)))
        y = cx.emit(Op.WHERE, Const(dead), fill, y)
    return [y]
