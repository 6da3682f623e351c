"""fp32 matrix products with a constant weight as ONE tf32 tensor-core GEMM of three times the K (3xTF32).

An exact-fp32 cuBLAS SGEMM runs on the SIMT cores (GPT-2's tied lm_head, 1024x50260x768 on an
H100: 49 TFLOP/s); tf32 tensor cores run several times faster but read only 10 mantissa bits.
Splitting each operand into a tf32 head and the rest, hi(x) = x rounded to 10 mantissa bits and
lo(x) = x - hi(x) (exact in fp32), gives

    A @ B  ~=  lo(A) hi(B) + hi(A) lo(B) + hi(A) hi(B)        (lo(A) lo(B), ~2^-22 relative, dropped)

and the three products are one GEMM over K' = 3K, accumulated in fp32 by the tensor cores:

    y = x @ W        becomes      xs = tf32_split(x)                      # [.., 3K]: lo(x) | hi(x) | hi(x) (*)
                                  y  = matmul[precision=tf32](xs, W3)      # W3 [3K, N]: hi(W); lo(W); hi(W)

The two small products come first along K' and the large one last: cuBLAS walks K in order, so
the small terms (~2^-11 of the result) sum among themselves before the large partial sums arrive;
placed after them (hi | hi | lo, the first version) they were added onto an accumulator already
the size of the result, and GPT-2 small fp32's logits were 2.9e-5 from float64 on an H100 (SGEMM:
3.7e-6; a per-product error model predicts no such gap, so the loss is in the accumulation).

(*) Where x is inf or NaN, its lo and middle blocks are 0: the middle block meets lo(W), and inf * lo(W)
would add NaN (or a second inf) to what an SGEMM gives, x * W.

(a ``trans_b`` weight [N, K], e.g. the tied embedding read by the lm_head, becomes [N, 3K] with
column blocks hi | lo | hi). W3 is a constant made here, so it shows in the dumps and the weight
bytes; pad_gemm ran before, so a padded N stays padded. ``hi`` rounds to nearest-even on the bit
pattern and has no low bits, so the tensor core reads it exactly whether it truncates or rounds;
it reads ``lo`` as tf32(lo) (``fusec.reference_ops.matmul_tf32`` emulates truncation, the worse).

Where it pays (``MIN_M``): the product must be compute-bound. Per weight element an SGEMM does
2M flops over 4 bytes; 3xTF32 reads 12 bytes. On an H100 (SGEMM ~50 TFLOP/s, tf32 ~350-490,
HBM ~3 TB/s) the weight read alone costs 12NK/3e12 s against the SGEMM's 2MNK/5e13 s, so below
M ~ 128 rows the rewrite loses; ``MIN_M`` = 256 keeps a margin (and leaves decode GEMV paths,
M <= 8, alone). Only constant 2-D fp32 weights are rewritten (batched activation x activation
products are not), and only where ``PassOptions.fp32_gemm == "3xtf32"`` (``fusec.compiler.stage``
sets it for ``--dtype fp32`` on sm_80+ unless ``--fp32-gemm sgemm``) and not in generation plans
(``weights_nk``: prefill and decode share one [N, K] copy of each weight; W3 would add 3x).
Packed products (``QMATMUL``) are left alone: their fp32 prefill path dequantizes exactly into
fp32 scratch for cuBLAS's SGEMM, and a tf32 split of a packed weight would unpack it for good.

Counters: ``gemms_split_tf32`` (products rewritten), ``split_tf32_extra_bytes`` (W3 bytes beyond
the weights they replace: 2x a weight read only by these products, 3x one that something else
still reads, such as the tied embedding table's GATHER; a weight read both [K, N] and, through
the transpose flag, [N, K] gets one W3 per layout, 5x when it then dies).
"""

from __future__ import annotations

import math

import numpy as np

from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import MatMulAttrs, NoAttrs, Op
from fusec.passes.base import PassOptions, PassResult
from fusec.passes.match import Ctx, Rewriter
from fusec.reference_ops import tf32_hi

NAME = "split_tf32"
REQUIRES = ("transpose_cache", "merge_gemms", "pad_gemm")  # split the layout and N the products finally read
MIN_M = 256
MODES = ("3xtf32", "sgemm")


def split_weight(w: np.ndarray, trans_b: bool) -> np.ndarray:
    """W3 of a 2-D fp32 weight: [hi; lo; hi] along K ([K, N] -> [3K, N]; [N, K] -> [N, 3K])."""
    w = np.asarray(w, dtype=np.float32)
    hi = tf32_hi(w)
    lo = (w - hi).astype(np.float32)
    return np.concatenate([hi, lo, hi], axis=1 if trans_b else 0)


def _why_not(ctx: Ctx, node: Node) -> str | None:
    """Why ``node`` is not rewritten (None: it is)."""
    x, w = node.inputs
    if getattr(node.attrs, "precision", "f32") != "f32":
        return "already a tf32 product"
    if getattr(node.attrs, "trans_a", False):
        return "A is read transposed (a gradient product)"
    if w.data is None or len(w.shape) != 2:
        return "B is not a constant 2-D weight"
    if x.is_const or x is w or x.dtype != DType.F32 or w.dtype != DType.F32 or len(x.shape) < 2:
        return "not an fp32 activation [.., M, K] times a weight"
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if m < MIN_M:
        return f"M={m} < {MIN_M}: the product is bound by reading the weight, which 3xTF32 triples"
    if k % 4:
        return f"K={k} is not a multiple of 4 (the split's rows must stay 16-byte aligned)"
    if not np.isfinite(np.asarray(w.data)).all():
        return f"weight {w.name!r} holds non-finite values"
    return None


def run(graph: Graph, options: PassOptions) -> PassResult:
    mode = options.fp32_gemm
    if mode not in MODES:
        raise ValueError(f"PassOptions.fp32_gemm is {mode!r}; expected one of {', '.join(MODES)}")
    ctx = Ctx(graph)
    rw = Rewriter(graph)
    split_w: dict[tuple[int, bool], Value] = {}
    split_x: dict[int, Value] = {}
    made: dict[int, tuple[Value, list[Value]]] = {}  # id(weight) -> (weight, the W3s made of it)
    done: set[int] = set()  # ids of the products rewritten
    rewritten = extra = 0
    candidates = [n for n in graph.nodes if n.op == Op.MATMUL and n.output.dtype == DType.F32]
    if mode == "3xtf32" and options.weights_nk and candidates:
        options.decline(NAME, graph.name, "generation plan: prefill and decode share each weight's one copy")
        candidates = []
    for node in candidates if mode == "3xtf32" else []:
        why = _why_not(ctx, node)
        if why is not None or rw.claimed([node]):
            if why is not None:
                options.decline(NAME, ctx.where(node), why)
            continue
        x, w = node.inputs
        tb = bool(getattr(node.attrs, "trans_b", False))
        new: list[Node] = []
        xs = split_x.get(id(x))
        if xs is None:
            split = rw.node(Op.TF32_SPLIT, [x], NoAttrs(), base=f"{x.name}_tf32split")
            new.append(split)
            xs = split_x[id(x)] = split.outputs[0]
        w3 = split_w.get((id(w), tb))
        if w3 is None:
            w3 = split_w[(id(w), tb)] = rw.const(split_weight(w.data, tb), f"{w.name}.tf32x3")
            made.setdefault(id(w), (w, []))[1].append(w3)
        done.add(id(node))
        new.append(Node(Op.MATMUL, [xs, w3], node.outputs, MatMulAttrs(trans_b=tb, precision="tf32"), node.name))
        rw.replace(node, new, [node])
        rewritten += 1
    for w, w3s in made.values():  # a weight dies when every reader was rewritten (one W3 per layout read)
        kept = ctx.is_output(w) or any(id(u) not in done for u in ctx.users(w))
        extra += sum(v.nbytes for v in w3s) - (0 if kept else w.nbytes)
    g = rw.finish() if rw.changed else graph.copy()
    g.meta["gemms_split_tf32"] = rewritten
    g.meta["split_tf32_extra_bytes"] = extra
    options.bump("gemms_split_tf32", rewritten)
    if extra:
        options.bump("split_tf32_extra_bytes", extra)
    return PassResult(g, rewritten > 0)
