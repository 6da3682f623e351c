"""The quantized GEMV's norm prologue and gated epilogue (CPU: plans compiled for sm_90 with NVRTC,
nothing runs; tests/test_quant_gpu.py runs the kernels). A packed product whose rule form is the FMA
or dp4a form takes the RMSNorm before it and the SwiGLU after it, as decode's bf16 products do: a layer is
five launches. Where the rule puts it on tensor cores, fusion declines the norm and says why; the gated unit is the
tensor-core form's epilogue."""

from __future__ import annotations

import pytest

from fusec.codegen import kernels as K
from fusec.codegen.specs import Epilogue
from fusec.codegen.specs_quant import QNORM_SMEM, QGemvSpec
from fusec.compiler import compile_generation
from fusec.dtypes import DType
from fusec.plan import entry_points


def _plan(batch: int, disabled: tuple[str, ...] = ()):  # noqa: ANN202
    return compile_generation("llama-tiny", batch=batch, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90", quantize="int4", quantize_group=32, disabled_fusions=disabled)


def _decode(plan) -> list[dict]:  # noqa: ANN001
    return [L for L in entry_points(plan.manifest)["decode"]["launches"] if L["type"] == "kernel"]


def _sources(plan, launches: list[dict]) -> list[str]:  # noqa: ANN001
    m = plan.manifest
    modules = {mod["id"]: mod for mod in m["modules"]}
    return [plan._blobs[modules[m["kernels"][L["kernel"]]["module"]]["source"]].decode() for L in launches]


@pytest.mark.parametrize("batch,form", [(1, "dp4a"), (3, "dp4a"), (1, "fma")])
def test_few_row_packed_products_take_the_norm_and_the_gated_unit(batch: int, form: str, monkeypatch) -> None:  # noqa: ANN001
    """Up to 3 rows of bf16 x the rule's form is the dp4a one (FUSEC_QGEMV_FORM=fma: the FMA form); both
    take the norm and the gated unit."""
    if form == "fma":
        monkeypatch.setenv("FUSEC_QGEMV_FORM", "fma")
    fused, plain = _plan(batch), _plan(batch, ("norm_gemm", "gated_epilogue"))
    layers = fused.manifest["generation"]["num_layers"]
    # per layer the two RMSNorms and the SwiGLU go into the packed products (and the final norm into the
    # LM head: a bf16 product here, the rule leaves it unquantized)
    assert len(_decode(plain)) - len(_decode(fused)) == 3 * layers + 1
    q = [L for L in _decode(fused) if "qgemv" in L["label"]]
    src = _sources(fused, q)
    assert src and all(("dp4a.u32.s32" in s) == (form == "dp4a") for s in src)
    norms = [s for s in src if ("float inv[M_];" if form == "dp4a" else "s_xn[M_ * QB_K]") in s]
    gated = [s for s in src if "#define F_" in s]
    assert len(norms) == 2 * layers and len(gated) == layers  # qkv and gate/up normalize; gate/up is gated
    assert all("fc_act_silu(first)" in s for s in gated)
    applied = [f for f in fused.manifest["reports"]["decode"]["fusions"]
               if f["rule"] in ("norm_gemm", "gated_epilogue") and f["decision"] == "applied"]
    assert len(applied) == 3 * layers + 1


def test_tensor_core_rows_keep_the_norm_apart_and_take_the_gated_unit(monkeypatch) -> None:  # noqa: ANN001
    """At 8 rows the rule's int4 form is the tensor-core one: no norm prologue there (fusion says why), but the gated
    epilogue (8 rows of each half a block); with FUSEC_QGEMV_TC_GATE=0 the SwiGLU runs apart and fusion names the
    knob."""
    plan = _plan(8)
    q = [L for L in _decode(plan) if "qgemv" in L["label"]]
    assert q and not any("s_xn" in s for s in _sources(plan, q))
    assert any("rmsnorm" in L["label"] for L in _decode(plan))
    fusions = plan.manifest["reports"]["decode"]["fusions"]
    why = [f["reason"] for f in fusions if f["rule"] == "norm_gemm" and f["decision"] == "rejected"]
    assert why and all("tensor-core quantized GEMV" in r for r in why)
    layers = plan.manifest["generation"]["num_layers"]
    gated = [s for s in _sources(plan, q) if "#define GLU 1" in s]
    assert len(gated) == layers and all("fc_act_silu(first)" in s for s in gated)
    monkeypatch.setenv("FUSEC_QGEMV_TC_GATE", "0")
    apart = _plan(8)
    assert len(_decode(apart)) == len(_decode(plan)) + layers
    rejected = [f for f in apart.manifest["reports"]["decode"]["fusions"] if f["rule"] == "gated_epilogue"
                and f["decision"] == "rejected" and len(f["members"]) > 2]
    assert rejected and all("FUSEC_QGEMV_TC_GATE=0" in f["reason"] for f in rejected)  # the whole unit's reason


@pytest.mark.parametrize("fmt,group", [("q4_k", 32), ("q6_k", 16), ("int4", 32), ("q8_0", 32)])
def test_the_fused_forms_compile_for_sm_80_and_sm_90(fmt: str, group: int) -> None:
    spec = QGemvSpec(1, 2 * 77, 512, fmt, group, DType.BF16, DType.F16, Epilogue(bias=True, residual=True),
                     norm=True, eps=1e-5, weight_offset=1.0, glu="silu")
    for arch in ("sm_80", "sm_90"):
        ck = K.build(spec, arch)
        assert ck.binary.spill_bytes == 0
    assert spec.n_out == 77


def test_the_spec_refuses_what_the_kernel_does_not_do() -> None:
    base = dict(fmt="int4", group=32, dtype=DType.BF16, scale_dtype=DType.F16)
    with pytest.raises(ValueError, match="norm prologue is the FMA and dp4a forms"):
        QGemvSpec(4, 64, 512, norm=True, tc=True, warps=4, **base)
    with pytest.raises(ValueError, match="2 rows a warp"):
        QGemvSpec(1, 64, 512, glu="silu", rows=1, **base)
    with pytest.raises(ValueError, match="even number of weight rows"):
        QGemvSpec(1, 63, 512, glu="silu", **base)
    with pytest.raises(ValueError, match="shared memory"):
        QGemvSpec(16, 64, QNORM_SMEM // 16, norm=True, rows=1, **base)
    with pytest.raises(ValueError, match="own activation"):
        QGemvSpec(1, 64, 512, glu="silu", epilogue=Epilogue(activation="silu"), **base)


def test_fused_packed_products_run_the_form_kernel_selection_recorded(monkeypatch) -> None:  # noqa: ANN001
    """The lowering decides nothing: a form the rule does not pick at one row (FMA, no fold), put into the
    record, is what every packed launch runs, the fused ones (norm, gated unit) included."""
    from fusec.passes import select_kernels

    monkeypatch.setattr(select_kernels, "_qgemv_params", lambda *_: (("rows", 2), ("fold", False)))
    plan = _plan(1)
    q = [L for L in _decode(plan) if "qgemv" in L["label"]]
    src = _sources(plan, q)
    assert any("s_xn[M_ * QB_K]" in s for s in src) and any("#define F_" in s for s in src)
    assert all("qb_w8(ch[u][r]" in s and "qb_d8(ch[u][r]" not in s for s in src)
    monkeypatch.undo()
    plan = _plan(1)
    q = [L for L in _decode(plan) if "qgemv" in L["label"]]
    assert all("dp4a.u32.s32" in s for s in _sources(plan, q))  # the rule's form at one row of bf16 x


def test_fewer_gemv_rows_send_the_products_through_the_dequantizing_path(monkeypatch) -> None:  # noqa: ANN001
    """FUSEC_QGEMV_MAX_ROWS below a decode step's rows of x sends its packed products through the prefill's path
    (dequantize the weight to scratch, then cuBLAS): no quantized GEMV, no norm prologue or gated unit fused into
    a product; the step's launch records are kernels and GEMMs, counted by the lowering. Out of range is refused,
    naming the variable."""
    from fusec.errors import InputError

    default = _plan(4)
    by = default.manifest["reports"]["decode"]["lowering"]["by_template"]
    assert by.get("qmatmul:qgemv", 0) > 0 and not by.get("qmatmul:dequant_gemm")
    monkeypatch.setenv("FUSEC_QGEMV_MAX_ROWS", "2")
    monkeypatch.setenv("FUSEC_QGEMM", "scratch")  # not the dequantize-in-tile GEMM, which bf16 x would take
    plan = _plan(4)
    by = plan.manifest["reports"]["decode"]["lowering"]["by_template"]
    layers = plan.manifest["generation"]["num_layers"]
    assert not by.get("qmatmul:qgemv") and by["qmatmul:dequant_gemm"] >= 4 * layers, by  # qkv, o, gate/up, down
    launches = entry_points(plan.manifest)["decode"]["launches"]
    assert sum(L["type"] == "gemm" for L in launches) >= 4 * layers
    assert not any("qgemv" in L.get("label", "") for L in launches)
    # the layers' norms launch alone (the dequantizing path takes no prologue); so does the SwiGLU
    assert sum(L.get("label", "").endswith(" rmsnorm") for L in launches) == 2 * layers
    assert not any("gated_epilogue" in L.get("label", "") for L in launches)
    assert _plan(2).manifest["reports"]["decode"]["lowering"]["by_template"].get("qmatmul:qgemv", 0) > 0  # 2 rows fit
    monkeypatch.setenv("FUSEC_QGEMV_MAX_ROWS", "17")
    with pytest.raises(InputError, match="FUSEC_QGEMV_MAX_ROWS"):
        _plan(4)


def test_past_eight_rows_only_the_tensor_core_form_takes_a_decode_steps_products(monkeypatch) -> None:  # noqa: ANN001
    """Past 8 rows of x the quantized GEMV takes a packed product only in its tensor-core form (two tiles of 8 rows;
    before, its FMA form took them, 3.8x slower in the Llama-1B Q4_K_M step at batch 16 than the prefill's paths): a
    bf16 batch-9 and batch-16 decode step runs every packed product on it, the gate/up with its gated epilogue; an fp32
    one (the mma takes fp16/bf16) runs none, every packed product a prefill's path; FUSEC_QGEMV_MAX_ROWS=8 gives rows
    9-16 to the prefill's paths (the A/B's other side). The kernels' sources say two tiles."""
    from fusec.lower.quant import qgemv_max_rows, qgemv_takes

    assert qgemv_max_rows() == 16
    for batch in (9, 16):
        plan = _plan(batch)
        by = plan.manifest["reports"]["decode"]["lowering"]["by_template"]
        assert by.get("qmatmul:qgemv", 0) > 0 and not by.get("qmatmul:qgemm") and not by.get("qmatmul:dequant_gemm"), by
        tc = [src for src in _sources(plan, _decode(plan)) if "#define XT " in src]  # the tensor-core form's
        assert len(tc) == by["qmatmul:qgemv"] and all("#define XT 2" in src for src in tc), (batch, by)
        assert any("gated_epilogue" in L["label"] for L in _decode(plan)), batch
    assert not qgemv_takes(9, 256, 128, "int4", 32, DType.F32) and qgemv_takes(9, 256, 128, "int4", 32, DType.BF16)
    fp32 = compile_generation("llama-tiny", batch=9, max_seq_len=64, prefill_len=8, dtype="fp32", eos_ids=[],
                              arch="sm_90", quantize="int4", quantize_group=32)
    by = fp32.manifest["reports"]["decode"]["lowering"]["by_template"]
    assert not by.get("qmatmul:qgemv") and by.get("qmatmul:dequant_gemm", 0) > 0, by
    monkeypatch.setenv("FUSEC_QGEMV_MAX_ROWS", "8")
    by = _plan(9).manifest["reports"]["decode"]["lowering"]["by_template"]
    assert not by.get("qmatmul:qgemv") and by.get("qmatmul:qgemm", 0) + by.get("qmatmul:dequant_gemm", 0) > 0, by
    assert _plan(8).manifest["reports"]["decode"]["lowering"]["by_template"].get("qmatmul:qgemv", 0) > 0


def test_wide_gate_sends_the_gated_unit_apart_for_the_dp4a_form(monkeypatch) -> None:  # noqa: ANN001
    """At 8 rows of x, without the tensor-core form (FUSEC_QGEMV_FORM=dp4a), an int8 gate/up product takes the dp4a form
    with its norm, and the SwiGLU runs apart (fusion asks skinny.qfits, which says why); FUSEC_QGEMV_WIDE_GATE=fma gives
    the FMA form with the gated unit, as before."""
    monkeypatch.setenv("FUSEC_QGEMV_FORM", "dp4a")

    def plan8():  # noqa: ANN202
        return compile_generation("llama-tiny", batch=8, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[],
                                  arch="sm_90", quantize="int8")

    plan = plan8()
    launches = _decode(plan)
    assert not any("gated_epilogue" in L["label"] for L in launches)
    srcs = _sources(plan, launches)
    big = [src for L, src in zip(launches, srcs) if "norm_gemm" in L["label"] and "dp4a.s32" in src]
    layers = plan.manifest["generation"]["num_layers"]
    assert len(big) >= 2 * layers  # the qkv and the gate/up products, each with its norm, on dp4a
    assert sum("elementwise" in L["label"] for L in launches) >= layers  # the SwiGLU apart
    monkeypatch.setenv("FUSEC_QGEMV_WIDE_GATE", "fma")
    plan = plan8()
    launches = _decode(plan)
    gated = [src for L, src in zip(launches, _sources(plan, launches)) if "gated_epilogue" in L["label"]]
    assert len(gated) == layers and not any("dp4a.s32" in src for src in gated)  # the FMA form takes the gated unit
