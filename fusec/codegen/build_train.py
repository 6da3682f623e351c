"""Builders of the training kernels (``fusec.codegen.specs_train``): cross_entropy, scatter_add,
init and adamw's three phases."""

from __future__ import annotations

import itertools
import math

import numpy as np

from fusec.codegen import specs_train as T
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import FloatLit, Ident, ctype, float_lit
from fusec.reference_train import INIT_SALT
from fusec.sampling import GOLDEN, TOKEN_MUL

_MAX_GRID = 1 << 16  # grid-stride loops cover the rest


def _f32(x: float, what: str) -> FloatLit:
    """The fp32 value the reference uses (np.float32(x)), written exactly: its double repr + 'f'."""
    return float_lit(float(np.float32(x)), what)


def _f64(x: float, what: str) -> FloatLit:
    """A double literal (no suffix) of a finite Python float."""
    f = float(x)
    if not math.isfinite(f):
        raise ValueError(f"{what} must be finite, got {x!r}")
    r = repr(f)
    return FloatLit(r if ("e" in r or "." in r) else r + ".0")


@builder(T.CrossEntropySpec)
def _cross_entropy(spec: T.CrossEntropySpec) -> Rendered:
    block = 128
    ctx = {"name": kernel_name("ce_grad" if spec.grad else "ce", spec), "t": ctype(spec.dtype),
           "label_t": ctype(spec.label_dtype), "rows": spec.rows, "classes": spec.classes, "ignore": spec.ignore_index,
           "block": block}
    template = "cross_entropy_grad.cu.jinja" if spec.grad else "cross_entropy.cu.jinja"
    params = ("logits", "labels") + (("dloss",) if spec.grad else ()) + ("out",)
    return Rendered(template, ctx, (cdiv(spec.rows, block // 32), 1, 1), (block, 1, 1), params)


@builder(T.ScatterAddSpec)
def _scatter_add(spec: T.ScatterAddSpec) -> Rendered:
    block = 256
    total = spec.pre * (spec.size if spec.zero else spec.n_idx) * spec.post
    ctx = {"name": kernel_name("scatter_add", spec), "pre": spec.pre, "n_idx": spec.n_idx, "size": spec.size,
           "post": spec.post, "zero": spec.zero, "idx_t": ctype(spec.idx_dtype), "block": block}
    params = ("out",) if spec.zero else ("upd", "idx", "out")
    return Rendered("scatter_add.cu.jinja", ctx, (min(cdiv(total, block), _MAX_GRID), 1, 1), (block, 1, 1), params)


@builder(T.InitSpec)
def _init(spec: T.InitSpec) -> Rendered:
    block = 256
    kinds = {"zeros": 0, "ones": 1, "uniform": 2}
    ctx = {"name": kernel_name("init", spec), "t": ctype(spec.dtype), "seed_t": ctype(spec.seed_dtype),
           "nseg": len(spec.segments), "total": spec.numel,
           "ends": list(itertools.accumulate(n for n, _, _ in spec.segments)),
           "kinds": [kinds[k] for _, k, _ in spec.segments],
           "bounds": [_f32(b, "init bound") for _, _, b in spec.segments],
           "is_float": spec.dtype.is_float, "golden": GOLDEN, "salt": INIT_SALT, "token_mul": TOKEN_MUL, "block": block}
    return Rendered("init.cu.jinja", ctx, (min(cdiv(spec.numel, block), _MAX_GRID), 1, 1), (block, 1, 1), ("seed", "out"))


@builder(T.AdamWSpec)
def _adamw(spec: T.AdamWSpec) -> Rendered:
    block = 256
    clip = spec.max_grad_norm > 0
    offsets = [0, *itertools.accumulate(spec.sizes)][:-1]
    span = max(spec.total_steps - spec.warmup_steps, 1)
    ctx = {"name": kernel_name(f"adamw_{spec.phase}", spec), "phase": Ident(spec.phase), "nseg": len(spec.sizes),
           "chunk": T.ADAMW_CHUNK, "nblocks": spec.blocks, "block": block,
           "chunk_start": [0, *itertools.accumulate(spec.chunks)], "sizes": list(spec.sizes),
           "grads": [ctype(d) for d in spec.grad_dtypes], "offsets": offsets, "decay": list(spec.decay), "clip": clip,
           "max_norm": _f32(spec.max_grad_norm, "max grad norm"), "warmup": spec.warmup_steps,
           "total": spec.total_steps, "span": span, "schedule": Ident(spec.schedule),
           "lr": _f64(spec.lr, "lr"), "beta1": _f64(spec.beta1, "beta1"), "beta2": _f64(spec.beta2, "beta2"),
           "weight_decay": _f64(spec.weight_decay, "weight decay"),
           "b1": _f32(spec.beta1, "beta1"), "b2": _f32(spec.beta2, "beta2"), "omb1": _f32(1.0 - spec.beta1, "1 - beta1"),
           "omb2": _f32(1.0 - spec.beta2, "1 - beta2"), "eps": _f32(spec.eps, "eps")}
    grads = tuple(f"g{i}" for i in range(len(spec.sizes)))
    # what each phase writes is named out_* (kernels.written: the program's write sets), updated in place included
    if spec.phase == "norm":
        return Rendered("adamw.cu.jinja", ctx, (spec.blocks, 1, 1), (block, 1, 1), ("out_partial",) + grads)
    if spec.phase == "scalars":
        return Rendered("adamw.cu.jinja", ctx, (1, 1, 1), (block, 1, 1), ("out_step", "partial", "out_scalars"))
    return Rendered("adamw.cu.jinja", ctx, (spec.blocks, 1, 1), (block, 1, 1),
                    ("out_params", "out_m", "out_v", "scalars") + grads)


@builder(T.SoftmaxGradSpec)
def _softmax_grad(spec: T.SoftmaxGradSpec) -> Rendered:
    block = 128
    ctx = {"name": kernel_name("softmax_grad", spec), "t": ctype(spec.dtype), "outer": spec.outer, "cols": spec.cols,
           "inner": spec.inner, "scale": _f32(spec.scale, "scale"), "block": block}
    return Rendered("softmax_grad.cu.jinja", ctx, (cdiv(spec.outer * spec.inner, block // 32), 1, 1), (block, 1, 1),
                    ("p", "dp", "out"))


@builder(T.LayerNormGradSpec)
def _layernorm_grad(spec: T.LayerNormGradSpec) -> Rendered:
    block = 128
    ctx = {"name": kernel_name("layernorm_grad", spec), "t": ctype(spec.dtype), "w_t": ctype(spec.w_dtype),
           "rows": spec.rows, "cols": spec.cols, "eps": _f32(spec.eps, "eps"), "block": block}
    return Rendered("layernorm_grad.cu.jinja", ctx, (cdiv(spec.rows, block // 32), 1, 1), (block, 1, 1),
                    ("x", "scale", "dy", "out_dx", "out_dyxhat"))

