"""Weights have one owner: pad_gemm (N padded to 16 bytes in the IR), transpose flags (MATMUL
trans_b), select_kernels (the layout a chosen kernel reads), and a lowering that copies no weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import fusec
from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ir import Graph, print_graph, verify
from fusec.lower import lower
from fusec.lower.choices import choice_point
from fusec.ops import MatMulAttrs, Op
from fusec.passes import merge_gemms, pad_gemm, select_kernels, transpose_cache
from fusec.passes.base import PassOptions
from fusec.passes.memory_plan import plan_memory

RNG = np.random.default_rng(20261123)
F, H = DType.F32, DType.F16


def _run(mod, g: Graph, opts: PassOptions | None = None) -> tuple[Graph, PassOptions]:  # type: ignore[no-untyped-def]
    opts = opts or PassOptions()
    out = mod.run(g, opts).graph
    verify(out)
    return out, opts


def _same(g0: Graph, g1: Graph, vocab: int = 10) -> None:
    inputs = {v.name: (RNG.integers(0, vocab, v.shape) if v.dtype.is_int else RNG.standard_normal(v.shape))
              .astype(v.dtype.np) for v in g0.inputs}
    r0, r1 = reference.run(g0, inputs), reference.run(g1, inputs)
    for k in r0:
        np.testing.assert_allclose(r1[k].astype(np.float32), r0[k].astype(np.float32), rtol=2e-3, atol=2e-3)


def _legal(g: Graph) -> Graph:
    try:
        from fusec.lower.legalize import legalize
    except ImportError:  # fusion forms only groups that lower: nothing to legalize
        return g
    return legalize(g)


def _odd(n: int = 1001, bias: bool = True, dtype: DType = H) -> Graph:
    b = GraphBuilder("odd")
    x = b.input("x", (2, 5, 64), dtype)
    y = b.emit(Op.MATMUL, x, b.const(RNG.standard_normal((64, n)).astype(np.float32) * 0.1, name="w", dtype=dtype))
    if bias:
        y = b.emit(Op.ADD, y, b.const(RNG.standard_normal(n).astype(np.float32), name="bias", dtype=dtype))
    b.output(b.emit(Op.RELU, y), "y")
    return b.build()


def _tied(vocab: int = 1001, dim: int = 64, dtype: DType = H, rows: tuple[int, int] = (2, 4)) -> Graph:
    b = GraphBuilder("tied")
    ids = b.input("ids", rows, DType.I64)
    table = b.const(RNG.standard_normal((vocab, dim)).astype(np.float32), name="embed.weight", dtype=dtype)
    x = b.emit(Op.GATHER, table, ids, axis=0)
    b.output(b.emit(Op.MATMUL, x, b.emit(Op.TRANSPOSE, table, perm=(1, 0))), "logits")
    return b.build()


# ---- pad_gemm ---------------------------------------------------------------------------------

def test_odd_n_weight_and_bias_are_padded_in_the_ir_then_sliced() -> None:
    g = _odd()
    out, opts = _run(pad_gemm, g)
    ops = [n.op for n in out.nodes]
    assert ops == [Op.MATMUL, Op.ADD, Op.SLICE, Op.RELU]
    mm, add, sl = out.nodes[:3]
    assert mm.inputs[1].shape == (64, 1008) and mm.output.shape == (2, 5, 1008)
    assert add.inputs[1].shape == (1008,) and sl.output.shape == (2, 5, 1001)
    assert {c.name for c in out.constants} == {"w.pad1008", "bias.pad1008"}  # the unpadded ones died
    assert out.meta["gemms_padded"] == 1 and "pad_gemm_extra_bytes" not in opts.stats
    _same(g, out)


def test_alignment_is_16_bytes_of_the_storage_dtype_and_aligned_n_is_left_alone() -> None:
    out, _ = _run(pad_gemm, _odd(1001, bias=False, dtype=F))
    assert out.nodes[0].inputs[1].shape == (64, 1004)  # fp32: 4 elements
    for n, dt in ((1008, H), (1004, F)):
        same, _ = _run(pad_gemm, _odd(n, dtype=dt))
        assert same.meta["gemms_padded"] == 0 and [x.op for x in same.nodes] == [Op.MATMUL, Op.ADD, Op.RELU]


def test_tied_embedding_is_flagged_padded_once_and_the_gather_reads_the_padded_table() -> None:
    g = _tied()
    t, opts = _run(transpose_cache, g)
    out, opts = _run(pad_gemm, t, opts)
    gather, mm, sl = out.nodes
    assert gather.op == Op.GATHER and mm.op == Op.MATMUL and sl.op == Op.SLICE
    assert mm.attrs.trans_b and mm.inputs[1] is gather.inputs[0] and mm.inputs[1].shape == (1008, 64)
    assert [c.name for c in out.constants] == ["embed.weight.pad1008"]
    assert out.weight_bytes == 1008 * 64 * 2 and "pad_gemm_extra_bytes" not in opts.stats
    _same(g, out, vocab=1001)


def test_a_padded_weight_read_elsewhere_is_kept_and_counted() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 8), F)
    w = b.const(RNG.standard_normal((8, 7)).astype(np.float32), name="w")
    b.output(b.emit(Op.MATMUL, x, w), "y")
    b.output(b.emit(Op.ADD, w, w), "z")
    g = b.build()
    out, opts = _run(pad_gemm, g)
    assert {c.name for c in out.constants} == {"w", "w.pad8"} and opts.stats["pad_gemm_extra_bytes"] == 8 * 7 * 4
    _same(g, out)


def test_merge_of_flagged_weights_concatenates_rows() -> None:
    b = GraphBuilder()
    x = b.input("x", (3, 8), F)
    for i, n in enumerate((4, 12)):
        w = b.const(RNG.standard_normal((n, 8)).astype(np.float32), name=f"p{i}.weight")
        b.output(b.emit(Op.MATMUL, x, w, trans_b=True), f"y{i}")
    g = b.build()
    out, _ = _run(merge_gemms, g)
    mm = next(n for n in out.nodes if n.op == Op.MATMUL)
    assert mm.attrs.trans_b and mm.inputs[1].shape == (16, 8) and out.meta["gemms_merged"] == 1
    _same(g, out)


# ---- the whole pipeline and the lowering ---------------------------------------------------------

def test_tied_lm_head_compiles_to_one_table_a_trans_b_gemm_and_no_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_GEMM_STREAM", "0")  # cuBLAS's product (sm_90 runs few rows on fusec's GEMM)
    g = _tied(rows=(4, 8))  # 32 rows: cuBLAS (16 or fewer take the skinny product)
    plan = fusec.compile(g, dtype="fp16", arch="sm_90")
    gemm = [L for L in plan.manifest["launches"] if L["type"] == "gemm"]
    assert len(gemm) == 1 and gemm[0]["trans_b"] and gemm[0]["n"] == 1008 and gemm[0]["ldb"] == 64
    mem = plan.manifest["memory"]
    assert mem["scratch_bytes"] == 0
    assert mem["weights_bytes"] == -(-1008 * 64 * 2 // 256) * 256  # the table, once, padded by 7 rows


def test_matmul_trans_b_is_reference_checked_and_printed() -> None:
    b = GraphBuilder()
    x = b.input("x", (2, 3, 8), F)
    w = b.const(RNG.standard_normal((5, 8)).astype(np.float32), name="w")
    b.output(b.emit(Op.MATMUL, x, w, trans_b=True), "y")
    g = b.build()
    xin = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(reference.run(g, {"x": xin})["y"], xin @ w.data.T, rtol=1e-5, atol=1e-5)
    assert "matmul[trans_b=True]" in print_graph(g)
    assert MatMulAttrs() == MatMulAttrs(trans_b=False) and "trans_b" not in print_graph(_odd())


def test_trans_b_matmul_exports_to_onnx(tmp_path: Path) -> None:
    ort = pytest.importorskip("onnxruntime")
    from fusec.onnx_export import export_onnx

    b = GraphBuilder()
    x = b.input("x", (2, 3, 8), F)
    b.output(b.emit(Op.MATMUL, x, b.const(RNG.standard_normal((5, 8)).astype(np.float32), name="w"), trans_b=True), "y")
    g = b.build()
    export_onnx(g, tmp_path / "m.onnx")
    xin = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": xin})[0]
    np.testing.assert_allclose(got, reference.run(g, {"x": xin})["y"], rtol=1e-5, atol=1e-5)


def _small_m(rows: int = 2) -> Graph:
    b = GraphBuilder("gemv")
    x = b.input("x", (rows, 64), F)
    w = b.const(RNG.standard_normal((64, 128)).astype(np.float32), name="w")
    bias = b.const(RNG.standard_normal(128).astype(np.float32), name="bias")
    b.output(b.emit(Op.ADD, b.emit(Op.MATMUL, x, w), bias), "y")
    return b.build()


KEY = "gemm_epilogue:f16:2x128x64:bias"


def test_gemv_choice_stores_the_weight_nk_in_the_ir_and_the_lowering_copies_nothing() -> None:
    g = _small_m()
    default = fusec.compile(g, dtype="fp16", arch="sm_90")
    p = fusec.compile(g, dtype="fp16", arch="sm_90", choices={KEY: "gemv"})
    assert p.manifest["report"]["lowering"]["choices"]["applied"] == {KEY: "gemv"}
    rec, = p.manifest["report"]["weights_relaid"]
    assert rec["weight"] == "w" and rec["shape"] == [128, 64]
    assert p.manifest["memory"]["weights_bytes"] == default.manifest["memory"]["weights_bytes"]  # replaced, not added


def test_layout_variants_are_choices_and_apply_through_the_pass(tmp_path: Path) -> None:
    from fusec.loader import load_graph
    from fusec.passes.pipeline import optimize

    key = "gemm_epilogue:f16:40x128x64:bias"  # 40 rows: more than the skinny product takes
    o, _ = optimize(_small_m(40), PassOptions(storage_dtype="f16"))
    cp = choice_point(_legal(o).nodes[0])
    assert cp is not None and cp.key == key and not cp.trans_b
    assert cp.variants == ("cublas", "fusec_gemm", "transpose_flag", "cublaslt")  # + bias inside cuBLASLt
    p = fusec.compile(_small_m(40), dtype="fp16", arch="sm_90", choices={key: "transpose_flag"}, dump_dir=tmp_path)
    assert p.manifest["report"]["lowering"]["choices"]["applied"] == {key: "transpose_flag"}
    gemm = [L for L in p.manifest["launches"] if L["type"] == "gemm"]
    assert gemm[0]["trans_b"] and gemm[0]["ldb"] == 64
    dump = (tmp_path / sorted(f.name for f in tmp_path.iterdir() if "select_kernels" in f.name)[0]).read_text()
    assert "w.nk" in dump
    # tied lm_head: the flag is the default, the cached transpose the alternative
    tied = _legal(optimize(load_graph(_tied(vocab=1000)), PassOptions(storage_dtype="f16"))[0])
    cp = next(c for n in tied.nodes if (c := choice_point(n)) is not None)
    # gemv reads the table as is; fusec's GEMM (its stream form: 8 rows, K 64) would read a [K, N] copy
    assert cp.trans_b and cp.variants == ("cublas", "gemv", "fusec_gemm", "cached_transpose")
    assert next(n for n in tied.nodes if choice_point(n) is not None).kernel.variant == "gemv"  # 8 rows


def test_the_lowering_decides_nothing_a_choice_given_only_to_it_is_declined() -> None:
    from fusec.passes.pipeline import optimize

    o = _legal(optimize(_big_m(), PassOptions(storage_dtype="f16"))[0])  # no choices: the rule-based selection
    mp = plan_memory(o)
    low = lower(o, mp.offsets, "sm_90", dry_run=True, arena_base=mp.arena_bytes, choices={BIG_KEY: "gemv"})
    assert "not applied" in low.report["choices"]["declined"][BIG_KEY]
    assert "gemv" not in low.report["by_template"] and low.report["by_template"].get("cublas_gemm") == 1


def test_selection_without_choices_relays_only_what_the_rule_picks() -> None:
    from fusec.passes import fusion

    big = _big_m()  # 40 rows: cuBLAS reads the weight as it is
    out, _ = _run(select_kernels, fusion.run(big, PassOptions()).graph)
    assert [n.op for n in out.nodes] == [n.op for n in fusion.run(big, PassOptions()).graph.nodes]
    assert out.meta["weights_relaid"] == [] and all(n.kernel is not None for n in out.nodes)
    small, _ = _run(select_kernels, fusion.run(_small_m(), PassOptions()).graph)  # 2 rows: the skinny product
    rec, = small.meta["weights_relaid"]
    assert rec["variant"] == "gemv" and rec["shape"] == [128, 64]


def _big_m() -> Graph:
    b = GraphBuilder("gemm")
    x = b.input("x", (40, 64), F)
    w = b.const(RNG.standard_normal((64, 128)).astype(np.float32), name="w")
    b.output(b.emit(Op.MATMUL, x, w), "y")
    return b.build()


BIG_KEY = "matmul:f16:40x128x64"
