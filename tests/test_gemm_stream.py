"""fusec's GEMM in its stream form (a prefill's few rows against a weight read once; K split over thread-block
clusters): which products take it, its split rule, its launch geometry, and the knob that puts a prefill's products
on it (CPU only; the kernel against the reference is in test_kernels_gpu.test_gemm_stream)."""

from __future__ import annotations

import pytest

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_gemm import WGMMA_WAVE, stream_bn, stream_splits, wgmma_tiling
from fusec.compiler import compile_generation
from fusec.dtypes import DType


@pytest.mark.parametrize("m,n,k,dt,batch,tb,want", [
    (128, 4096, 1024, DType.BF16, 1, False, True),
    (1, 136, 64, DType.F16, 1, False, True),
    (129, 4096, 1024, DType.BF16, 1, False, False),  # more rows than a block holds
    (128, 4096, 1000, DType.BF16, 1, False, False),  # K not whole 64-slices
    (128, 4100, 1024, DType.BF16, 1, False, False),  # B's rows not 16-byte multiples
    (128, 4096, 1024, DType.BF16, 2, False, False),  # batched
    (128, 4096, 1024, DType.BF16, 1, True, False),   # B read [N, K]
    (128, 4096, 1024, DType.F32, 1, False, False),   # no tensor-core form
])
def test_which_products_take_the_stream_form(m: int, n: int, k: int, dt: DType, batch: int, tb: bool,
                                              want: bool) -> None:
    assert S.GemmSpec(m, n, k, dt, batch=batch, trans_b=tb).stream is want


@pytest.mark.parametrize("m,n,k,want", [  # the split measured fastest (or within 0.4 us) alone on an H200
    (128, 4096, 1024, 2), (128, 1024, 2048, 4), (128, 6144, 1024, 2), (128, 1024, 3072, 4),
    (32, 3072, 2048, 4), (32, 2048, 2048, 4), (32, 16384, 2048, 2), (32, 2048, 8192, 8)])
def test_the_split_rule_at_the_prefill_shapes(m: int, n: int, k: int, want: int) -> None:
    assert stream_bn(n) == (128 if n in (4096, 6144, 16384) else 64)  # 128 columns where that still gives 32 tiles
    assert stream_splits(m, n, k, cluster=True) == want
    assert stream_splits(m, n, k, cluster=False) == 1  # no clusters before sm_90


@pytest.mark.parametrize("m,n,k", [(128, 4096, 1024), (128, 1024, 3072), (32, 2048, 8192), (5, 136, 128)])
def test_a_split_launches_whole_clusters_two_blocks_an_sm(m: int, n: int, k: int) -> None:
    splits = stream_splits(m, n, k, cluster=True)
    r, src = K.prepare(S.GemmSpec(m, n, k, DType.BF16, splits=splits))
    assert r.grid == (-(-n // stream_bn(n)) * splits, 1, 1) and r.block == (256, 1, 1)
    assert r.shared_mem <= 113 * 1024  # two blocks an SM (228 KB, 1 KB each reserved)
    assert (f"__cluster_dims__({splits}, 1, 1)" in src) == (splits > 1)


def test_a_split_needs_the_stream_form() -> None:
    with pytest.raises(ValueError, match="stream form"):
        S.GemmSpec(256, 4096, 1024, DType.BF16, splits=2)
    with pytest.raises(ValueError, match="splits"):
        S.GemmSpec(128, 4096, 1024, DType.BF16, splits=3)
    with pytest.raises(ValueError, match="stream form"):  # K's share not whole slices
        S.GemmSpec(128, 4096, 192, DType.BF16, splits=4)


@pytest.mark.parametrize("on", [False, True])
def test_the_knob_puts_a_prefills_products_on_the_stream_form(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    monkeypatch.setenv("FUSEC_GEMM_STREAM", "1" if on else "0")
    plan = compile_generation("qwen3-tiny", batch=1, max_seq_len=80, prefill_len=40, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    launches = plan.manifest["entries"]["prefill"]["launches"]
    ours = [L for L in launches if L["label"].endswith("fusec_gemm")]
    cublas = [L for L in launches if L.get("type") == "gemm"]
    if on:
        assert ours and not cublas
        assert all(plan.manifest["kernels"][L["kernel"]]["entry"].startswith("fc_gemm") for L in ours)
    else:
        assert cublas and not ours


@pytest.mark.parametrize("arch,splits", [("sm_90", 4), ("sm_80", 1)])
def test_the_stream_form_compiles(arch: str, splits: int) -> None:
    """Clusters on sm_90; sm_80 takes the unsplit form (the lowering asks stream_splits with cluster=False there)."""
    spec = S.GemmSpec(128, 1024, 2048, DType.BF16, splits=splits,
                      epilogue=S.Epilogue(bias=True, activation="silu", residual=True))
    assert K.build(spec, arch).cubin


def _prefill_products() -> object:
    """A 128-token prefill's two products over constant weights (Qwen3-0.6B's o and down shapes, scaled)."""
    import numpy as np

    from fusec.builder import GraphBuilder
    from fusec.ops import Op

    rng = np.random.default_rng(0)
    b = GraphBuilder("prefill_products")
    x = b.input("x", (128, 2048), DType.F32)
    w1 = b.const((rng.standard_normal((2048, 1024)) * 0.02).astype(np.float32), name="w1")
    w2 = b.const((rng.standard_normal((1024, 3072)) * 0.02).astype(np.float32), name="w2")
    b.output(b.emit(Op.MATMUL, b.emit(Op.MATMUL, x, w1), w2), "y")
    return b.build()


@pytest.mark.parametrize("arch,clusters,wgmma", [("sm_90", True, True), ("sm_100", True, False), ("sm_80", False, False)])
def test_the_split_is_the_kernel_selections_record(monkeypatch: pytest.MonkeyPatch, arch: str, clusters: bool,
                                                    wgmma: bool) -> None:
    """The K split is recorded on the node by kernel selection (what explain and the A/B read), from whether the
    arch has clusters, and the lowering launches it: a cluster of that many blocks a column tile. Only sm_90 takes
    the wgmma form (sm_100 has clusters but no wgmma: it keeps the mma.sync form, split)."""
    from fusec.compiler import stage
    from fusec.passes.select_kernels import selection

    monkeypatch.setenv("FUSEC_GEMM_STREAM", "1")
    st = stage(_prefill_products(), "bf16", arch)
    ours = [n for n in st.graph.nodes if selection(n) is not None and selection(n).variant == "fusec_gemm"]
    assert len(ours) == 2
    splits = [dict(selection(n).params)["splits"] for n in ours]
    shapes = [(128, 1024, 2048), (128, 3072, 1024)]
    if wgmma:  # the wgmma form's columns a block and split: one rule, recorded beside each other
        assert [(dict(selection(n).params)["bn"], sp) for n, sp in zip(ours, splits)] == [wgmma_tiling(*s) for s in shapes]
        bns = [dict(selection(n).params)["bn"] for n in ours]
    else:
        assert splits == ([4, 2] if clusters else [1, 1])  # K 2048 and 1024: shares of at least 512
        assert all("bn" not in dict(selection(n).params) for n in ours)
        bns = [stream_bn(n) for _, n, _ in shapes]
    grids = [L["grid"][0] for L in st.lowered.launches if L["label"].endswith("fusec_gemm")]
    assert grids == [-(-n // bn) * sp for (_, n, _), bn, sp in zip(shapes, bns, splits)]
    # sm_90 runs the products on wgmma, the weight stored [N, K] for it; the others the mma.sync form over [K, N]
    assert [dict(selection(n).params).get("wgmma", False) for n in ours] == [wgmma, wgmma]
    assert [selection(n).layout for n in ours] == (["nk", "nk"] if wgmma else ["kn", "kn"])
    assert [bool(n.inputs[1].is_const and n.attrs.trans_b) for n in ours] == [wgmma, wgmma]
    assert [n.inputs[1].shape for n in ours] == ([(1024, 2048), (3072, 1024)] if wgmma else [(2048, 1024), (1024, 3072)])
    gemm_modules = [m for m in st.lowered.modules if m["template"] == "gemm.cu.jinja"]
    assert len(gemm_modules) == 2
    assert all(("wgmma.mma_async" in st.lowered.blobs[m["source"]].decode()) == wgmma for m in gemm_modules)


def test_the_wgmma_form_is_sm90a_only() -> None:
    """wgmma is an sm_90a instruction: the form compiles for sm_90 GPUs (an sm_90a cubin, which reports arch 90) and is
    refused for any other arch, and the spec takes only what the form computes."""
    from fusec.codegen.compile import uses_sm90a
    from fusec.errors import InputError
    from fusec.plancheck import cubin_arch

    spec = S.GemmSpec(128, 1024, 2048, DType.BF16, trans_b=True, splits=4, wgmma=True,
                      epilogue=S.Epilogue(bias=True, activation="silu", residual=True))
    r, src = K.prepare(spec)
    assert uses_sm90a(src) and "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in src
    assert not uses_sm90a(K.prepare(S.GemmSpec(128, 1024, 2048, DType.BF16, splits=4))[1])  # the mma.sync form
    assert cubin_arch(K.build(spec, "sm_90").cubin) == 90
    with pytest.raises(InputError, match="sm_90a"):
        K.build(spec, "sm_80")
    for bad in (dict(trans_b=False), dict(dtype=DType.F32)):
        with pytest.raises(ValueError, match="wgmma"):
            S.GemmSpec(**{**dict(M=128, N=1024, K=2048, dtype=DType.BF16, trans_b=True, wgmma=True), **bad})
    with pytest.raises(ValueError, match="wgmma"):
        S.GemmSpec(256, 1024, 2048, DType.BF16, trans_b=True, wgmma=True)  # more rows than a block holds


@pytest.mark.parametrize("m,bn,bm,wn", [(128, 64, 128, 64), (32, 64, 64, 32), (128, 32, 128, 32), (32, 32, 64, 16)])
def test_the_wgmma_blocks(m: int, bn: int, bm: int, wn: int) -> None:
    """At most 64 rows take 64-row blocks whose two warpgroups split the columns; more take 128 rows, a warpgroup 64
    of them; one block an SM takes the SM's shared memory for its ring."""
    spec = S.GemmSpec(m, 1024, 2048, DType.F16, trans_b=True, splits=2, wgmma=True, bn=bn)
    r, src = K.prepare(spec)
    assert r.ctx["BM"] == bm and r.ctx["BN"] == bn and r.ctx["wn"] == wn and f"m64n{wn}k16" in src
    assert r.grid == (1024 // bn * 2, 1, 1) and r.block == (256, 1, 1)
    stage = (bm + bn) * 64 * 2
    assert r.ctx["stages"] == min(2048 // 2 // 64 + 2, (228 - 8) * 1024 // stage, 8)  # 32 blocks: one an SM
    assert r.shared_mem == r.ctx["stages"] * stage + 1024


@pytest.mark.parametrize("on", [False, True])
def test_explain_names_each_products_back_end(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """`fusec explain` shows kernel selection's variant for every product with alternatives (cuBLAS, cuBLASLt,
    fusec's GEMM, the GEMV), beside the parameters it recorded."""
    from fusec.cli.explain import explain
    from fusec.loader import load_graph

    monkeypatch.setenv("FUSEC_GEMM_STREAM", "1" if on else "0")
    told = explain(load_graph("qwen3-tiny", {"input_ids": (1, 64), "attention_mask": (1, 64)}), dtype="bf16")
    products = [k for layer in told["layers"].values() for k in layer["kernels"] if "matmul" in k]
    assert products
    if on:
        assert all("[fusec_gemm] (splits " in k for k in products), products
    else:
        assert all("[cublas" in k and "fusec_gemm" not in k for k in products), products


def test_a_plan_with_the_wgmma_form_retargets_from_its_sources(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """The bundled sources of a plan whose products took the wgmma form recompile for sm_90 (as sm_90a cubins, the
    same test as at the first compile: the source's wgmma), and re-targeting it to sm_80 is one error naming the
    module, with nothing written."""
    from fusec.errors import FusecError
    from fusec.plancheck import cubin_arch
    from fusec.retarget import recompile

    monkeypatch.setenv("FUSEC_GEMM_STREAM", "1")
    plan = compile_generation("qwen3-tiny", batch=1, max_seq_len=80, prefill_len=40, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    wg = [m for m in plan.manifest["modules"] if "wgmma.mma_async" in bytes(plan.blob(m["source"])).decode()]
    assert wg, "the knob on sm_90 puts the prefill's products on the wgmma form"
    src = tmp_path / "p.fplan"
    plan.save(src)
    again = recompile(src, "sm_90", tmp_path / "p90.fplan")
    assert all(cubin_arch(bytes(again.blob(m["cubin"]))) == 90 for m in again.manifest["modules"])
    with pytest.raises(FusecError, match=r"does not compile for sm_80.*sm_90a") as e:
        recompile(src, "sm_80", tmp_path / "p80.fplan")
    assert any(m["id"] in str(e.value) for m in wg)
    assert not (tmp_path / "p80.fplan").exists()


# the tilings measured fastest alone (H200, gemm_stream_bench.py --bn 32,64 / 64,128, --max-stages 8,4,3; RESULTS.md,
# twenty-fourth session): Qwen3-0.6B's prefill products at 128 tokens, Llama-1B's at 32
MEASURED_BEST = {(128, 4096, 1024): (32, 1), (128, 1024, 2048): (64, 4), (128, 6144, 1024): (64, 1),
                 (128, 1024, 3072): (64, 4), (32, 3072, 2048): (64, 2), (32, 2048, 2048): (32, 2),
                 (32, 16384, 2048): (128, 1), (32, 2048, 8192): (64, 8)}


@pytest.mark.parametrize("shape", sorted(MEASURED_BEST))
def test_the_wgmma_tiling_picks_what_was_measured_fastest(shape: tuple[int, int, int]) -> None:
    assert wgmma_tiling(*shape) == MEASURED_BEST[shape]


@pytest.mark.parametrize("m", [1, 32, 64, 65, 128])
@pytest.mark.parametrize("n", [8, 136, 1000, 2304, 4096, 11008, 32768])
@pytest.mark.parametrize("k", [64, 320, 768, 2048, 8192])
def test_the_wgmma_tiling_runs_in_one_wave(m: int, n: int, k: int) -> None:
    """The rule's tiling divides K into whole slices, leaves a split block at least 512 of K, and keeps its blocks
    within one wave at one or two blocks an SM (a cluster's blocks share a GPC) wherever such a tiling exists; the spec
    takes it."""
    bn, ks = wgmma_tiling(m, n, k)
    assert bn in (32, 64, 128) and ks in (1, 2, 4, 8) and k % (64 * ks) == 0
    assert ks == 1 or k // ks >= 512
    blocks = -(-n // bn) * ks
    assert blocks <= 2 * WGMMA_WAVE[ks] or ((bn, ks) == (128, 1) and -(-n // 128) > 2 * WGMMA_WAVE[1])  # else waves
    S.GemmSpec(m, n, k, DType.BF16, trans_b=True, wgmma=True, splits=ks, bn=bn)


def test_a_gated_wgmma_gemm_is_validated() -> None:
    """A gated unit is an epilogue of the wgmma form only, over halves of a multiple of 4 rows, with no other epilogue;
    its block takes BN / 2 rows of each half."""
    base = dict(M=128, N=256, K=64, dtype=DType.BF16, trans_b=True, wgmma=True, glu="silu", bn=64)
    r, src = K.prepare(S.GemmSpec(**base))
    assert r.grid == (128 // 32, 1, 1) and "fc_act_silu(first)" in src and "F_ = N_ / 2" in src
    assert "fc_act_silu(second)" in K.prepare(S.GemmSpec(**{**base, "glu_swap": True}))[1]
    for bad in (dict(wgmma=False, bn=0), dict(N=260), dict(epilogue=S.Epilogue(bias=True)), dict(glu="tanh"),
                dict(glu="", glu_swap=True)):
        with pytest.raises(ValueError, match="glu|gated|N of 8"):
            S.GemmSpec(**{**base, **bad})


def test_a_prefills_gated_unit_is_the_wgmma_gemms_epilogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 (by default, and with FUSEC_GEMM_STREAM=1) the SwiGLU after a prefill's gate/up product is the wgmma
    form's epilogue: one launch a layer fewer, its block's tiling recorded by kernel selection. Not with the knob 0,
    not on sm_80 (no wgmma), and not at decode (the skinny product has its own gated epilogue)."""
    from fusec.codegen.build_gemm import wgmma_tiling

    launches = {}
    for arch, knob in (("sm_90", "auto"), ("sm_90", "1"), ("sm_90", "0"), ("sm_80", "1"), ("sm_80", "auto")):
        monkeypatch.setenv("FUSEC_GEMM_STREAM", knob)
        plan = compile_generation("qwen3-tiny", batch=1, max_seq_len=80, prefill_len=40, dtype="bf16", eos_ids=[],
                                  arch=arch)
        launches[arch, knob] = plan.manifest["entries"]["prefill"]["launches"]
        gated = [L for L in launches[arch, knob] if "gated_epilogue" in L["label"]]
        if arch == "sm_90" and knob != "0":
            assert len(gated) == 2 and all(L["label"].endswith("fusec_gemm") for L in gated)  # one a layer
            bn, splits = wgmma_tiling(40, 256, 64)
            assert all(L["grid"][0] == -(-128 // (bn // 2)) * splits for L in gated)
            srcs = [bytes(plan.blob(m["source"])).decode() for m in plan.manifest["modules"]]
            assert any("fc_act_silu(first)" in s and "wgmma.mma_async" in s for s in srcs)
            decode = plan.manifest["entries"]["decode"]["launches"]
            assert not any("fusec_gemm" in L["label"] for L in decode)
        else:
            assert not gated
    assert len(launches["sm_90", "auto"]) == len(launches["sm_90", "0"]) - 2
    assert not any("fusec_gemm" in L["label"] for L in launches["sm_80", "auto"])  # cuBLAS: the default off sm_90


def test_the_default_keeps_cublas_where_no_wgmma_tiling_runs_in_one_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    """A product of few rows but more columns than one wave of the wgmma form holds (a vocabulary's logits at every
    row) keeps cuBLAS by default on sm_90, where nothing measured the form in waves; FUSEC_GEMM_STREAM=1 still puts
    it there."""
    import numpy as np

    from fusec.builder import GraphBuilder
    from fusec.codegen.build_gemm import wgmma_fits
    from fusec.compiler import stage
    from fusec.ops import Op
    from fusec.passes.select_kernels import selection

    assert not wgmma_fits(128, 40000, 64) and wgmma_fits(128, 4096, 64)
    b = GraphBuilder("logits")
    x = b.input("x", (128, 64), DType.F32)
    w = b.const((np.random.default_rng(0).standard_normal((64, 40000)) * 0.02).astype(np.float32), name="w")
    b.output(b.emit(Op.MATMUL, x, w), "y")
    g = b.build()
    for knob, want in (("auto", False), ("1", True)):
        monkeypatch.setenv("FUSEC_GEMM_STREAM", knob)
        st = stage(g, "bf16", "sm_90", dry_run=True)
        variants = [selection(n).variant for n in st.graph.nodes if selection(n) is not None and selection(n).key]
        assert variants and (variants == ["fusec_gemm"]) is want, variants


@pytest.mark.parametrize("on", [True, False])
def test_the_wgmma_forms_weight_copies_take_the_l2_policy_the_record_says(monkeypatch: pytest.MonkeyPatch,
                                                                          on: bool) -> None:
    """FUSEC_WGMMA_L2_EVICT_FIRST puts an L2 evict-first policy on the wgmma form's B copies: kernel selection records
    it in the product's params, the spec carries it (the wgmma form's only), and the kernel renders and builds with
    the cache-hinted copies exactly then (sm_90: ptxas checks them)."""
    from passes.select_kernels import _gemm_params

    monkeypatch.setenv("FUSEC_WGMMA_L2_EVICT_FIRST", "1" if on else "0")
    params = dict(_gemm_params(128, 3072, 1024, DType.BF16, True, True))
    assert params["wgmma"] and params.get("l2_evict_first", False) == on
    assert "l2_evict_first" not in dict(_gemm_params(128, 3072, 1024, DType.BF16, True, False))  # mma.sync form
    spec = S.GemmSpec(128, 3072, 1024, DType.BF16, trans_b=True, **params)
    src = K.prepare(spec)[1]
    assert ("fc_cp_async16_l2(bs" in src) == on
    assert K.build(spec, "sm_90").cubin
    with pytest.raises(ValueError, match="l2_evict_first"):
        S.GemmSpec(128, 3072, 1024, DType.BF16, trans_b=True, l2_evict_first=True)  # no wgmma
