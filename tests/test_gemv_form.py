"""How the skinny product (decode's GemvSpec) streams its weights: the rule (build_gemm.gemv_form),
the kernel selection's record of it, and the lowering emitting exactly the recorded form (CPU: the
plans are compiled for sm_90 with NVRTC, nothing runs)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fusec.codegen import specs as S
from fusec.codegen.build_gemm import gemv_blocks_per_sm, gemv_form, gemv_ring_bytes
from fusec.codegen.kernels import cdiv, prepare
from fusec.codegen.spec_base import SMS
from fusec.compiler import compile_generation
from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.passes import select_kernels
from fusec.plan import entry_points

SHAPES = [(4096, 1024, False), (1024, 2048, False), (6144, 1024, True), (1024, 3072, False), (151936, 1024, False),
          (3072, 2048, False), (16384, 2048, True), (2048, 8192, False), (128256, 2048, False), (77, 72, False),
          (200, 4160, True), (11008, 4096, False), (4096, 11008, False)]


@pytest.mark.parametrize("dt", [DType.BF16, DType.F16, DType.F32])
@pytest.mark.parametrize("n,k,glu", SHAPES)
def test_the_rule_spreads_tiles_over_one_wave_of_blocks_that_fit(n: int, k: int, glu: bool, dt: DType) -> None:
    form = gemv_form(n, k, dt, glu)
    stages, tpb = form["stages"], form["tiles_per_block"]
    spec = S.GemvSpec(1, n, k, dt, glu="silu" if glu else "", **form)
    slots = SMS * gemv_blocks_per_sm(k, dt, stages)
    assert stages >= 2 and 1 <= tpb <= 4
    # the fewest tiles per block (at most 4) that keep the grid within one wave of resident blocks
    assert spec.grid <= slots or tpb == 4
    assert tpb == 1 or cdiv(spec.tiles, tpb - 1) > slots
    r, _ = prepare(spec)
    assert r.shared_mem == gemv_ring_bytes(k, dt, stages) <= 227 * 1024
    assert r.grid[0] == spec.grid == cdiv(spec.tiles, tpb)


def test_the_knob_picks_the_register_form(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FUSEC_GEMV_FORM", "register")
    assert gemv_form(128256, 2048, DType.BF16) == {"stages": 0, "tiles_per_block": 1}
    monkeypatch.setenv("FUSEC_GEMV_FORM", "rings")
    with pytest.raises(InputError, match="FUSEC_GEMV_FORM"):
        gemv_form(128256, 2048, DType.BF16)


def _gemv_launches(plan) -> list[tuple[dict, str]]:  # noqa: ANN001
    """(launch, kernel source) of every skinny-product launch of the decode entry."""
    m = plan.manifest
    modules = {mod["id"]: mod for mod in m["modules"]}
    out = []
    for L in entry_points(m)["decode"]["launches"]:
        if L["type"] != "kernel":
            continue
        mod = modules[m["kernels"][L["kernel"]]["module"]]
        if mod["template"] == "gemv.cu.jinja":
            out.append((L, plan._blobs[mod["source"]].decode()))
    return out


def _define(source: str, name: str) -> int | None:
    hit = re.search(rf"^#define {name} (\d+)$", source, re.M)
    return int(hit.group(1)) if hit else None


def test_the_lowering_emits_the_form_kernel_selection_recorded(monkeypatch) -> None:  # noqa: ANN001
    """A form the rule would never pick, put into the record: every skinny launch of the plan has
    it (the lowering decides nothing), and the record shows in the selection."""
    monkeypatch.setattr(select_kernels, "_gemv_params",
                        lambda n, k, dtype, glu=False, m=1, norm=False: (("stages", 2), ("tiles_per_block", 3)))
    plan = compile_generation("llama-tiny", batch=1, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    launches = _gemv_launches(plan)
    assert len(launches) >= 4  # every product of a layer, and the LM head
    for L, src in launches:
        assert _define(src, "STAGES") == 2, L["label"]
        assert L["grid"][0] == cdiv(_define(src, "TILES"), 3), L["label"]


def test_the_default_plan_records_and_emits_the_rule(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("FUSEC_GEMV_FORM", raising=False)
    plan = compile_generation("llama-tiny", batch=1, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    for L, src in _gemv_launches(plan):
        want = gemv_form(_define(src, "N_"), _define(src, "K_"), DType.BF16)  # a gated unit tiles alike
        assert _define(src, "STAGES") == want["stages"], L["label"]
        assert L["grid"][0] == cdiv(_define(src, "TILES"), want["tiles_per_block"]), L["label"]


def test_a_quantized_plan_emits_the_gemv_form_kernel_selection_recorded(monkeypatch) -> None:  # noqa: ANN001
    """The packed-weight GEMV's form comes from the record too: forms the rule never picks at one row
    of int4 weights (the FMA form with 1 row per warp; the tensor-core form with 4 warps) are what
    every decode launch of the plan runs. (Without the norm prologue and the gated epilogue: fusion
    takes those only where the rule's form is the FMA form with two rows a warp.)"""
    for form, template, define, want in (((("rows", 1), ("fold", False)), "qgemv.cu.jinja", "R_", 1),
                                         ((("tc", True), ("warps", 4)), "qgemv_tc.cu.jinja", "WARPS", 4)):
        monkeypatch.setattr(select_kernels, "_qgemv_params", lambda m, n, k, fmt, group, dtype, form=form: form)
        _quantized_plan_runs(template, define, want, disabled=("norm_gemm", "gated_epilogue"))


def _quantized_plan_runs(template: str, define: str, want: int, batch: int = 1, disabled: tuple[str, ...] = ()) -> None:
    plan = compile_generation("llama-tiny", batch=batch, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90", quantize="int4", quantize_group=32, disabled_fusions=disabled)
    m = plan.manifest
    modules = {mod["id"]: mod for mod in m["modules"]}
    launches = [L for L in entry_points(m)["decode"]["launches"] if L["type"] == "kernel"]
    quant = [modules[m["kernels"][L["kernel"]]["module"]] for L in launches if "qgemv" in L["label"]]
    assert len(quant) >= 4 and {mod["template"] for mod in quant} == {template}
    assert {_define(plan._blobs[mod["source"]].decode(), define) for mod in quant} == {want}


def test_a_batch_8_int4_plan_decodes_on_tensor_cores() -> None:
    """Unpatched, the rule puts a batch-8 bf16 plan's int4 products on tensor cores (16 warps: the
    tiny model's products have few blocks of 16 rows), and a batch-1 plan's on the dp4a form (8 warps)."""
    _quantized_plan_runs("qgemv_tc.cu.jinja", "WARPS", 16, batch=8)
    _quantized_plan_runs("qgemv_dp4a.cu.jinja", "W_", 8, batch=1)


def test_explain_shows_the_form_kernel_selection_recorded(monkeypatch) -> None:  # noqa: ANN001
    from fusec.cli.explain import explain
    from fusec.loader import load_graph

    monkeypatch.setattr(select_kernels, "_gemv_params",
                        lambda n, k, dtype, glu=False, m=1, norm=False: (("stages", 2), ("tiles_per_block", 3)))
    told = explain(load_graph("llama-tiny", None))
    kernels = [k for layer in told["layers"].values() for k in layer["kernels"]]
    assert kernels and sum("(stages 2, tiles_per_block 3)" in k for k in kernels) >= 4, kernels


@pytest.mark.parametrize("n,k,glu", SHAPES)
def test_batch_8_spreads_k_groups_where_twice_the_warps_still_fit_two_a_sm(n: int, k: int, glu: bool,
                                                                            monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("FUSEC_GEMV_SPREAD", raising=False)
    for m in (1, 4, 7):
        assert "spread" not in gemv_form(n, k, DType.BF16, glu, m)
    two = gemv_blocks_per_sm(k, DType.BF16, 3, 2) >= 2 and S.gemv_geometry(k, DType.BF16, 2)[0] <= 32
    for m in (8, 16):
        form = gemv_form(n, k, DType.BF16, glu, m)
        assert form.get("spread", 1) == (2 if two else 1)
        spec = S.GemvSpec(m, n, k, DType.BF16, glu="silu" if glu else "", **form)
        assert prepare(spec)[0].block[0] == 32 * S.gemv_geometry(k, DType.BF16, spec.spread)[0]
    if (n, k) in ((4096, 1024), (6144, 1024), (1024, 3072)):
        assert gemv_form(n, k, DType.BF16, glu, 8)["spread"] == 2  # Qwen3-0.6B's qkv, gate/up, down
    monkeypatch.setenv("FUSEC_GEMV_SPREAD", "1")
    assert "spread" not in gemv_form(n, k, DType.BF16, glu, 8)
    monkeypatch.setenv("FUSEC_GEMV_SPREAD", "3")
    with pytest.raises(InputError, match="FUSEC_GEMV_SPREAD"):
        gemv_form(n, k, DType.BF16, glu, 8)


def test_a_batch_8_plan_records_and_emits_the_spread() -> None:
    """The kernel selection records the spread at batch 8 and the lowering emits it: a llama-shaped
    model of d 1024 (Qwen3-0.6B's row length) runs its K = 1024 products in blocks of 8 warps at
    batch 8 (spread 2), of 4 at batch 1."""
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("llama-tiny"), name="llama-d1024", hidden_size=1024, num_heads=8,
                              num_kv_heads=4, head_dim=128, intermediate_size=1024, num_layers=1, vocab_size=512)
    gm = GenModel(cfg, SharedWeights(RandomWeights(3)), None, (), cfg.name)
    for batch, warps in ((8, 8), (1, 4)):
        plan = compile_generation(gm, batch=batch, max_seq_len=32, prefill_len=8, dtype="bf16", eos_ids=[],
                                  arch="sm_90")
        launches = _gemv_launches(plan)
        wide = [L for L, src in launches if _define(src, "K_") == 1024]
        assert len(wide) >= 3, [L["label"] for L, _ in launches]  # qkv, gate/up, LM head
        assert {L["block"][0] for L in wide} == {32 * warps}, batch
        for L, src in launches:
            form = gemv_form(_define(src, "N_"), _define(src, "K_"), DType.BF16, False, batch)
            assert L["block"][0] == 32 * S.gemv_geometry(_define(src, "K_"), DType.BF16, form.get("spread", 1))[0]


@pytest.mark.parametrize("m,k,coop", [(1, 1024, True), (2, 2048, True), (3, 1024, True), (4, 1024, True),
                                      (5, 1024, False), (8, 1024, False), (9, 1024, True), (16, 1024, True),
                                      (4, 2048, False), (9, 2048, False),  # x beside a 99 KB ring: one block an SM
                                      (16, 2048, False),  # 64 KB of x beside a 99 KB ring: past what sm_80 allows
                                      (1, 4096, False), (16, 4096, False)])  # K 4096: two k groups, x not whole
def test_the_block_normalizes_x_once_at_one_to_four_and_nine_to_sixteen_rows(m: int, k: int, coop: bool) -> None:
    """At 1-4 rows the fragment layout leaves most lanes idle while a row's lanes normalize all of it, and at
    9-16 rows the fragments cannot hold the statistic (the tile-by-tile form took Qwen3-0.6B's 16-token prefill's
    qkv 13.95 us): the block normalizes x once into shared memory (``coop_norm``). At 1-2 rows x is a static
    array; at 3-16 dynamic shared memory after the ring, which the launch's size and the blocks an SM count."""
    form = gemv_form(4096, k, DType.BF16, False, m, True)
    spec = S.GemvSpec(m, 4096, k, DType.BF16, norm=True, **form)
    r, src = prepare(spec)
    assert bool(r.ctx["coop_norm"]) == coop
    assert ("s_xn[M_ * K_]" in src) == (coop and m <= 2)
    assert ("gv_xn_base + XN_OFF" in src) == (coop and m > 2)
    ring = gemv_ring_bytes(k, DType.BF16, form["stages"], form.get("spread", 1))
    assert r.shared_mem == ring + (m * k * 2 if coop and m > 2 else 0)
    if coop:  # every thread takes whole 8-element pieces of a row: the pieces cover K exactly once
        assert r.ctx["XPT"] * 8 * r.block[0] >= k > (r.ctx["XPT"] - 1) * 8 * r.block[0]
        assert "xr[i][hf][e];  // normalized already" in src  # the products read the block's normalized x
    if coop and m > 2:  # the rows' bytes count against the blocks an SM holds, and leave at least 2
        assert r.ctx["min_blocks"] == gemv_blocks_per_sm(k, DType.BF16, form["stages"], form.get("spread", 1),
                                                          m * k * 2) >= 2
    no_norm = S.GemvSpec(m, 4096, k, DType.BF16, **gemv_form(4096, k, DType.BF16, False, m))
    assert not prepare(no_norm)[0].ctx["coop_norm"]


def test_coop_norm_knob_takes_three_to_eight_rows_or_one_two_only(monkeypatch) -> None:  # noqa: ANN001
    """FUSEC_GEMV_COOP_NORM=all normalizes x in the block at 5-8 rows too (the A/B against the fragments); 1-2 at
    those rows only (the A/B against the rule before)."""
    def spec(m: int) -> S.GemvSpec:  # as kernel selection records it: the knob is read by the rule, not the builder
        return S.GemvSpec(m, 4096, 1024, DType.BF16, norm=True, **gemv_form(4096, 1024, DType.BF16, False, m, True))

    eight = spec(8)
    assert not eight.coop_norm and not prepare(eight)[0].ctx["coop_norm"]
    monkeypatch.setenv("FUSEC_GEMV_COOP_NORM", "all")
    assert not prepare(eight)[0].ctx["coop_norm"]  # a spec already made keeps its record
    r, src = prepare(spec(8))
    assert r.ctx["coop_norm"] and "gv_xn_base + XN_OFF" in src and r.shared_mem > gemv_ring_bytes(
        1024, DType.BF16, eight.stages, eight.spread)
    monkeypatch.setenv("FUSEC_GEMV_COOP_NORM", "1-2")  # the rule before: 9-16 rows normalize tile by tile
    assert not spec(16).coop_norm and not prepare(spec(16))[0].ctx["coop_norm"]
    assert spec(1).coop_norm and prepare(spec(1))[0].ctx["coop_norm"]


def test_coop_norm_is_refused_where_x_is_not_whole_in_the_block() -> None:
    """The record is checked: the block's copy of x needs the norm prologue, a half dtype and one k group."""
    S.GemvSpec(1, 64, 1024, DType.BF16, norm=True, coop_norm=True)
    for bad in (dict(K=1024, norm=False), dict(K=4096, norm=True)):  # no norm; K 4096: two k groups
        with pytest.raises(ValueError, match="coop_norm"):
            S.GemvSpec(1, 64, bad["K"], DType.BF16, norm=bad["norm"], coop_norm=True)
    with pytest.raises(ValueError, match="coop_norm"):
        S.GemvSpec(1, 64, 1024, DType.F32, norm=True, coop_norm=True)


@pytest.mark.parametrize("n,k,glu", SHAPES)
def test_bulk_copies_where_a_rows_stage_is_contiguous(n: int, k: int, glu: bool, monkeypatch) -> None:  # noqa: ANN001
    """The ring's copies are TMA bulk copies (one thread, an mbarrier per stage) up to 4 rows (the rule;
    FUSEC_GEMV_BULK=1/0 forces them on or off), exactly where K is a multiple of the k group; the spec
    refuses them elsewhere, and the source carries them only then (older archs compile the cp.async
    form of the same source)."""
    whole = k % S.gemv_group(k, DType.BF16) == 0
    assert gemv_form(n, k, DType.BF16, glu, 1).get("bulk", False) == whole  # the rule: up to 4 rows
    assert gemv_form(n, k, DType.BF16, glu, 4).get("bulk", False) == whole
    assert "bulk" not in gemv_form(n, k, DType.BF16, glu, 5)
    monkeypatch.setenv("FUSEC_GEMV_BULK", "0")
    assert "bulk" not in gemv_form(n, k, DType.BF16, glu, 1)
    monkeypatch.setenv("FUSEC_GEMV_BULK", "1")
    assert gemv_form(n, k, DType.BF16, glu, 8).get("bulk", False) == whole
    form = gemv_form(n, k, DType.BF16, glu)
    spec = S.GemvSpec(1, n, k, DType.BF16, glu="silu" if glu else "", **form)
    _, src = prepare(spec)
    assert ("#define GV_BULK" in src) == whole and "cp.async.bulk.shared" in src  # the helper: mma.cuh
    if not whole:
        with pytest.raises(ValueError, match="bulk"):
            S.GemvSpec(1, n, k, DType.BF16, stages=3, bulk=True)
    with pytest.raises(ValueError, match="bulk"):
        S.GemvSpec(1, n, 1024, DType.BF16, bulk=True)  # no ring to fill


def test_norm_products_issue_one_stage_before_the_wait() -> None:
    """A product that normalizes x in the block (coop norm) issues one ring stage before the PDL wait and
    the others once x has arrived; other products issue all S - 1 before it."""
    def prewait(spec: S.GemvSpec) -> int:
        _, src = prepare(spec)
        return int(re.search(r"#define PREWAIT (\d+)", src).group(1))

    form = gemv_form(6144, 1024, DType.BF16, True, 1, True)
    assert form["stages"] == 3 and form["coop_norm"]
    assert prewait(S.GemvSpec(1, 6144, 1024, DType.BF16, norm=True, glu="silu", **form)) == 1
    assert prewait(S.GemvSpec(1, 6144, 1024, DType.BF16, glu="silu", **gemv_form(6144, 1024, DType.BF16, True, 1))) == 2
    assert prewait(S.GemvSpec(8, 6144, 1024, DType.BF16, norm=True, glu="silu",
                              **gemv_form(6144, 1024, DType.BF16, True, 8, True))) == 2
    def sixteen() -> S.GemvSpec:  # as kernel selection records it, with the knob as it is then
        return S.GemvSpec(16, 6144, 1024, DType.BF16, norm=True, glu="silu",
                          **gemv_form(6144, 1024, DType.BF16, True, 16, True))

    recorded = sixteen()
    assert recorded.prewait == 1 and prewait(recorded) == 1
    with pytest.MonkeyPatch.context() as mp:  # the A/B: every product issues S - 1
        mp.setenv("FUSEC_GEMV_COOP_PREWAIT", "all")
        assert prewait(sixteen()) == 2 and prewait(recorded) == 1  # a spec already made keeps its record
    with pytest.raises(ValueError, match="prewait"):
        S.GemvSpec(1, 64, 1024, DType.BF16, stages=3, prewait=3)


def test_the_norm_rounds_two_values_a_conversion() -> None:
    """The norm prologue's two roundings a value (x * inv, then g times that) take two values in one packed cvt
    (cvt.rn.bf16x2.f32): one scalar cvt a value ran on the conversion pipe, ~256 a thread in a 16-row block
    (Qwen3-0.6B's 16-token prefill 1.030 -> 1.004 ms with the packed form, batch 8 0.761 -> 0.722 ms a step)."""
    spec = S.GemvSpec(16, 4096, 1024, DType.BF16, norm=True, **gemv_form(4096, 1024, DType.BF16, False, 16, True))
    src = prepare(spec)[1]
    body = src[src.index("gv_norm8(const fc_u32x4& xr"):]
    body = body[:body.index("\n}\n")]
    assert body.count("fc_pack2(") == 2 and "fc_set(" not in body


def test_ring_copies_carry_the_l2_evict_first_policy(monkeypatch) -> None:  # noqa: ANN001
    """The ring form's weight copies (bulk and cp.async) carry an L2 evict-first policy by default; the knob
    turns it off, the register form has no copies to carry it, and the spec refuses it without a ring. Both copy
    forms build with it for sm_90 and sm_80 (ptxas checks the cache-hinted copies' operands)."""
    from fusec.codegen import kernels as K

    for m, bulk in ((1, True), (8, False)):  # batch 1: TMA bulk copies; batch 8: cp.async from every thread
        form = gemv_form(1024, 1024, DType.BF16, False, m)
        assert form.get("l2_evict_first") is True and bool(form.get("bulk")) == bulk
        spec = S.GemvSpec(m, 1024, 1024, DType.BF16, **form)
        assert "#define GV_L2EF 1" in prepare(spec)[1]
        for arch in ("sm_90", "sm_80"):
            assert K.build(spec, arch).binary.cubin
    monkeypatch.setenv("FUSEC_GEMV_L2_EVICT_FIRST", "0")
    form = gemv_form(1024, 1024, DType.BF16, False, 1)
    assert "l2_evict_first" not in form
    assert "#define GV_L2EF" not in prepare(S.GemvSpec(1, 1024, 1024, DType.BF16, **form))[1]
    monkeypatch.setenv("FUSEC_GEMV_L2_EVICT_FIRST", "1")
    monkeypatch.setenv("FUSEC_GEMV_FORM", "register")
    assert "l2_evict_first" not in gemv_form(1024, 1024, DType.BF16, False, 1)
    with pytest.raises(ValueError, match="l2_evict_first"):
        S.GemvSpec(1, 1024, 1024, DType.BF16, l2_evict_first=True)  # stages 0: no ring
