"""ONNX op handlers: convolutions, lowered onto existing IR ops (no conv op in the IR).

- ``Conv`` whose kernel (larger than 1x1) equals its stride (a ViT/CLIP patch embedding), without
  padding, dilation or groups: the input is cut into non-overlapping patches by a reshape and one
  transpose, and the conv is one GEMM ``[N*P, C*K] @ W^T [C*K, M]`` (the weight is the GEMM's B,
  as an ``nn.Linear``'s would be), then a transpose back to channels-first (which cancels with the
  flatten + transpose to [N, P, M] that the vision towers apply next).
- any other ``Conv`` (Whisper's Conv1d k=3, stride 1 and 2, padding 1; any rank, strides,
  dilations, padding, ``auto_pad``, groups): im2col by one GATHER with a constant index table over
  the flattened spatial axis (padded taps read one zero element appended to it), then one GEMM
  ``W [M, C*K] @ cols [N, C*K, P]`` whose result is already channels-first (groups: a batch of
  ``group`` GEMMs; a 1x1, stride-1 conv: that GEMM on x as it is).
- ``ConvTranspose``: the same table, each (tap, output) pointing at the one input it reads;
  ``CausalConvWithState`` (depthwise, causal): shifted slices times the per-channel taps.
- the window geometry and the gathered windows serve ``onnx_ops_pool.py`` too.

What has no cheap form here is refused with the node and the attribute named.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from fusec.dtypes import DType
from fusec.frontend.emit import Const, Sym, np_dtype
from fusec.frontend.onnx_ctx import NodeCtx, handler
from fusec.ops import Op

_MAX_INDEX_ELEMS = 1 << 26  # the constant im2col table: refuse a conv whose table would pass this


def reshape_to(cx: NodeCtx, x: Sym, shape: tuple[int, ...], final: bool = False) -> Sym:
    if tuple(x.shape) == tuple(shape):
        return x
    return cx.emit(Op.RESHAPE, x, final=final, shape=tuple(int(d) for d in shape))


class Window:
    """A sliding window's geometry over the spatial axes: kernel, strides, dilations, pads (begin,
    end per axis, after auto_pad), ceil_mode, and the output's spatial shape."""

    def __init__(self, cx: NodeCtx, spatial: tuple[int, ...], kernel: list[int], ceil_mode: bool = False):
        r = len(spatial)
        if len(kernel) != r or any(k < 1 for k in kernel):
            raise cx.fail(f"kernel_shape {list(kernel)} does not fit the {r} spatial axes of the input")
        self.spatial, self.kernel = tuple(spatial), tuple(int(k) for k in kernel)
        self.strides = tuple(int(s) for s in (cx.attr("strides") or [1] * r))
        self.dilations = tuple(int(d) for d in (cx.attr("dilations") or [1] * r))
        for name, v in (("strides", self.strides), ("dilations", self.dilations)):
            if len(v) != r or any(s < 1 for s in v):
                raise cx.fail(f"attribute {name}={list(v)} must hold {r} positive values")
        span = [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations)]
        auto = cx.attr("auto_pad", "NOTSET") or "NOTSET"
        if auto in ("NOTSET", ""):
            pads = [int(p) for p in (cx.attr("pads") or [0] * (2 * r))]
            if len(pads) != 2 * r or any(p < 0 for p in pads):
                raise cx.fail(f"attribute pads={pads} must hold {2 * r} non-negative values")
            self.begin, self.end = tuple(pads[:r]), tuple(pads[r:])
        elif auto == "VALID":
            self.begin = self.end = (0,) * r
        elif auto in ("SAME_UPPER", "SAME_LOWER"):
            out = [-(-n // s) for n, s in zip(spatial, self.strides)]
            total = [max(0, (o - 1) * s + sp - n) for o, s, sp, n in zip(out, self.strides, span, spatial)]
            small = [t // 2 for t in total]
            big = [t - t // 2 for t in total]
            self.begin, self.end = (tuple(small), tuple(big)) if auto == "SAME_UPPER" else (tuple(big), tuple(small))
        else:
            raise cx.fail(f"attribute auto_pad={auto!r} is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
        out = []
        for n, b, e, sp, s in zip(spatial, self.begin, self.end, span, self.strides):
            room = n + b + e - sp
            if room < 0:
                raise cx.fail(f"the window ({sp} wide) is larger than the padded input ({n + b + e})")
            o = (-(-room // s) if ceil_mode else room // s) + 1
            if ceil_mode and (o - 1) * s >= n + b:  # the last window must start inside input or begin pad
                o -= 1
            out.append(o)
        self.out = tuple(out)

    def coords(self) -> list[np.ndarray]:
        """Per spatial axis, [kernel, out]: the input coordinate tap k of output position o reads
        (-1 in the padding)."""
        out = []
        for ax, n in enumerate(self.spatial):
            c = (np.arange(self.out[ax])[None, :] * self.strides[ax] - self.begin[ax]
                 + np.arange(self.kernel[ax])[:, None] * self.dilations[ax])
            out.append(np.where((c >= 0) & (c < n), c, -1))
        return out

    def table(self) -> np.ndarray:
        return _table(self.coords(), self.spatial)


def _table(coords: list[np.ndarray], spatial: tuple[int, ...]) -> np.ndarray:
    """[K, P] flat input index of kernel tap k (row-major over the kernel axes) for output position
    p, from per-axis [k_ax, o_ax] coordinates; taps in the padding (-1 on some axis) read index S,
    one past the last element (where ``window_taps`` appends the fill value)."""
    size = math.prod(spatial)
    k_axes = [c.shape[0] for c in coords]
    idx = np.zeros((math.prod(k_axes), math.prod(c.shape[1] for c in coords)), np.int64)
    for t, ks in enumerate(itertools.product(*[range(k) for k in k_axes])):
        cs = np.meshgrid(*[coords[ax][ks[ax]] for ax in range(len(ks))], indexing="ij")
        inside = np.all([c >= 0 for c in cs], axis=0)
        flat = np.ravel_multi_index(tuple(np.maximum(c, 0) for c in cs), spatial)
        idx[t] = np.where(inside, flat, size).reshape(-1)
    return idx


def window_taps(cx: NodeCtx, x: Sym, coords: list[np.ndarray], fill: float) -> Sym:
    """[N, C, K, P]: the taps (per-axis coordinates ``coords``, see ``_table``) of every output
    position, gathered from the flattened spatial axis; taps in the padding read ``fill``."""
    n, c = x.shape[:2]
    spatial = tuple(x.shape[2:])
    kk, p = math.prod(a.shape[0] for a in coords), math.prod(a.shape[1] for a in coords)
    if kk * p > _MAX_INDEX_ELEMS:
        raise cx.fail(f"the im2col index table would hold {kk * p} entries (kernel {[a.shape[0] for a in coords]}, "
                      f"output {[a.shape[1] for a in coords]}); fusec refuses more than {_MAX_INDEX_ELEMS}")
    cx.em.check_size((n, c, kk, p), f"node {cx.node.name!r}: the im2col columns", np_dtype(x).itemsize)
    flat = reshape_to(cx, x, (n, c, math.prod(spatial)))
    if any((a < 0).any() for a in coords):
        pad = Const(np.full((n, c, 1), fill, dtype=np_dtype(x)))
        flat = cx.emit(Op.CONCAT, flat, pad, axis=2)
    return cx.emit(Op.GATHER, flat, Const(_table(coords, spatial)), axis=2)


def kernel_shape_of(cx: NodeCtx, w_shape: tuple[int, ...] | None, rank: int) -> list[int]:
    ks = cx.attr("kernel_shape")
    if ks is None:
        if w_shape is None:
            raise cx.fail("attribute kernel_shape is required")
        ks = list(w_shape[2:])
    if len(ks) != rank:
        raise cx.fail(f"kernel_shape {list(ks)} does not fit the {rank} spatial axes of the input")
    return [int(k) for k in ks]


def check_input(cx: NodeCtx, x: Sym, ints: bool = False) -> None:
    if len(x.shape) < 3:
        raise cx.fail(f"input {list(x.shape)} needs rank >= 3 ([N, C, spatial...])")
    if np_dtype(x).kind != "f" and not (ints and np_dtype(x).kind in "iu"):
        raise cx.fail(f"input of dtype {np_dtype(x)} is not supported (floating-point only)")


def add_bias(cx: NodeCtx, y: Sym, bias: Sym | None, shape: tuple[int, ...], final: bool) -> Sym:
    if bias is None:
        return y
    if tuple(bias.shape) != (shape[-1] if len(shape) == 1 else shape[0],) and math.prod(bias.shape) != math.prod(shape):
        raise cx.fail(f"bias B {list(bias.shape)} must hold one value per output channel")
    return cx.emit(Op.ADD, y, reshape_to(cx, bias, shape), final=final)


def _patch_conv(cx: NodeCtx, x: Sym, w: Sym, bias: Sym | None, win: Window) -> Sym:
    """kernel == stride, no padding/dilation/groups: patches by reshape + transpose, one GEMM."""
    n, c, r = x.shape[0], x.shape[1], len(win.spatial)
    m = w.shape[0]
    used = tuple(o * k for o, k in zip(win.out, win.kernel))
    if used != win.spatial:  # the tail that no window covers is dropped, as the conv does
        x = cx.emit(Op.SLICE, x, axes=tuple(range(2, 2 + r)), starts=(0,) * r, ends=used, steps=(1,) * r)
    split = (n, c) + tuple(itertools.chain.from_iterable(zip(win.out, win.kernel)))
    # [N, C, O0, K0, O1, K1, ..] -> [N, O0, O1, .., C, K0, K1, ..]
    perm = (0,) + tuple(2 + 2 * i for i in range(r)) + (1,) + tuple(3 + 2 * i for i in range(r))
    patches = cx.emit(Op.TRANSPOSE, reshape_to(cx, x, split), perm=perm)
    ck, p = c * math.prod(win.kernel), math.prod(win.out)
    cols = reshape_to(cx, patches, (n * p, ck))
    wt = cx.emit(Op.TRANSPOSE, reshape_to(cx, w, (m, ck)), perm=(1, 0))
    y = cx.emit(Op.MATMUL, cols, wt)
    y = add_bias(cx, y, bias, (m,), final=False)
    # back to channels-first as [N, P, M] -> [N, M, P] -> [N, M, *out]: the flatten + transpose a
    # ViT/CLIP embedding applies next then cancels with these (simplify collapses reshape pairs
    # and transpose pairs), and no copy is left
    y = cx.emit(Op.TRANSPOSE, reshape_to(cx, y, (n, p, m)), perm=(0, 2, 1))
    return reshape_to(cx, y, (n, m) + win.out, final=True)


@handler("Conv")
def _conv(cx: NodeCtx) -> list[Sym | None]:
    x, w = cx.x(0), cx.x(1)
    check_input(cx, x)
    bias = cx.x(2) if cx.has(2) else None
    r = len(x.shape) - 2
    n, c = x.shape[:2]
    if len(w.shape) != r + 2:
        raise cx.fail(f"weight W {list(w.shape)} must have rank {r + 2} for input {list(x.shape)}")
    group = int(cx.attr("group", 1))
    m, cg = w.shape[:2]
    if group < 1 or c % group or m % group or cg * group != c:
        raise cx.fail(f"attribute group={group} does not fit input channels {c} and weight {list(w.shape)}")
    win = Window(cx, tuple(x.shape[2:]), kernel_shape_of(cx, tuple(w.shape), r))
    if tuple(w.shape[2:]) != win.kernel:
        raise cx.fail(f"kernel_shape {list(win.kernel)} differs from the weight's {list(w.shape[2:])}")
    if group == 1 and win.kernel == win.strides and not (any(win.begin) or any(win.end)) \
            and set(win.dilations) == {1} and math.prod(win.kernel) > 1:
        return [_patch_conv(cx, x, w, bias, win)]
    return [_im2col_gemm(cx, x, reshape_to(cx, w, (group, m // group, cg * math.prod(win.kernel))), bias,
                         win.coords(), m, win.out)]


def _im2col_gemm(cx: NodeCtx, x: Sym, wg: Sym, bias: Sym | None, coords: list[np.ndarray], m: int,
                 out: tuple[int, ...]) -> Sym:
    """im2col + GEMM: ``wg`` [G, M/G, C/G*K] (group-major weights, taps fastest) times the gathered
    windows [N, C*K, P], channels-first out: [N, M, *out]. A 1x1, stride-1, unpadded conv reads x
    as it is (no gather)."""
    n, c = x.shape[:2]
    group, ck = wg.shape[0], wg.shape[2]
    p = math.prod(out)
    identity = all(a.shape == (1, x.shape[2 + i]) and (a[0] == np.arange(a.shape[1])).all() for i, a in enumerate(coords))
    cols = x if identity else window_taps(cx, x, coords, 0.0)  # [N, C, K, P]
    if group == 1:
        y = cx.emit(Op.MATMUL, reshape_to(cx, wg, (m, ck)), reshape_to(cx, cols, (n, ck, p)))  # [N, M, P]
    else:  # one GEMM per group: [G, M/G, C/G*K] @ [N, G, C/G*K, P] -> [N, G, M/G, P]
        y = reshape_to(cx, cx.emit(Op.MATMUL, wg, reshape_to(cx, cols, (n, group, ck, p))), (n, m, p))
    y = add_bias(cx, y, bias, (m, 1), final=False)
    return reshape_to(cx, y, (n, m) + tuple(out), final=True)


@handler("ConvTranspose")
def _conv_transpose(cx: NodeCtx) -> list[Sym | None]:
    """y[o] = sum over taps k and inputs i with i * stride + k * dilation - pad_begin = o of x[i] w[k]:
    the same im2col + GEMM, the table pointing each (tap, output) at the one input it reads, if any."""
    x, w = cx.x(0), cx.x(1)
    check_input(cx, x)
    bias = cx.x(2) if cx.has(2) else None
    r = len(x.shape) - 2
    n, c = x.shape[:2]
    spatial = tuple(x.shape[2:])
    group = int(cx.attr("group", 1))
    if len(w.shape) != r + 2 or group < 1 or w.shape[0] != c or c % group:
        raise cx.fail(f"weight W {list(w.shape)} (attribute group={group}) does not fit input {list(x.shape)}")
    mg = w.shape[1]
    kernel = tuple(kernel_shape_of(cx, tuple(w.shape), r))
    if kernel != tuple(w.shape[2:]):
        raise cx.fail(f"kernel_shape {list(kernel)} differs from the weight's {list(w.shape[2:])}")
    attrs = {}
    for name, default in (("strides", 1), ("dilations", 1), ("output_padding", 0)):
        v = [int(a) for a in (cx.attr(name) or [default] * r)]
        if len(v) != r or any(a < (0 if name == "output_padding" else 1) for a in v):
            raise cx.fail(f"attribute {name}={v} must hold {r} {'non-negative' if default == 0 else 'positive'} values")
        attrs[name] = v
    st, dl = attrs["strides"], attrs["dilations"]
    full = [s_ * (i - 1) + op + (k - 1) * d + 1 for s_, i, op, k, d in zip(st, spatial, attrs["output_padding"], kernel, dl)]
    auto = cx.attr("auto_pad", "NOTSET") or "NOTSET"
    out_shape = cx.attr("output_shape")
    if out_shape is not None or auto in ("SAME_UPPER", "SAME_LOWER"):
        out = [int(o) for o in out_shape][-r:] if out_shape is not None else [i * s_ for i, s_ in zip(spatial, st)]
        if len(out) != r:
            raise cx.fail(f"attribute output_shape={list(out_shape)} must name the {r} spatial dims")
        total = [f - o for f, o in zip(full, out)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in total]
    elif auto in ("NOTSET", "VALID"):
        pads = [int(q) for q in (cx.attr("pads") or [0] * (2 * r))] if auto == "NOTSET" else [0] * (2 * r)
        if len(pads) != 2 * r:
            raise cx.fail(f"attribute pads={pads} must hold {2 * r} values")
        begin = pads[:r]
        out = [f - b - e for f, b, e in zip(full, pads[:r], pads[r:])]
    else:
        raise cx.fail(f"attribute auto_pad={auto!r} is not one of NOTSET, VALID, SAME_UPPER, SAME_LOWER")
    if any(o < 1 for o in out):
        raise cx.fail(f"the output's spatial shape {out} is empty")
    coords = []
    for ax in range(r):
        t = np.arange(out[ax])[None, :] + begin[ax] - np.arange(kernel[ax])[:, None] * dl[ax]
        i = t // st[ax]
        coords.append(np.where((t % st[ax] == 0) & (i >= 0) & (i < spatial[ax]), i, -1))
    # W [C, M/G, *k] -> [G, M/G, C/G * K]
    kk = math.prod(kernel)
    wg = cx.emit(Op.TRANSPOSE, reshape_to(cx, w, (group, c // group, mg, kk)), perm=(0, 2, 1, 3))
    wg = reshape_to(cx, wg, (group, mg, c // group * kk))
    return [_im2col_gemm(cx, x, wg, bias, coords, mg * group, tuple(out))]


@handler("CausalConvWithState")
def _causal_conv(cx: NodeCtx) -> list[Sym | None]:
    """Depthwise causal Conv1d over [past_state, input] (zeros without a state), an optional
    SiLU, and the last k-1 positions as the new state: a sum of k shifted slices times the per-
    channel taps (elementwise work the fusion pass joins), no im2col."""
    x, w = cx.x(0), cx.x(1)
    if len(x.shape) != 3 or len(w.shape) != 3 or tuple(w.shape[:2]) != (x.shape[1], 1) or w.shape[2] < 1:
        raise cx.fail(f"input {list(x.shape)} and weight {list(w.shape)} must be [B, C, L] and [C, 1, k]")
    if np_dtype(x).kind != "f":
        raise cx.fail(f"input of dtype {np_dtype(x)} is not supported (floating-point only)")
    act = cx.attr("activation", "none") or "none"
    if act not in ("none", "silu", "swish"):
        raise cx.fail(f"attribute activation={act!r} is not one of none, silu, swish")
    b, c, length = x.shape
    k = w.shape[2]
    past = cx.x(3) if cx.has(3) else Const(np.zeros((b, c, k - 1), np_dtype(x)))
    if tuple(past.shape) != (b, c, k - 1):
        raise cx.fail(f"past_state {list(past.shape)} must be [{b}, {c}, {k - 1}]")
    padded = cx.emit(Op.CONCAT, past, x, axis=2) if k > 1 else x

    def window(v: Sym, start: int, size: int) -> Sym:
        return cx.emit(Op.SLICE, v, axes=(2,), starts=(start,), ends=(start + size,), steps=(1,))

    dt = np_dtype(x)
    wide = dt.itemsize < 4  # fp16/bf16: accumulate the taps and apply SiLU in fp32, round once

    def f32(v: Sym) -> Sym:
        return cx.emit(Op.CAST, v, to=DType.F32) if wide else v

    y = None
    for j in range(k):
        term = cx.emit(Op.MUL, f32(window(padded, j, length)), f32(reshape_to(cx, window(w, j, 1), (c, 1))))
        y = term if y is None else cx.emit(Op.ADD, y, term)
    if cx.has(2):
        y = cx.emit(Op.ADD, y, f32(reshape_to(cx, cx.x(2), (c, 1))))
    if act != "none":
        y = cx.emit(Op.SILU, y)
    if wide:
        y = cx.emit(Op.CAST, y, to=DType.from_np(dt))
    return [y, window(padded, length, k - 1) if cx.used(1) else None]
