"""Kernel choices with alternatives, picked per choice key at lowering time (the A/B's second half).

A *choice point* is a node the lowering can emit in more than one way:

- a fused ``gemm_epilogue`` node whose epilogue is ``[+ bias[N]] [activation] [+ residual[M, N]]``
  (in that order) over a 2-D weight: ``"cublas"`` (the default: cuBLAS GEMM, then one in-place
  epilogue kernel), ``"fusec_gemm"`` (fusec's tensor-core ``GemmSpec`` with the epilogue applied
  to the accumulator before the store: one launch, no round trip of the product), and for
  M <= 8 with a constant weight also ``"gemv"`` (``GemvSpec`` with the same epilogue);
- a plain MATMUL with a constant 2-D weight: ``"cublas"``, and for M <= 8 ``"gemv"``;
- a product over packed weights (QMATMUL, alone or under such an epilogue) with more rows than the quantized GEMV
  takes, fp16/bf16 x and K a multiple of 64: ``"qgemm"`` (dequantized in the tile of fusec's tensor-core GEMM, the
  epilogue fused) or ``"dequant_gemm"`` (dequantized into scratch, cuBLAS, the epilogue apart), the rule's first
  (``fusec.lower.quant.choose``), the other what an A/B measures; ``fusec.lower.quant`` emits them;
- for every constant 2-D weight, the other of its two layouts: ``"cached_transpose"`` (B stored
  [K, N], cuBLAS reads it as is) or ``"transpose_flag"`` (B stored [N, K] and read through
  cuBLAS's transpose flag, ``MATMUL[trans_b=True]``), whichever the passes did not pick.

Weights have one owner: a variant that needs the other layout of the weight (``NEEDS_TRANS_B``:
fusec_gemm reads [K, N], or [N, K] in its wgmma form on sm_90; gemv reads [N, K]) never copies it here.
``passes/select_kernels.py``
materializes the layout the chosen variant needs, as a constant in the IR, before memory
planning (``PassOptions.choices``, set by ``fusec.compile(choices=...)``); the lowering only
reads what the IR holds, and declines a variant whose layout is not there.

The key (``choice_key``) names the shape, dtype and epilogue, never a node name or a layout, so
every same-shaped GEMM of a model shares one decision and one measurement, a region cut out of the
model for an experiment has the same key as the node in the model, and the key survives the
layout change its variant asks for. ``lower(..., choices={key: variant})`` selects; a node whose
key is absent (or maps to "cublas") lowers exactly as before.
"""

from __future__ import annotations

import dataclasses
import math

from fusec import knobs
from fusec.codegen import specs as S
from fusec.codegen.build_gemm import wgmma_fits
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.lower import gemm_lt
from fusec.ops import Op

DEFAULT = "cublas"
# The B layout a variant reads: True [N, K] (trans_b), False [K, N]; absent: either (cuBLAS).
NEEDS_TRANS_B: dict[str, bool] = {"fusec_gemm": False, "gemv": True, "cached_transpose": False,
                                  "transpose_flag": True}
LAYOUT_VARIANTS = ("cached_transpose", "transpose_flag")
_ACT = {Op.RELU: "relu", Op.SILU: "silu"}


@dataclasses.dataclass(frozen=True)
class ChoicePoint:
    """A node with alternative lowerings. Body values map to the node's operands by ``outer``."""

    key: str
    variants: tuple[str, ...]  # the first is the default; the rest are what an A/B should measure
    a: Value  # [.., K] activations (body value for fused nodes)
    b: Value  # weight: [K, N], or [N, K] when trans_b
    bias: Value | None
    residual: Value | None
    epilogue: S.Epilogue
    m: int
    n: int
    k: int
    trans_b: bool = False
    b_const: bool = False  # the (outer) weight is a constant: a pass may change its layout
    precision: str = "f32"  # the MATMUL's: "tf32" for a 3xTF32 product (passes/split_tf32.py)

    def accepts(self, variant: str) -> bool:
        """``variant`` applies here: listed, or a layout variant of a constant weight (after
        weight_layout flipped the layout, the variant naming it is no longer listed)."""
        return variant in self.variants or (self.b_const and variant in LAYOUT_VARIANTS)


def _epilogue(body: Graph) -> tuple[Value | None, str, Value | None] | None:
    """(bias, activation, residual) when the body after its MATMUL is exactly that chain."""
    mm = body.nodes[0]
    cur = mm.output
    n = mm.output.shape[-1]
    bias: Value | None = None
    act = "none"
    res: Value | None = None
    for node in body.nodes[1:]:
        if cur not in node.inputs or len(node.outputs) != 1 or node.output.dtype != cur.dtype \
                or node.output.shape != cur.shape:
            return None
        if node.op == Op.ADD:
            other = node.inputs[1] if node.inputs[0] is cur else node.inputs[0]
            if other is cur:
                return None
            if bias is None and act == "none" and res is None and other.numel == n and other.shape[-1:] == (n,) \
                    and other.dtype == cur.dtype:
                bias = other
            elif res is None and other.shape == cur.shape and other.dtype == cur.dtype and not other.is_const:
                res = other
            else:
                return None
        elif node.op in _ACT or node.op == Op.GELU:
            if act != "none" or res is not None:
                return None
            act = _ACT.get(node.op) or ("gelu_tanh" if node.attrs.approximate == "tanh" else "gelu")
        else:
            return None
        cur = node.output
    if cur is not body.outputs[0] or (bias is None and act == "none" and res is None):
        return None
    return bias, act, res


def _epi_name(e: S.Epilogue) -> str:
    parts = (["bias"] if e.bias else []) + ([e.activation] if e.activation != "none" else []) + (["res"] if e.residual else [])
    return "+".join(parts) or "none"


def _prec_key(precision: str) -> str:
    """A 3xTF32 product (passes/split_tf32.py, K tripled) keys apart from an exact one of that K."""
    return "" if precision == "f32" else f":{precision}"


def _trans_b(mm: Node) -> bool:
    return bool(getattr(mm.attrs, "trans_b", False))


def _mkn(a: Value, b: Value, trans_b: bool) -> tuple[int, int, int] | None:
    if len(b.shape) != 2:
        return None
    k, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if len(a.shape) < 2 or a.shape[-1] != k or a.dtype != b.dtype or a.dtype not in S.FLOATS:
        return None
    return math.prod(a.shape[:-1]), n, k


def _layout_variant(trans_b: bool, b_const: bool) -> tuple[str, ...]:
    """The weight layout the passes did not pick, as a variant (constant weights only)."""
    if not b_const:
        return ()
    return ("cached_transpose",) if trans_b else ("transpose_flag",)


def choice_point(node: Node) -> ChoicePoint | None:
    """The choice point ``node`` is, or None (it has one lowering only). A product reading A
    transposed (a gradient) has one: cuBLAS."""
    mm = node.attrs.body.nodes[0] if node.op == Op.FUSED and node.attrs.body.nodes else node
    if mm.op == Op.MATMUL and getattr(mm.attrs, "trans_a", False):
        return None
    if mm.op == Op.QMATMUL:
        return _packed_choice(node, mm)
    if node.op == Op.FUSED:
        body = node.attrs.body
        if len(body.outputs) != 1 or not body.nodes or body.nodes[0].op != Op.MATMUL \
                or any(x.op == Op.MATMUL for x in body.nodes[1:]):
            return None
        mm = body.nodes[0]
        tb = _trans_b(mm)
        mkn = _mkn(*mm.inputs, tb)
        epi = _epilogue(body)
        if mkn is None or epi is None:
            return None
        bias, act, res = epi
        e = S.Epilogue(bias=bias is not None, activation=act, residual=res is not None)
        m, n, k = mkn
        const = outer(node, mm.inputs[1]).is_const
        variants = (DEFAULT, "fusec_gemm") + (("gemv",) if _gemv_fits(m, k, mm.inputs[0]) and const else ()) \
            + _layout_variant(tb, const)
        if gemm_lt.applies(e, mm.inputs[0].dtype, n, k):  # the epilogue inside cuBLASLt (fusec.lower.gemm_lt)
            variants += (gemm_lt.VARIANT,)
        prec = getattr(mm.attrs, "precision", "f32")
        key = f"gemm_epilogue:{mm.inputs[0].dtype.value}:{m}x{n}x{k}:{_epi_name(e)}{_prec_key(prec)}"
        return ChoicePoint(key, variants, mm.inputs[0], mm.inputs[1], bias, res, e, m, n, k, tb, const, prec)
    if node.op == Op.MATMUL:
        a, b = node.inputs
        tb = _trans_b(node)
        mkn = _mkn(a, b, tb)
        if mkn is None or not b.is_const:
            return None
        m, n, k = mkn
        variants = (DEFAULT,) + (("gemv",) if _gemv_fits(m, k, a) else ()) \
            + (("fusec_gemm",) if stream_fits(m, n, k, a.dtype) else ()) + _layout_variant(tb, True)
        prec = getattr(node.attrs, "precision", "f32")
        return ChoicePoint(f"matmul:{a.dtype.value}:{m}x{n}x{k}{_prec_key(prec)}", variants, a, b, None, None,
                           S.Epilogue(), m, n, k, tb, True, prec)
    return None


def stream_fits(m: int, n: int, k: int, dtype: DType) -> bool:
    """fusec's GEMM takes the product in its stream form (``GemmSpec.stream``: a prefill's few rows against a weight
    read once)."""
    return dtype in S.FLOATS and S.GemmSpec(m, n, k, dtype).stream


def _gemv_fits(m: int, k: int, a: Value) -> bool:
    """GemvSpec's limits: at most 16 rows, weight rows read in 16-byte slices."""
    return m <= S.GEMV_MAX_M and k % (16 // a.dtype.itemsize) == 0


def gemm_stream(wgmma: bool, one_wave: bool = True) -> bool:
    """Whether products that fusec's GEMM takes in its stream form run there (FUSEC_GEMM_STREAM): by default where its
    wgmma form runs (``wgmma``: sm_90). Measured on an H200 in one process against cuBLAS (RESULTS.md, twenty-fourth
    session): Qwen3-0.6B's 128-token prefill 1.245 ms against 1.307, the Llama-1B shape's 32-token one 1.035 against
    1.091, GPT-2 small at 1 x 128 0.82x, BERT-base at 1 x 128 0.77x, MiniLM at 4 x 32 0.83x. The mma.sync form took
    1.1-2.2x cuBLAS's time (twenty-second session): not by default. Nor where no tiling of the wgmma form runs in one
    wave (``one_wave``: ``build_gemm.wgmma_fits``; a vocabulary's logits at every row), which nothing measured."""
    v = knobs.get("FUSEC_GEMM_STREAM")
    return v == "1" or (v == "auto" and wgmma and one_wave)


def choose(choices: dict[str, str], cp: ChoicePoint, wgmma: bool = False) -> str:
    """The variant ``cp`` lowers with: an explicit choice (an A/B ledger, the caller) wins; else the
    rule-based default. The rule: fusec's skinny product (GemvSpec: tensor cores, 16-byte weight
    loads, its epilogue fused, launched overlapping the kernel before it) for a product of at most
    16 rows over a constant weight (a decode step at batch <= 16), else cuBLASLt with the epilogue
    inside where it computes it, else cuBLAS. The earlier FMA GEMV matched or beat cuBLAS at M = 1
    and lost 2-3x at M = 8 (benchmarks/decode_kernels_results.md); the tensor-core kernel that
    replaced it is measured against cuBLAS at M = 1..16 in benchmarks/RESULTS.md. Before cuBLASLt, a
    product of at most 128 rows that fusec's GEMM takes in its stream form (a prefill's) runs there where
    ``gemm_stream`` says so: by default on sm_90 (``wgmma``), its wgmma form."""
    explicit = choices.get(cp.key)
    if explicit is not None:
        return explicit
    if "gemv" in cp.variants:
        return "gemv"
    if "fusec_gemm" in cp.variants and stream_fits(cp.m, cp.n, cp.k, cp.a.dtype) \
            and gemm_stream(wgmma, wgmma_fits(cp.m, cp.n, cp.k)):
        return "fusec_gemm"
    if gemm_lt.VARIANT in cp.variants:  # one cuBLASLt call instead of cuBLAS + an epilogue kernel
        return gemm_lt.VARIANT
    return DEFAULT


QVARIANTS = ("qgemm", "dequant_gemm")  # a prefill's product over packed weights (fusec.lower.quant emits them)


def _packed_choice(node: Node, mm: Node) -> ChoicePoint | None:
    """The choice point of a QMATMUL (alone, or the product of a gemm_epilogue body) where both of a prefill's
    ways apply: more rows than the quantized GEMV takes, fp16/bf16 x, K a multiple of 64."""
    from fusec.lower import quant as Q

    x, a = mm.inputs[0], mm.attrs
    m = math.prod(x.shape[:-1])
    if not Q.tile_applies(m, a.n, a.k, a.format, a.group, x.dtype):
        return None
    bias = res = None
    e = S.Epilogue()
    if node.op == Op.FUSED:
        body = node.attrs.body
        epi = _epilogue(body) if len(body.outputs) == 1 else None
        if epi is None or any(n.op in (Op.MATMUL, Op.QMATMUL) for n in body.nodes[1:]):
            return None
        bias, act, res = epi
        e = S.Epilogue(bias=bias is not None, activation=act, residual=res is not None)
    rule = Q.choose(m, a.n, a.k, a.format, a.group, x.dtype)  # the rule's (or FUSEC_QGEMM's) way first
    variants = (rule,) + tuple(v for v in QVARIANTS if v != rule)
    key = f"qmatmul:{x.dtype.value}:{a.format}:g{a.group}:{m}x{a.n}x{a.k}:{_epi_name(e)}"
    return ChoicePoint(key, variants, x, mm.inputs[1], bias, res, e, m, a.n, a.k, True, True)


def choice_points(graph: Graph) -> list[tuple[Node, ChoicePoint]]:
    """Every node of ``graph`` (an optimized graph) with alternative lowerings."""
    return [(n, cp) for n in graph.nodes if (cp := choice_point(n)) is not None]


# variants whose kernels read their activations, bias and residual with 16-byte accesses
ALIGNED = ("cublaslt", "fusec_gemm", "gemv")


def outer(node: Node, v: Value) -> Value:
    if node.op != Op.FUSED:
        return v
    body = node.attrs.body
    return node.inputs[body.inputs.index(v)] if v in body.inputs else v


def emit(ctx, node: Node, sel, label: str) -> bool:  # noqa: ANN001 (fusec.lower.Context, passes.select_kernels.Selection)
    """Emit the product variant ``sel`` (passes/select_kernels.py) chose for ``node``; False when the
    variant is cuBLAS (the op's own lowering emits it). Layouts and alignment were settled by the
    selection: the IR holds the weight as the variant reads it."""
    if not sel.key or sel.variant in ("", DEFAULT) or sel.variant in LAYOUT_VARIANTS or sel.variant in QVARIANTS:
        return False  # no choice point (a fused family's one kernel), cuBLAS, or packed weights' (fusec.lower.quant)
    cp = choice_point(node)
    if cp is None or not cp.accepts(sel.variant):
        raise AssertionError(f"{label}: selected variant {sel.variant!r} does not fit the node")
    a, b, out = outer(node, cp.a), outer(node, cp.b), node.outputs[0]
    extra = [outer(node, v) for v in (cp.bias, cp.residual) if v is not None]
    if sel.variant == gemm_lt.VARIANT:
        gemm_lt.emit(ctx, cp, a, b, out, *(outer(node, v) if v is not None else None for v in (cp.bias, cp.residual)),
                     label=label)
    elif sel.variant == "fusec_gemm":  # the stream form's K split (and on sm_90 wgmma) as kernel selection recorded it
        spec = S.GemmSpec(cp.m, cp.n, cp.k, a.dtype, trans_b=cp.trans_b, epilogue=cp.epilogue, **dict(sel.params))
        ctx.kernel(spec, [a, b, *extra, out], f"{label} fusec_gemm")
    else:  # gemv: reads the weight [N, K] (k contiguous), as MATMUL[trans_b] stores it
        spec = S.GemvSpec(cp.m, cp.n, cp.k, a.dtype, epilogue=cp.epilogue, **dict(sel.params))
        ctx.kernel(spec, [a, b, *extra, out], f"{label} gemv")
    return True
