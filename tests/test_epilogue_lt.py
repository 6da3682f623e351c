"""GEMM epilogues inside cuBLASLt (fusec.lower.gemm_lt, fusec.runtime.cublaslt).

CPU: which epilogues the lowering puts inside the GEMM and how the plan records it, what it
declines (an erf GELU, SiLU, an activation before a residual), that an explicit "cublas" choice
still gives cuBLAS + the epilogue kernel, the row-major -> column-major problem cuBLASLt is given
(emulated in numpy), the plan check of the new fields, and that the fused node means what the
unfused graph means. GPU (``-m gpu``): every epilogue against the numpy reference, eager and graph.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import fusec
from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph
from fusec.lower.choices import choice_point
from fusec.lower.gemm_lt import lt_epilogue
from fusec.ops import Op
from fusec.plan import Plan
from fusec.planfile import PlanFileError
from fusec.runtime.cublaslt import problem

RNG = np.random.default_rng(7)
M, K, N = 24, 64, 96  # more rows than the skinny product (M <= 16) takes: cuBLAS(Lt)


@pytest.fixture(autouse=True)
def _cublas_for_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """These products have at most 128 rows, which sm_90 runs on fusec's GEMM by default: this file is about the
    cuBLAS/cuBLASLt lowering (FUSEC_GEMM_STREAM=0 keeps it)."""
    monkeypatch.setenv("FUSEC_GEMM_STREAM", "0")


def _graph(bias: bool = True, act: str = "none", residual: bool = False) -> Graph:
    """y = [res +] act(x @ w [+ b]) over fp32 constants (the precision pass stores them as asked)."""
    b = GraphBuilder("epi")
    x = b.input("x", (M, K), DType.F32)
    r = b.input("r", (M, N), DType.F32) if residual else None
    y = b.emit(Op.MATMUL, x, b.const(RNG.standard_normal((K, N)).astype(np.float32) / 8, name="w"))
    if bias:
        y = b.emit(Op.ADD, y, b.const(RNG.standard_normal(N).astype(np.float32), name="bias"))
    if act == "relu":
        y = b.emit(Op.RELU, y)
    elif act in ("gelu", "gelu_tanh"):
        y = b.emit(Op.GELU, y, approximate="tanh" if act == "gelu_tanh" else "none")
    elif act == "silu":
        y = b.emit(Op.SILU, y)
    if r is not None:
        y = b.emit(Op.ADD, r, y)
    b.output(y, "y")
    return b.build()


def _gemms(plan: Plan) -> list[dict]:
    return [L for L in plan.manifest["launches"] if L["type"] == "gemm"]


CASES = [  # (bias, act, residual) -> cuBLASLt epilogue, or None: not inside the GEMM
    ((True, "none", False), "bias"), ((True, "relu", False), "relu_bias"),
    ((True, "gelu_tanh", False), "gelu_bias"), ((False, "gelu_tanh", False), "gelu"),
    ((False, "relu", False), "relu"), ((True, "none", True), "bias"), ((False, "none", True), "default"),
    ((True, "gelu", False), None), ((True, "silu", False), None), ((True, "relu", True), None),
]


@pytest.mark.parametrize("case,epi", CASES, ids=[f"{'bias+' if c[0] else ''}{c[1]}{'+res' if c[2] else ''}" for c, _ in CASES])
def test_lowering_puts_the_epilogue_inside_the_gemm_where_cublaslt_computes_it(case, epi) -> None:
    bias, act, res = case
    plan = fusec.compile(_graph(bias, act, res), dtype="fp16", arch="sm_90")
    gemm, = _gemms(plan)
    kinds = [L["type"] for L in plan.manifest["launches"]]
    by_template = plan.manifest["report"]["lowering"]["by_template"]
    if epi is None:  # cuBLAS, then the epilogue kernel, as before
        assert kinds == ["gemm", "kernel"] and "epilogue" not in gemm and "c_in" not in gemm
        assert "cublaslt_epilogue" not in by_template
        return
    assert kinds == ["gemm"] and gemm["epilogue"] == epi and by_template["cublaslt_epilogue"] == 1
    assert ("bias" in gemm) == bias and ("c_in" in gemm) == res
    assert f"cublaslt[{epi}" in gemm["label"]
    if res:  # the residual is C, added with beta = 1, read from the input's slot
        assert gemm["beta"] == 1.0
        slot = next(d["offset"] for d in plan.manifest["inputs"] if d["name"] == "r")
        assert gemm["c_in"] == ["arena", slot]
    if bias:
        assert gemm["bias"][0] == "weights"


def test_explicit_cublas_choice_keeps_the_separate_epilogue_and_the_variant_is_an_ab_candidate() -> None:
    g = _graph(True, "gelu_tanh", False)
    key = f"gemm_epilogue:f16:{M}x{N}x{K}:bias+gelu_tanh"
    old = fusec.compile(g, dtype="fp16", arch="sm_90", choices={key: "cublas"})
    assert [L["type"] for L in old.manifest["launches"]] == ["gemm", "kernel"] and "epilogue" not in _gemms(old)[0]
    lt = fusec.compile(g, dtype="fp16", arch="sm_90", choices={key: "cublaslt"})
    assert lt.manifest["report"]["lowering"]["choices"]["applied"] == {key: "cublaslt"}
    assert _gemms(lt)[0]["epilogue"] == "gelu_bias"
    from fusec.ab.regions import candidates
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import optimize

    opt, _ = optimize(g, PassOptions(storage_dtype="f16"))
    cp = next(c for n in opt.nodes if (c := choice_point(n)) is not None)
    assert cp.key == key and "cublaslt" in cp.variants
    _, exps = candidates(g, "f16", None)
    assert any(c.kind == "kernel_choice" and c.variant == "cublaslt" and c.key == key for c in exps)


def test_lt_epilogue_declines_what_cublaslt_does_not_compute_exactly() -> None:
    from fusec.codegen.specs import Epilogue

    assert lt_epilogue(Epilogue(bias=True, activation="gelu")) is None  # cuBLASLt's GELU is the tanh form
    assert lt_epilogue(Epilogue(activation="relu", residual=True)) is None  # C is added before the activation
    assert lt_epilogue(Epilogue(bias=True, residual=True)) == "bias"


def test_odd_rows_stay_on_cublas() -> None:
    b = GraphBuilder("odd")
    x = b.input("x", (M, 60), DType.F32)  # K = 60: rows of 120 bytes, not a 16-byte multiple
    y = b.emit(Op.ADD, b.emit(Op.MATMUL, x, b.const(RNG.standard_normal((60, N)).astype(np.float32), name="w")),
               b.const(RNG.standard_normal(N).astype(np.float32), name="bias"))
    b.output(y, "y")
    plan = fusec.compile(b.build(), dtype="fp16", arch="sm_90")
    assert all("epilogue" not in L for L in _gemms(plan))


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False)])
def test_column_major_problem_computes_the_row_major_product(trans_a: bool, trans_b: bool) -> None:
    """Emulate cuBLASLt on the problem() descriptors (column-major reads of the row-major buffers)."""
    m, n, k = 5, 7, 3
    a = RNG.standard_normal((k, m) if trans_a else (m, k))
    b = RNG.standard_normal((n, k) if trans_b else (k, n))
    bias, res = RNG.standard_normal(n), RNG.standard_normal((m, n))
    lda, ldb = a.shape[1], b.shape[1]
    p = problem(m, n, k, lda, ldb, n, 0, 0, m * n, trans_a, trans_b)

    def colmajor(buf: np.ndarray, lay) -> np.ndarray:  # noqa: ANN001
        flat = buf.ravel()
        return np.array([[flat[c * lay.ld + r] for c in range(lay.cols)] for r in range(lay.rows)])

    a_lt = colmajor(b, p.a)  # cuBLASLt's A is fusec's B
    b_lt = colmajor(a, p.b)
    d = (a_lt.T if p.trans_a else a_lt) @ (b_lt.T if p.trans_b else b_lt)
    d = d + colmajor(res, p.d) + bias[:, None]  # C with beta = 1; the bias runs along D's rows
    want = (a.T if trans_a else a) @ (b.T if trans_b else b) + res + bias
    assert d.shape == (p.d.rows, p.d.cols) == (n, m)
    np.testing.assert_allclose(d.T, want, rtol=1e-12)


def test_plan_check_refuses_bad_epilogue_fields() -> None:
    plan = fusec.compile(_graph(True, "none", True), dtype="fp16", arch="sm_90")
    i = next(j for j, L in enumerate(plan.manifest["launches"]) if L["type"] == "gemm")

    def mutated(**change) -> dict:  # noqa: ANN003
        m = copy.deepcopy(plan.manifest)
        m["launches"][i].update(change)
        for k, v in change.items():
            if v is None:
                del m["launches"][i][k]
        return m

    bad = {"epilogue": ("nonsense", "epilogue"), "bias": (None, "bias"),
           "c_in": (["arena", 1 << 40], "c_in")}
    for field, (value, named) in bad.items():
        with pytest.raises(PlanFileError, match=rf"launches\[{i}\]\.{named}"):
            Plan(mutated(**{field: value}), plan.blobs())
    with pytest.raises(PlanFileError, match="epilogue"):
        Plan(mutated(epilogue=["bias"]), plan.blobs())
    Plan(plan.manifest, plan.blobs())  # the untouched plan passes


@pytest.mark.parametrize("case", [c for c, e in CASES if e is not None][:4] + [(True, "none", True)])
def test_fused_node_means_what_the_unfused_graph_means(case) -> None:
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import optimize

    g = _graph(*case)
    opt, _ = optimize(g, PassOptions(storage_dtype="f32"))
    assert any(n.op == Op.FUSED for n in opt.nodes)
    inputs = {v.name: RNG.standard_normal(v.shape).astype(np.float32) for v in g.inputs}
    want = reference.run(g, inputs)["y"]
    np.testing.assert_allclose(reference.run(opt, inputs)["y"], want, rtol=1e-5, atol=1e-5)


# ---- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("case,epi", [(c, e) for c, e in CASES if e is not None],
                         ids=[e + ("+res" if c[2] else "") for c, e in CASES if e is not None])
def test_gpu_lt_epilogue_matches_reference_and_cublas(case, epi, dtype: str) -> None:
    import cupy

    from fusec.ab.decide import TOLERANCE, rel_error
    from fusec.compiler import stage
    from fusec.inputs import random_inputs_for

    g = _graph(*case)
    key = next(c.key for n in stage(g, dtype, "sm_90", dry_run=True).graph.nodes
               if (c := choice_point(n)) is not None)
    outs, inputs, want = {}, None, None
    for variant in ("cublaslt", "cublas"):
        for graph_mode in (False, True):
            plan = fusec.compile(g, dtype=dtype, choices={key: variant}, cuda_graph=graph_mode)
            assert (_gemms(plan)[0].get("epilogue") == epi) == (variant == "cublaslt")
            if inputs is None:  # fresh inputs in the plan's storage dtype; the reference reads the same values
                inputs = random_inputs_for(plan.manifest["inputs"], int(RNG.integers(1 << 30)))
                want = reference.run(g, {k: v.astype(np.float32) for k, v in inputs.items()})["y"].astype(np.float64)
            got = cupy.asnumpy(plan.run(inputs)["y"])
            if dtype == "bf16":
                got = got.view(DType.BF16.np)
            outs[variant, graph_mode] = got.astype(np.float64)
            assert plan.stats().get("pool_allocations") == 0
    tol = {"fp16": 2e-3, "bf16": 1e-2, "fp32": 1e-5}[dtype]
    for (variant, graph_mode), y in outs.items():
        assert rel_error({"y": y}, {"y": want}) < tol, (variant, graph_mode)
    assert np.array_equal(outs["cublaslt", False], outs["cublaslt", True])  # capture replays the same call
    assert rel_error({"y": outs["cublaslt", False]}, {"y": outs["cublas", False]}) < TOLERANCE[dtype]


class _FakeLt:
    """Stands in for libcublasLt: hands out handles, records every attribute and call."""

    def __init__(self, algos: int = 1) -> None:
        self.algos, self.next, self.attrs, self.layouts, self.calls, self.destroyed = algos, 100, {}, {}, [], []

    def _new(self, ref) -> int:  # noqa: ANN001
        self.next += 1
        ref._obj.value = self.next
        return 0

    def cublasLtMatmulDescCreate(self, ref, compute, scale):  # noqa: ANN001, ANN201, N802
        self.compute, self.scale = compute, scale
        return self._new(ref)

    def cublasLtMatrixLayoutCreate(self, ref, t, rows, cols, ld):  # noqa: ANN001, ANN201, N802
        self._new(ref)
        self.layouts[self.next] = (t, rows, cols, ld)
        return 0

    def cublasLtMatmulPreferenceCreate(self, ref):  # noqa: ANN001, ANN201, N802
        return self._new(ref)

    def _set(self, obj, attr, ref, size):  # noqa: ANN001, ANN201
        self.attrs[(obj, attr)] = ref._obj.value
        return 0

    cublasLtMatmulDescSetAttribute = cublasLtMatmulPreferenceSetAttribute = cublasLtMatrixLayoutSetAttribute = _set

    def cublasLtMatmulAlgoGetHeuristic(self, h, desc, a, b, c, d, pref, n, heur, count):  # noqa: ANN001, ANN201, N802
        self.heuristic_layouts = (a, b, c, d)
        self.asked = n
        for i in range(min(n, self.algos)):  # candidate i is algorithm 42 + i, best first
            heur[i].algo.data[0] = 42 + i
        count._obj.value = min(n, self.algos)
        return 0

    def cublasLtMatmul(self, *args):  # noqa: ANN002, ANN201, N802
        self.calls.append(args)
        return 0

    def __getattr__(self, name: str):  # the Destroy functions
        if name.endswith("Destroy"):
            return lambda ptr: self.destroyed.append(ptr)
        raise AttributeError(name)


def test_lt_matmul_binds_the_problem_cublaslt_is_given(monkeypatch) -> None:  # noqa: ANN001
    """The descriptors LtMatmul sets (a fake libcublasLt records them): ops, layouts, epilogue, bias,
    C = the residual with D the output, operand alignment for the heuristic, one call per run."""
    import ctypes

    from fusec.runtime import cublaslt
    from fusec.runtime.cublas import GemmCall

    fake = _FakeLt()
    monkeypatch.setattr(cublaslt, "_lib", lambda: fake)
    call = GemmCall(m=64, n=96, k=32, batch=1, a=0x10000, b=0x20010, c=0x30000, lda=32, ldb=32, ldc=96,
                    stride_a=0, stride_b=0, stride_c=64 * 96, trans_a=False, trans_b=True, dtype="bf16",
                    compute="f32", beta=1.0, epilogue="gelu_bias", bias=0x40000, c_in=0x50000)
    lt = cublaslt.LtMatmul(call, 7, 0x60000, 1 << 20)
    assert fake.compute == 68 and fake.scale == 0  # CUBLAS_COMPUTE_32F, fp32 alpha/beta
    assert fake.attrs[(lt.desc, 3)] == 1 and fake.attrs[(lt.desc, 4)] == 0  # cuBLASLt's A = fusec's B, transposed
    assert fake.attrs[(lt.desc, 7)] == cublaslt.EPILOGUES["gelu_bias"] and fake.attrs[(lt.desc, 8)] == 0x40000
    a, b, c, d = (fake.layouts[x] for x in lt.layouts)
    assert a == (14, 32, 96, 32) and b == (14, 32, 64, 32) and c == d == (14, 96, 64, 96)  # column-major views
    assert lt.ptrs == (0x20010, 0x10000, 0x50000, 0x30000)  # C is the residual, D the output
    align = {k: v for (obj, k), v in fake.attrs.items() if k in (5, 6, 7, 8) and obj not in (lt.desc,)}
    assert align == {5: 16, 6: 256, 7: 256, 8: 256}  # B at 0x20010 is 16-byte aligned only
    lt(0xABC)
    (args,) = fake.calls
    assert args[-1] == 0xABC and ctypes.cast(args[2], ctypes.POINTER(ctypes.c_float))[1] == 1.0  # beta
    assert [args[i].value for i in (3, 5, 8, 10)] == [0x20010, 0x10000, 0x50000, 0x30000]  # A, B, C, D
    assert [args[i].value for i in (4, 6, 9, 11)] == list(lt.layouts) and args[0].value == 7
    lt.close()
    assert set(fake.destroyed) >= set(lt.layouts) | {lt.desc}
    fake.algos = 0
    with pytest.raises(RuntimeError, match="no algorithm"):
        cublaslt.LtMatmul(call, 7, 0x60000, 1 << 20)
    with pytest.raises(RuntimeError, match="bias"):
        cublaslt.LtMatmul(GemmCall(**{**call.__dict__, "bias": None, "_scalars": None, "_lt": None}), 7, 0, 0)
