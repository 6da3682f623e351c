"""The skinny-product family: decode's matrix products as one ``GemvSpec`` launch, or one ``QGemvSpec`` launch for a
QMATMUL over packed weights (its FMA or dp4a form); and on sm_90 (the body's ``wgmma`` meta,
``passes.fusion.target_meta``) a prefill's product of up to 128 rows with its gated unit, as one launch of fusec's
GEMM in its wgmma form (``GemmSpec.glu``).

A body of this family is [RMSNORM ->] MATMUL (M <= 16 rows, a constant weight stored [N, K] and
read with ``trans_b``) or QMATMUL -> [an elementwise epilogue: + bias, activation, + residual | a gated unit:
the product's two halves sliced apart, one activated, multiplied] [-> a greedy SAMPLE of the
result]. The norm becomes the kernel's prologue (each block normalizes the rows it reads), the
gated unit its epilogue (a tile holds rows j of both halves), and a SAMPLE its argmax
partials (a packed product's in the dp4a form only), merged by a second, tiny launch (``SampleSpec`` with
chunks): the logits are still written (a bisect or a reader of them sees them), but no kernel reads them back.
``plan_siblings``: an RMSNorm read by several packed products in different formats (``packed_siblings``), one
launch of the dp4a form with a segment of blocks per product.

``plan(body)`` is the capability half (asked through ``fused.can_fuse`` while fusion forms groups):
it raises ``NoPlan`` saying why a body is not one such kernel, or returns what ``emit`` needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusec.codegen import specs as S
from fusec.codegen.build_gemm import wgmma_fits
from fusec.ir import Graph, Node, Value
from fusec.ops import Op

_ACT = {Op.RELU: "relu", Op.SILU: "silu"}


class NoPlan(Exception):
    """The body is not one skinny-product kernel; the message says why."""


@dataclasses.dataclass(frozen=True)
class Plan:
    mm: Node
    norm: Node | None
    bias: Value | None  # body values
    act: str
    residual: Value | None
    glu: str  # "" or the gated half's activation
    glu_swap: bool
    sample: Node | None
    out: Value  # the body value the product's epilogue ends in (the logits when it samples)
    m: int
    n: int
    k: int
    siblings: tuple[Node, ...] = ()  # further packed products of the same normalized x (plan_siblings)

    @property
    def packed(self) -> bool:
        return self.mm.op == Op.QMATMUL

    @property
    def wide(self) -> bool:
        """More rows than the skinny product takes: a gated unit on fusec's GEMM in its wgmma form (a prefill's)."""
        return self.m > S.GEMV_MAX_M

    def spec(self, **params: Any) -> Any:
        """The launch's spec; ``params``: the kernel selection's (how it streams its weights; the
        quantized GEMV's form)."""
        dt = self.mm.inputs[0].dtype
        # what both specs take: the epilogue, the norm prologue, the gated unit
        common = dict(epilogue=S.Epilogue(bias=self.bias is not None, activation=self.act,
                                          residual=self.residual is not None),
                      norm=self.norm is not None,
                      eps=float(self.norm.attrs.eps) if self.norm is not None else 1e-6,
                      weight_offset=float(self.norm.attrs.weight_offset) if self.norm is not None else 0.0,
                      glu=self.glu, glu_swap=self.glu_swap, **params)
        sample = {} if self.sample is None else {"argmax": True, "seed_dtype": self.sample.inputs[1].dtype,
                                                  "counter_dtype": self.sample.inputs[2].dtype}
        if self.wide:  # params: kernel selection's tiling of the wgmma form (splits, bn)
            return S.GemmSpec(self.m, self.n, self.k, dt, trans_b=True, glu=self.glu, glu_swap=self.glu_swap,
                              **params)
        if self.packed:
            from fusec.codegen.specs_quant import QGemvSpec, QSibling
            from fusec.lower.quant_emit import scale_dtype

            a = self.mm.attrs
            forms = common.pop("sibling_forms", ())
            sibs = tuple(QSibling(s.attrs.n, s.attrs.format, s.attrs.group, scale_dtype(s.attrs.format, s.inputs[1:]),
                                  rows, chunks) for s, (rows, chunks) in zip(self.siblings, forms))
            return QGemvSpec(self.m, self.n, self.k, a.format, a.group, dt, scale_dtype(a.format, self.mm.inputs[1:]),
                             **common, **sample, **({"siblings": sibs} if sibs else {}))
        return S.GemvSpec(self.m, self.n, self.k, dt, **common, **sample)


def _product(ops: list[Op]) -> int | None:
    hits = [i for i, o in enumerate(ops) if o in (Op.MATMUL, Op.QMATMUL)]
    return hits[0] if len(hits) == 1 else None


def applies(body: Graph) -> bool:
    """Bodies only this family covers: a product with a norm before it, a gated unit or a sample after it."""
    ops = [n.op for n in body.nodes]
    i = _product(ops)
    if i is None:
        return False
    return (i > 0 and ops[i - 1] == Op.RMSNORM) or Op.SAMPLE in ops or _glu_nodes(body, body.nodes[i]) is not None


def is_constant(body: Graph, v: Value) -> bool:
    """Whether body value ``v`` holds a constant: a body constant, or an input the outer graph
    feeds a constant (``passes.subgraph.extract`` records which)."""
    return v in body.constants or (v in body.inputs and body.inputs.index(v) in body.meta.get("const_inputs", ()))


def fits(m: int, k: int, a: Value, b: Value, trans_b: bool, const: bool, wide: bool = False) -> str | None:
    """None when GemvSpec takes this product (or, ``wide``, fusec's GEMM in its wgmma form: more rows), else why not."""
    if m > S.GEMV_MAX_M and not (wide and m <= S.GEMM_STREAM_MAX_M and a.dtype in S.HALFS
                                 and k % S.GEMM_STREAM_BK == 0):
        return f"the skinny product takes at most {S.GEMV_MAX_M} rows, this one has {m}" + (
            f" (fusec's wgmma GEMM: at most {S.GEMM_STREAM_MAX_M} rows of fp16/bf16, K a multiple of "
            f"{S.GEMM_STREAM_BK})" if wide else "")
    if not const:
        return "the skinny product streams a constant weight (kernel selection stores it [N, K])"
    if a.dtype not in S.FLOATS or a.dtype != b.dtype:
        return f"the skinny product needs one float dtype for x and the weight ({a.dtype.value}, {b.dtype.value})"
    if k % (16 // a.dtype.itemsize):
        return f"the skinny product reads 16-byte slices: K = {k} is not a multiple of {16 // a.dtype.itemsize}"
    return None


def qfits(m: int, n: int, k: int, a: Value, mm: Node, norm: bool, glu: bool, const: bool) -> str | None:
    """None when the quantized GEMV's dp4a or FMA form takes this product with a norm prologue or a
    gated epilogue (``QGemvSpec``), else why not: the form the rule picks (``fusec.lower.qgemv_form.gemv_form``)
    must be one of those; the FMA form needs two rows a warp for a gated unit and x within the norm's
    shared memory."""
    from fusec.codegen.specs_quant import QNORM_SMEM
    from fusec.lower import qgemv_form as QF
    from fusec.lower import quant as Q

    if m > (most := Q.qgemv_max_rows()):
        return f"the quantized GEMV takes at most {most} rows (FUSEC_QGEMV_MAX_ROWS), this one has {m}"
    if not Q.qgemv_takes(m, n, k, mm.attrs.format, mm.attrs.group, a.dtype):
        return (f"past {Q.GEMV_FORMS_M} rows the quantized GEMV takes a product only in its tensor-core form, which "
                f"does not take this one ({m} rows of {a.dtype.value})")
    if not const:
        return "the quantized GEMV reads packed constant weights"
    if a.dtype not in S.FLOATS:
        return f"the quantized GEMV multiplies float rows, not {a.dtype.value}"
    form = QF.gemv_form(m, n, k, mm.attrs.format, mm.attrs.group, a.dtype, norm, glu)
    if form.get("tc"):
        from fusec import knobs

        if norm:
            return "the tensor-core quantized GEMV (the rule's form here) has no norm prologue"
        if not glu:
            return "the tensor-core quantized GEMV (the rule's form here) fuses only a gated epilogue"
        if not knobs.get("FUSEC_QGEMV_TC_GATE"):
            return "the tensor-core quantized GEMV's gated epilogue is off (FUSEC_QGEMV_TC_GATE=0)"
        return None
    if form.get("dp4a"):
        if glu and m >= QF.DP4A_WIDE_M:  # the rule's dp4a form here has no gated unit (FUSEC_QGEMV_WIDE_GATE)
            return "the dp4a quantized GEMV at 4-8 rows of x has no gated unit (spilled); the gated unit runs apart"
        return None  # the rule picked the dp4a form with the prologue and epilogue asked for: it fits
    if glu and form.get("rows") != 2:
        return "a gated quantized GEMV needs two rows a warp (at most 8 rows of x)"
    if norm and m * k * a.dtype.itemsize > QNORM_SMEM:
        return f"the quantized GEMV's norm copies x into {QNORM_SMEM} bytes of shared memory: M * K is too large"
    return None


def _qsamples(m: int, n: int, k: int, a: Value, mm: Node, norm: bool) -> bool:
    """Whether the rule's quantized GEMV form for this product writes argmax partials (the dp4a form's)."""
    from fusec.lower import qgemv_form as QF

    return bool(QF.gemv_form(m, n, k, mm.attrs.format, mm.attrs.group, a.dtype, norm, False).get("dp4a"))


SIBLINGS_MAX_M = 2  # at 3 rows of x the Q4_K + Q6_K kernel spilled 96 bytes on sm_80 (ptxas, the Llama-1B shapes)


def plan_siblings(body: Graph) -> Plan:
    """An RMSNorm read by several packed products (``packed_siblings``) as one launch of the dp4a form: the norm once
    a block, each product's tasks in blocks of their own; NoPlan saying why not."""
    from fusec.lower import qgemv_form as QF

    nodes = list(body.nodes)
    norm, mms = nodes[0], nodes[1:]
    if norm.op != Op.RMSNORM or len(mms) < 2 or any(n.op != Op.QMATMUL for n in mms):
        raise NoPlan("packed siblings are an RMSNorm and the packed products that read it, nothing else")
    x = norm.outputs[0]
    if any(mm.inputs[0] is not x for mm in mms) or set(body.outputs) != {mm.outputs[0] for mm in mms}:
        raise NoPlan("every sibling reads the norm's result as x and writes one of the group's outputs")
    k = mms[0].attrs.k
    m = math.prod(x.shape[:-1]) if len(x.shape) >= 2 else 0
    if m < 1 or m > SIBLINGS_MAX_M:
        raise NoPlan(f"packed siblings take 1 to {SIBLINGS_MAX_M} rows of x")
    if norm.inputs[1].shape != (k,) or norm.inputs[1].dtype != x.dtype or norm.inputs[0].dtype != x.dtype \
            or (norm.inputs[1] not in body.inputs and norm.inputs[1] not in body.constants):
        raise NoPlan("the norm prologue must be an RMSNorm over K, in the products' dtype, its weight an operand")
    forms = []
    for mm in mms:
        a = mm.attrs
        if a.k != k or x.shape[-1] != k:
            raise NoPlan("packed siblings multiply one x: the same K")
        if (why := qfits(m, a.n, k, x, mm, True, False, all(is_constant(body, v) for v in mm.inputs[1:]))) is not None:
            raise NoPlan(why)
        form = QF.gemv_form(m, a.n, k, a.format, a.group, x.dtype, True, False)
        if not form.get("dp4a") or form.get("cluster", 1) != 1:
            raise NoPlan("packed siblings run in the dp4a form without clusters")
        forms.append(form)
    shared = {"warps", "blocks", "norm_early"}
    if any({f.get(key) for f in forms} != {forms[0].get(key)} for key in shared):
        raise NoPlan("packed siblings share one block shape and one x phase (warps, blocks an SM, norm weights)")
    first = mms[0]
    return Plan(first, norm, None, "none", None, "", False, None, first.outputs[0], m, first.attrs.n, k,
                tuple(mms[1:]))


def plan(body: Graph) -> Plan:
    nodes = list(body.nodes)
    i = _product([nd.op for nd in nodes])
    if i is None:
        raise NoPlan("a skinny product body has exactly one matrix product")
    mm = nodes[i]
    if i > 1 or (i == 1 and nodes[0].op != Op.RMSNORM):
        raise NoPlan("only an RMSNorm may come before the skinny product")
    a = mm.inputs[0]
    if mm.op == Op.QMATMUL:
        n, k = mm.attrs.n, mm.attrs.k
        if len(a.shape) < 2 or a.shape[-1] != k:
            raise NoPlan("the skinny product multiplies rows of K by the packed weight")
        m = math.prod(a.shape[:-1])
        glu_q = _glu_nodes(body, mm) is not None
        if (why := qfits(m, n, k, a, mm, i == 1, glu_q, all(is_constant(body, v) for v in mm.inputs[1:]))) is not None:
            raise NoPlan(why)
        if Op.SAMPLE in [nd.op for nd in nodes] and not _qsamples(m, n, k, a, mm, i == 1):
            raise NoPlan("the quantized GEMV's form here (not the dp4a form) writes no argmax partials for a sample")
    else:
        b = mm.inputs[1]
        if len(b.shape) != 2 or len(a.shape) < 2:
            raise NoPlan("the skinny product multiplies rows by a 2-D weight")
        trans_b = bool(getattr(mm.attrs, "trans_b", False))
        n, k = (b.shape[0], b.shape[1]) if trans_b else (b.shape[1], b.shape[0])
        m = math.prod(a.shape[:-1])
        if getattr(mm.attrs, "precision", "f32") != "f32":
            raise NoPlan("the skinny product computes exact products (not a 3xTF32 split)")
        if (why := fits(m, k, a, b, trans_b, const=is_constant(body, b), wide=bool(body.meta.get("wgmma")))) is not None:
            raise NoPlan(why)
    norm = nodes[0] if i == 1 else None
    if norm is not None:
        if norm.outputs[0] is not a or norm.inputs[1].shape != (k,) or norm.inputs[1].dtype != a.dtype \
                or norm.inputs[0].dtype != a.dtype:
            raise NoPlan("the norm prologue must be an RMSNorm over K, in the product's dtype, feeding it directly")
        if norm.inputs[1] not in body.inputs and norm.inputs[1] not in body.constants:
            raise NoPlan("the norm weight must be an operand of the group")
    rest = nodes[i + 1:]
    sample = rest[-1] if rest and rest[-1].op == Op.SAMPLE else None
    if sample is not None:
        rest = rest[:-1]
    glu = _glu_nodes(body, mm)
    bias = res = None
    act, gact, swap = "none", "", False
    if glu is not None:
        gact, swap, members, out = glu
        if {id(x) for x in rest} != {id(x) for x in members}:
            raise NoPlan("a gated unit must be the whole epilogue")
        if n % 2:
            raise NoPlan("a gated unit needs an even number of weight rows")
    else:
        bias, act, res, out = _epilogue(rest, mm.output, n)
    if sample is not None:
        if sample.inputs[0] is not out or len(out.shape) != 2:
            raise NoPlan("the sample must read the product's [rows, vocabulary] result")
        if n <= 8:
            raise NoPlan("a vocabulary of at most 8 tokens is sampled by the plain sampler")
        if glu is not None:
            raise NoPlan("a gated unit does not feed a sample")
    elif out not in body.outputs or len(body.outputs) != 1:
        raise NoPlan("the product's result must be the group's one output")
    if m > S.GEMV_MAX_M and (norm is not None or sample is not None or not gact or bias is not None or n % 8
                             or not wgmma_fits(m, n, k)):
        raise NoPlan(f"at more than {S.GEMV_MAX_M} rows fusec's wgmma GEMM takes a gated unit (halves of a multiple "
                     "of 4 rows, no bias, a tiling in one wave) as its epilogue, not a sample or a norm prologue (one in the kernel measured "
                     "slower than the separate RMSNorm: benchmarks/RESULTS.md, twenty-fourth session)")
    return Plan(mm, norm, bias, act, res, gact, swap, sample, out, m, n, k)


def _epilogue(rest: list[Node], cur: Value, n: int) -> tuple[Value | None, str, Value | None, Value]:
    """(bias, activation, residual, last value) of an elementwise chain after the product."""
    bias = res = None
    act = "none"
    for node in rest:
        if cur not in node.inputs or len(node.outputs) != 1 or node.output.shape != cur.shape \
                or node.output.dtype != cur.dtype:
            raise NoPlan("the skinny product's epilogue is + bias, an activation, + residual, in that order")
        if node.op == Op.ADD:
            other = node.inputs[1] if node.inputs[0] is cur else node.inputs[0]
            if bias is None and act == "none" and res is None and other.numel == n and other.shape[-1:] == (n,) \
                    and other.dtype == cur.dtype and other is not cur:
                bias = other
            elif res is None and other.shape == cur.shape and other.dtype == cur.dtype and other is not cur:
                res = other
            else:
                raise NoPlan("an add in the epilogue must be a bias [N] or a residual of the output's shape")
        elif node.op in _ACT or node.op == Op.GELU:
            if act != "none" or res is not None:
                raise NoPlan("one activation, before the residual")
            act = _ACT.get(node.op) or ("gelu_tanh" if node.attrs.approximate == "tanh" else "gelu")
        else:
            raise NoPlan(f"{node.op.value} is not part of a skinny product's epilogue")
        cur = node.output
    return bias, act, res, cur


def _half(node: Node, v: Value) -> int | None:
    """0 / 1 when ``node`` slices ``v``'s first / second half along its last axis, else None."""
    if node.op != Op.SLICE or node.inputs[0] is not v or len(v.shape) < 1:
        return None
    a, last = node.attrs, len(v.shape) - 1
    f = v.shape[-1] // 2
    if v.shape[-1] % 2 or a.axes != (last,) or a.steps != (1,):
        return None
    if (a.starts, a.ends) == ((0,), (f,)):
        return 0
    if (a.starts, a.ends) == ((f,), (2 * f,)):
        return 1
    return None


def _glu_nodes(body: Graph, mm: Node) -> tuple[str, bool, list[Node], Value] | None:
    """(activation, swapped, members, output) when the product's result is read only by the two
    half slices of a gated unit act(half a) * half b, else None."""
    users = body.users()
    readers = users.get(mm.output, [])
    if len(readers) != 2:
        return None
    halves = {h: s for s in readers if (h := _half(s, mm.output)) is not None}
    if len(halves) != 2:
        return None
    for h in (0, 1):
        sa, sb = halves[h], halves[1 - h]
        act_nodes = users.get(sa.output, [])
        if len(act_nodes) != 1 or (act_nodes[0].op not in _ACT and act_nodes[0].op != Op.GELU):
            continue
        an = act_nodes[0]
        muls = users.get(an.output, [])
        if len(muls) != 1 or muls[0].op != Op.MUL or set(map(id, muls[0].inputs)) != {id(an.output), id(sb.output)}:
            continue
        if users.get(sb.output, []) != [muls[0]]:
            continue
        act = _ACT.get(an.op) or ("gelu_tanh" if an.attrs.approximate == "tanh" else "gelu")
        return act, h == 1, [sa, sb, an, muls[0]], muls[0].output
    return None


def emit(ctx: Any, p: Plan, node: Node, label: str) -> None:
    """One GemvSpec launch over the fused node's operands (and the sampler's when it samples); a
    QGemvSpec launch for a product over packed weights."""
    body: Graph = node.attrs.body
    if not p.packed and not getattr(p.mm.attrs, "trans_b", False):
        raise AssertionError(f"{label}: the skinny product's weight is not stored [N, K] (kernel selection's layout)")
    outer: dict[Value, Value] = dict(zip(body.inputs, node.inputs))
    outer.update({c: c for c in body.constants})
    from fusec.passes.select_kernels import selection

    spec = p.spec(**dict(selection(node).params))
    x = outer[p.norm.inputs[0] if p.norm is not None else p.mm.inputs[0]]
    between = [outer[p.norm.inputs[1]]] if p.norm is not None else []
    extra = [outer[v] for v in (p.bias, p.residual) if v is not None]
    weights = [outer[v] for v in p.mm.inputs[1:]]
    if p.siblings:  # one launch: each product's packed operands in turn, then each one's output
        from fusec.lower.quant_emit import emit_qgemv

        made = dict(zip(body.outputs, node.outputs))
        weights += [outer[v] for sib in p.siblings for v in sib.inputs[1:]]
        outs = [made[mm.outputs[0]] for mm in (p.mm, *p.siblings)]
        emit_qgemv(ctx, spec, x, weights, between, extra, outs[0], label, outs[1:], "qgemv siblings")
        return
    if p.wide:
        ctx.kernel(spec, [x, *weights, node.output], f"{label} fusec_gemm")
        return
    if p.sample is None:
        if p.packed:
            from fusec.lower.quant_emit import emit_qgemv

            emit_qgemv(ctx, spec, x, weights, between, extra, node.output, label)
        else:
            ctx.kernel(spec, [x, *weights, *between, *extra, node.output], f"{label} gemv")
        return
    from fusec.codegen.specs_decode import SampleSpec
    from fusec.lower import Raw

    # the logits go to scratch (read only for a row with a top-k/top-p cut), the argmax partials after them
    seed, counter, temperature, top_k, top_p = (outer[v] for v in p.sample.inputs[1:])
    lb = -(-p.out.nbytes // 256) * 256
    base = ctx.scratch(lb + spec.part_floats * 4)
    logits = Raw(base.space, base.offset, p.out.nbytes)
    part = Raw(base.space, base.offset + lb, spec.part_floats * 4)
    scores = [seed, counter, temperature, part]
    if p.packed:
        from fusec.lower.quant_emit import emit_qgemv

        emit_qgemv(ctx, spec, x, weights, between, extra, logits, label, scores, "qgemv+sample scores")
        chunks = spec.parts
    else:
        ctx.kernel(spec, [x, *weights, *between, *extra, logits, *scores], f"{label} gemv+sample scores")
        chunks = spec.tiles
    sampler = SampleSpec(p.m, p.n, p.out.dtype, seed.dtype, counter.dtype, top_k.dtype, chunks=chunks)
    ctx.kernel(sampler, [logits, seed, counter, temperature, top_k, top_p, part, node.output], f"{label} sample")
