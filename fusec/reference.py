"""The numpy reference backend: an interpreter over the IR (autodidax's ``eval_jaxpr``).

It is the living definition of every op; every other backend is checked against it. Floating
point ops on fp16/bf16 tensors compute in fp32 and round the result back to the storage dtype,
which is what the CUDA kernels do (fp32 accumulation).

``run(graph, inputs)`` takes a dict of input name to array and returns a dict of output name to
array. Inputs are checked against the graph's signature (name, shape, dtype) first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from fusec import ops as O
from fusec import reference_model as RM
from fusec import reference_ops as RO
from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.ir import Graph, Node, Value
from fusec.ops import Op
from fusec import reference_train as RT


def _f32(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    """Compute a float op in at least fp32 and return the first input's storage dtype."""

    def wrapped(attrs: Any, *xs: np.ndarray) -> np.ndarray:
        dt = xs[0].dtype
        # fp16/bf16 compute in fp32; fp32 and fp64 compute in their own precision
        up = [x.astype(np.float32) if x.dtype == np.float16 or x.dtype.name == "bfloat16" else x for x in xs]
        return np.asarray(fn(attrs, *up)).astype(dt, copy=False)

    return wrapped


_erf_vec = np.vectorize(math.erf, otypes=[np.float64])


def _erf(x: np.ndarray) -> np.ndarray:
    return _erf_vec(x.astype(np.float64)).astype(x.dtype)


def _gelu(a: O.GeluAttrs, x: np.ndarray) -> np.ndarray:
    if a.approximate == "tanh":
        c = np.float32(math.sqrt(2.0 / math.pi))
        return 0.5 * x * (1.0 + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))
    return 0.5 * x * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # 1/(1+exp(-x)) overflows harmlessly to 0 for very negative x; silence the warning.
    with np.errstate(over="ignore"):
        return (1.0 / (1.0 + np.exp(-x))).astype(x.dtype)


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # ONNX/C integer division truncates toward zero; numpy's // floors.
    q = np.abs(a) // np.abs(b)
    return np.where((a < 0) != (b < 0), -q, q).astype(a.dtype)


def _div(attrs: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        return _int_div(a, b)
    return _f32(lambda _, x, y: x / y)(attrs, a, b)


def _pow(attrs: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "iu":
        return np.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)
    return _f32(lambda _, x, y: np.power(x, y.astype(x.dtype)))(attrs, a, b)


def _cast(a: O.CastAttrs, x: np.ndarray) -> np.ndarray:
    if a.to.is_float and x.dtype == np.bool_:
        return x.astype(np.float32).astype(a.to.np)
    if a.to == DType.BF16 and x.dtype.kind in "iu":
        return x.astype(np.float32).astype(a.to.np)
    return x.astype(a.to.np)


def _reduce(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    return _f32(lambda a, x: fn(x, axis=a.axes, keepdims=a.keepdims))


def _cumsum(a: O.CumSumAttrs, x: np.ndarray) -> np.ndarray:
    y = np.flip(x, a.axis) if a.reverse else x
    out = np.cumsum(y, axis=a.axis, dtype=x.dtype)
    if a.exclusive:  # the inclusive sums shifted one place (not out - y: inf - inf, absorbed terms)
        out = np.roll(out, 1, axis=a.axis)
        out[(slice(None),) * a.axis + (0,)] = 0
    return np.flip(out, a.axis) if a.reverse else out


def _matmul(a: Any, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    dt = x.dtype
    if getattr(a, "trans_a", False):
        x = np.swapaxes(x, -1, -2)
    if getattr(a, "precision", "f32") == "tf32" and dt == np.float32:  # tf32 tensor cores (3xTF32)
        return RO.matmul_tf32(bool(getattr(a, "trans_b", False)), x, y)
    if getattr(a, "trans_b", False):
        y = np.swapaxes(y, -1, -2)
    if dt.kind in "iu":
        return np.matmul(x, y)
    # copy=False: weights already in fp32 are not copied on every call (decode runs this per token);
    # fp64 (gradient checks) computes in fp64
    wide = RO.wide(x)
    return np.matmul(x.astype(wide, copy=False), y.astype(wide, copy=False)).astype(dt, copy=False)


def _isinf(a: O.IsInfAttrs, x: np.ndarray) -> np.ndarray:
    return (np.isposinf(x) & a.detect_positive) | (np.isneginf(x) & a.detect_negative)


def _fused(a: O.FusedAttrs, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
    """A fused node computes exactly what its body computes (the body is run node by node)."""
    body = a.body
    env: dict[Value, np.ndarray] = dict(zip(body.inputs, xs))
    for c in body.constants:
        env[c] = c.data
    for node in body.nodes:
        for v, r in zip(node.outputs, eval_node(node, [env[v] for v in node.inputs])):
            env[v] = r
    return tuple(env[v] for v in body.outputs)


IMPL: dict[Op, Callable[..., np.ndarray]] = {
    Op.NEG: lambda a, x: np.negative(x),
    Op.ABS: lambda a, x: np.abs(x),
    Op.EXP: _f32(lambda a, x: np.exp(x)),
    Op.LOG: _f32(lambda a, x: np.log(x)),
    Op.SQRT: _f32(lambda a, x: np.sqrt(x)),
    Op.RECIPROCAL: _f32(lambda a, x: np.reciprocal(x)),
    Op.ERF: _f32(lambda a, x: _erf(x)),
    Op.TANH: _f32(lambda a, x: np.tanh(x)),
    Op.SIGMOID: _f32(lambda a, x: _sigmoid(x)),
    Op.RELU: lambda a, x: np.maximum(x, np.zeros((), x.dtype)),
    Op.COS: _f32(lambda a, x: np.cos(x)),
    Op.SIN: _f32(lambda a, x: np.sin(x)),
    Op.NOT: lambda a, x: np.logical_not(x),
    Op.ISNAN: lambda a, x: np.isnan(x),
    Op.ISINF: _isinf,
    Op.CAST: _cast,
    Op.GELU: _f32(_gelu),
    Op.SILU: _f32(lambda a, x: x * _sigmoid(x)),
    Op.FLOOR: lambda a, x: np.floor(x),
    Op.CEIL: lambda a, x: np.ceil(x),
    Op.ROUND: lambda a, x: np.round(x),  # numpy rounds half to even, as ONNX Round does
    Op.SIGN: lambda a, x: np.sign(x),
    Op.BITWISE_NOT: lambda a, x: np.invert(x),
    Op.ADD: _f32(lambda a, x, y: x + y),
    Op.SUB: _f32(lambda a, x, y: x - y),
    Op.MUL: _f32(lambda a, x, y: x * y),
    Op.DIV: _div,
    Op.POW: _pow,
    Op.MAX: lambda a, x, y: np.maximum(x, y),
    Op.MIN: lambda a, x, y: np.minimum(x, y),
    Op.EQUAL: lambda a, x, y: np.equal(x, y),
    Op.LESS: lambda a, x, y: np.less(x, y),
    Op.LESS_EQUAL: lambda a, x, y: np.less_equal(x, y),
    Op.GREATER: lambda a, x, y: np.greater(x, y),
    Op.GREATER_EQUAL: lambda a, x, y: np.greater_equal(x, y),
    Op.AND: lambda a, x, y: np.logical_and(x, y),
    Op.OR: lambda a, x, y: np.logical_or(x, y),
    Op.XOR: lambda a, x, y: np.logical_xor(x, y),
    Op.MOD: RO.mod,
    Op.BITWISE_AND: lambda a, x, y: np.bitwise_and(x, y),
    Op.BITWISE_OR: lambda a, x, y: np.bitwise_or(x, y),
    Op.BITWISE_XOR: lambda a, x, y: np.bitwise_xor(x, y),
    Op.BIT_SHIFT: RO.bit_shift,
    Op.WHERE: lambda a, c, x, y: np.where(c, x, y),
    Op.REDUCE_SUM: _reduce(np.sum),
    Op.REDUCE_MEAN: _reduce(np.mean),
    Op.REDUCE_MAX: RO.reduce_max,
    Op.REDUCE_MIN: RO.reduce_min,
    Op.REDUCE_PROD: _reduce(np.prod),
    Op.ARGMAX: lambda a, x: RO.arg(np.argmax, a, x),
    Op.ARGMIN: lambda a, x: RO.arg(np.argmin, a, x),
    Op.TOPK: RO.topk,
    Op.SOFTMAX: _f32(RO.softmax),
    Op.CUMSUM: _cumsum,
    Op.LAYERNORM: _f32(RM.layernorm),
    Op.RMSNORM: RM.rmsnorm,
    Op.MATMUL: _matmul,
    Op.QMATMUL: RM.qmatmul,
    Op.QGATHER: RM.qgather,
    Op.TF32_SPLIT: RO.tf32_split,
    Op.RESHAPE: lambda a, x: x.reshape(a.shape),
    Op.TRANSPOSE: lambda a, x: np.transpose(x, a.perm),
    Op.EXPAND: lambda a, x: np.broadcast_to(x, a.shape),
    Op.CONCAT: lambda a, *xs: np.concatenate(xs, axis=a.axis),
    Op.SLICE: RO.slice_,
    Op.GATHER: RO.gather,
    Op.GATHER_ELEMENTS: RO.gather_elements,
    Op.GATHER_ND: RO.gather_nd,
    Op.SCATTER_ND: RO.scatter_nd,
    Op.TILE: lambda a, x: np.tile(x, a.repeats),
    Op.TRILU: RO.trilu,
    Op.PAD: RO.pad,
    Op.ATTENTION: RM.attention,
    Op.ROPE: _f32(RM.rope),
    Op.FUSED: _fused,
    Op.CACHE_WRITE: RM.cache_write,
    Op.KV_ATTENTION: RM.kv_attention,
    Op.SAMPLE: RM.sample,
    Op.SCATTER_ADD: RT.scatter_add,
    Op.CROSS_ENTROPY: RT.cross_entropy,
    Op.ADAMW: RT.adamw,
    Op.INIT: RT.init,
    Op.SOFTMAX_GRAD: RT.softmax_grad,
    Op.LAYERNORM_GRAD: RT.layernorm_grad,
    Op.CROSS_ENTROPY_GRAD: RT.cross_entropy_grad,
}


def check_inputs(graph: Graph, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Match the caller's inputs to the graph's signature; raise InputError naming the input."""
    expected = {v.name: v for v in graph.inputs}
    missing = [n for n in expected if n not in inputs]
    extra = [n for n in inputs if n not in expected]
    if missing:
        raise InputError(f"missing input(s): {', '.join(repr(n) for n in missing)} "
                         f"(the graph takes {', '.join(repr(n) for n in expected)})")
    if extra:
        raise InputError(f"unexpected input(s): {', '.join(repr(n) for n in extra)} "
                         f"(the graph takes {', '.join(repr(n) for n in expected)})")
    out: dict[str, np.ndarray] = {}
    for name, v in expected.items():
        arr = np.asarray(inputs[name])
        if tuple(arr.shape) != v.shape:
            raise InputError(f"input {name!r}: expected shape {list(v.shape)}, got {list(arr.shape)}")
        if arr.dtype != v.dtype.np:
            if v.dtype.is_int and arr.dtype.kind in "iu":  # int32/int64 token ids are interchangeable
                if arr.size and (arr.min() < np.iinfo(v.dtype.np).min or arr.max() > np.iinfo(v.dtype.np).max):
                    raise InputError(f"input {name!r}: values do not fit {v.dtype.value}")
                arr = arr.astype(v.dtype.np)
            else:
                raise InputError(f"input {name!r}: expected dtype {v.dtype.value}, got {arr.dtype}")
        out[name] = arr
    return out


def eval_node(node: Node, args: list[np.ndarray]) -> list[np.ndarray]:
    """Evaluate one node on numpy arrays; returns its outputs in order, with their declared types."""
    res = IMPL[node.op](node.attrs, *args)
    results = list(res) if isinstance(res, tuple) else [res]
    out = []
    for v, r in zip(node.outputs, results):
        r = np.asarray(r)
        if r.dtype != v.dtype.np:
            r = r.astype(v.dtype.np)
        if tuple(r.shape) != v.shape:
            raise AssertionError(f"reference for {node.describe()} produced shape {r.shape}, expected {v.shape}")
        out.append(r)
    return out


def run(graph: Graph, inputs: Mapping[str, Any],
        progress: Callable[[str, str], None] | None = None) -> dict[str, np.ndarray]:
    """Execute ``graph`` on numpy inputs; returns {output name: array}. ``progress(stage, item)``:
    called before each node (``fusec run`` shows it on a terminal). An index out of range that a
    graph input holds (a token id) is an InputError naming that input, not the op that reads it."""
    env: dict[Value, np.ndarray] = {}
    checked = check_inputs(graph, inputs)
    for name, arr in checked.items():
        env[next(v for v in graph.inputs if v.name == name)] = arr
    for c in graph.constants:
        assert c.data is not None
        env[c] = c.data
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i, node in enumerate(graph.nodes):
            if progress is not None:
                progress("reference", f"{node.op.value} ({i + 1}/{len(graph.nodes)})")
            try:
                results = eval_node(node, [env[v] for v in node.inputs])
            except InputError:
                from fusec.inputs import check_index_bounds

                check_index_bounds(graph, checked)  # names the input holding the bad index, if one does
                raise
            for v, r in zip(node.outputs, results):
                env[v] = r
    # np.ascontiguousarray turns a 0-d array into shape (1,): reshape keeps scalar outputs scalar
    return {v.name: np.ascontiguousarray(env[v]).reshape(env[v].shape) for v in graph.outputs}


def run_planned(graph: Graph, inputs: Mapping[str, Any], plan: Any, poison: int = 0xFF,
                progress: Callable[[str, str], None] | None = None) -> dict[str, np.ndarray]:
    """Execute ``graph`` with every non-weight value stored in ONE byte arena at its planned offset.

    ``plan`` is a ``fusec.passes.memory_plan.MemoryPlan`` (duck-typed: ``arena_bytes``,
    ``offsets`` {value name: byte offset}, ``alias`` {value name: {"base", "byte_offset", "kind"}}).
    Each node reads its inputs from their arena slots and its result is written into its slot, so
    any overlap bug in the plan corrupts the numbers (the arena starts filled with ``poison``,
    NaN bytes for floats). View nodes (``alias`` kind "view") run nothing: their slot must already
    hold the right bytes. Views of weights read the weight's bytes at the planned byte offset.
    """
    arena = np.full(int(plan.arena_bytes), poison, dtype=np.uint8)
    consts = {c.name: c for c in graph.constants}
    # state lives outside the arena, one buffer per state (the plan's state region on the GPU)
    state_bufs = {src.name: np.full(src.nbytes, poison, np.uint8) for src, _ in graph.state_pairs()}

    def slot(v: Value) -> np.ndarray:
        if v.name in getattr(plan, "state", {}):
            name, off = plan.state[v.name]
            buf = state_bufs[name]
        elif v.name in plan.offsets:
            buf, off = arena, int(plan.offsets[v.name])
        else:  # a weight, or a view of one: weights live outside the arena
            a = plan.alias.get(v.name)
            base = consts[a["base"] if a else v.name]
            assert base.data is not None
            buf, off = np.ascontiguousarray(base.data).reshape(-1).view(np.uint8), int(a["byte_offset"]) if a else 0
        if off < 0 or off + v.nbytes > buf.size:
            raise AssertionError(f"planned slot of {v.name!r} [{off}, {off + v.nbytes}) is outside its buffer ({buf.size} B)")
        return buf[off:off + v.nbytes].view(v.dtype.np).reshape(v.shape)

    for name, arr in check_inputs(graph, inputs).items():
        slot(next(v for v in graph.inputs if v.name == name))[...] = arr
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i, node in enumerate(graph.nodes):
            if all(plan.alias.get(o.name, {}).get("kind") == "view" for o in node.outputs):
                continue
            if progress is not None:  # as in run()
                progress("reference", f"{node.op.value} ({i + 1}/{len(graph.nodes)})")
            results = eval_node(node, [slot(v) for v in node.inputs])
            for v, r in zip(node.outputs, results):
                slot(v)[...] = r
    return {v.name: np.array(slot(v), copy=True) for v in graph.outputs}
