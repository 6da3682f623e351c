"""The fp16/bf16 attention's block shape: the kernel selection's rule (``build_attention.query_warps``), its knob,
and what the lowering launches (CPU only; the kernels' results at every shape are in test_kernels_gpu)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_attention import key_tile, query_warps
from fusec.compiler import compile_generation
from fusec.dtypes import DType


@pytest.mark.parametrize("b,hq,s,qw", [(1, 16, 128, 2), (8, 12, 128, 2), (1, 32, 32, 1), (1, 2, 9, 4), (3, 4, 200, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_the_builder_lays_out_each_block_shape(b: int, hq: int, s: int, qw: int, d: int) -> None:
    """Blocks of 16 * QW rows cover the queries; shared memory holds Q, K and V for each stage, the key splits'
    merged states fit in the stages' space (the kernel reuses it), and a mask adds one [BM][64] tile a stage (one
    [64] row for a mask without a query stride)."""
    spec = S.AttentionSpec(b, hq, hq, s, s, d, DType.BF16, 0.125, causal=True, qwarps=qw)
    r, _ = K.prepare(spec)
    rows = 16 * qw
    assert r.grid[1:] == (hq, b) and r.grid[0] * rows >= s > (r.grid[0] - 1) * rows
    stages = 2 if s > 64 else 1  # double-buffered where the keys span more than one 64-key tile
    stage_bytes = stages * 2 * 64 * (d + 8) * 2
    assert r.shared_mem >= rows * d * 2 + stage_bytes
    assert (4 // qw - 1) * rows * (d + 4) * 4 <= stage_bytes  # the merge's [KW - 1][BM][D + 4] floats
    masked = S.AttentionSpec(b, hq, hq, s, s, d, DType.BF16, 0.125, mask="additive", mask_dtype=DType.BF16,
                             mask_strides=(s * s, 0, s, 1), qwarps=qw)
    rm, src_rows = K.prepare(masked)
    assert rm.shared_mem == r.shared_mem + stages * rows * 64 * 2
    keys = S.AttentionSpec(b, hq, hq, s, s, d, DType.BF16, 0.125, mask="additive", mask_dtype=DType.BF16,
                           mask_strides=(s, 0, 0, 1), qwarps=qw)  # a key padding mask: one row a tile for all queries
    rk, src_keys = K.prepare(keys)
    assert rk.shared_mem == r.shared_mem + stages * 64 * 2
    assert "#define MR 1 " in src_keys and "#define MR BM " in src_rows


@pytest.mark.parametrize("b,hq,s,want", [(1, 16, 128, 2), (1, 32, 32, 2), (8, 12, 128, 2), (32, 12, 128, 4),
                                         (1, 264, 64, 4), (1, 263, 64, 2), (1, 132, 65, 4)])
def test_four_query_warps_where_two_would_take_more_than_a_wave(b: int, hq: int, s: int, want: int) -> None:
    """64-row blocks where there are at least twice as many as SMs (32-row blocks would be over four a SM: each
    block's K/V copies then serve more rows), else 32-row blocks."""
    from fusec.codegen.spec_base import SMS

    assert SMS == 132
    assert query_warps(b, hq, s) == want


def test_the_knob_forces_the_block_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_ATTN_QWARPS", "4")
    assert query_warps(1, 2, 8) == 4
    monkeypatch.setenv("FUSEC_ATTN_QWARPS", "1")
    assert query_warps(32, 12, 128) == 1


def test_the_spec_refuses_other_shapes() -> None:
    with pytest.raises(ValueError, match="qwarps"):
        S.AttentionSpec(1, 2, 2, 8, 8, 64, DType.BF16, 0.125, qwarps=3)


@pytest.mark.parametrize("forced", ["auto", "4"])
def test_the_prefill_launches_the_rules_shape(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    monkeypatch.setenv("FUSEC_ATTN_QWARPS", forced)
    plan = compile_generation("qwen3-tiny", batch=2, max_seq_len=80, prefill_len=40, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    kernels = plan.manifest["kernels"]
    attn = [L for L in plan.manifest["entries"]["prefill"]["launches"]
            if "kernel" in L and kernels[L["kernel"]]["entry"].startswith("fc_attn")]
    assert attn, "the prefill has an attention launch"
    heads = attn[0]["grid"][1]
    qw = 4 if forced == "4" else query_warps(2, heads, 40)
    assert all(tuple(L["grid"]) == (-(-40 // (16 * qw)), heads, 2) for L in attn), (qw, [L["grid"] for L in attn])


def test_a_generation_prefills_mask_is_copied_in_16_bytes_or_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A windowed generation prefill's [B, 1, S, S] mask (the window with the padding): rows contiguous and 16-byte
    aligned, so its tiles go by cp.async. A causal layer's prefill has no mask: the kernel's causal form
    (models/generate.py prompt_masks)."""
    compile_ = _attention_specs(monkeypatch)
    seen = compile_({"sliding_window": 16}, batch=1, max_seq_len=48, prefill_len=40)
    assert seen and all(sp.mask == "additive" and sp.mask_vec for sp in seen), seen
    seen = compile_({}, batch=1, max_seq_len=48, prefill_len=40)
    assert seen and all(sp.mask == "none" and sp.causal for sp in seen), seen


def test_mask_vec_refuses_a_mask_it_cannot_copy_in_16_bytes() -> None:
    with pytest.raises(ValueError, match="mask_vec"):  # rows 7 elements apart: 14 bytes
        S.AttentionSpec(1, 2, 2, 7, 7, 64, DType.BF16, 0.125, mask="additive", mask_dtype=DType.BF16,
                        mask_strides=(49, 0, 7, 1), mask_vec=True)


@pytest.mark.parametrize("forced", ["auto", "1"])
def test_the_block_shape_is_the_kernel_selections_record(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    """The attention's QW is recorded on the node by kernel selection (what explain and the A/B read), and the
    lowering launches that shape."""
    from fusec.compiler import stage
    from fusec.models import build
    from fusec.ops import Op
    from fusec.passes.select_kernels import selection

    monkeypatch.setenv("FUSEC_ATTN_QWARPS", forced)
    graph = build("gpt2-tiny", shapes={"input_ids": (2, 40), "attention_mask": (2, 40)})
    st = stage(graph, "fp16", "sm_90", dry_run=True)
    attn = [n for n in st.graph.nodes
            if n.op == Op.ATTENTION or (n.op == Op.FUSED and any(b.op == Op.ATTENTION for b in n.attrs.body.nodes))]
    assert attn
    want = 2 if forced == "auto" else 1  # 2 x 4 heads x one block of 40 rows: far fewer blocks than SMs
    assert all(dict(selection(n).params) == {"qwarps": want, "bn": 64} for n in attn)
    assert all(selection(n).to_json()["params"] == {"qwarps": want, "bn": 64} for n in attn)


@pytest.mark.parametrize("d,qw,want", [(128, 4, 32), (128, 2, 64), (64, 4, 64), (256, 4, 32), (128, 1, 64)])
def test_32_key_tiles_at_four_query_warps_past_64_head_dims(d: int, qw: int, want: int) -> None:
    """``key_tile``: where the 64-key tile's registers held a 4-warp block of D = 128 to two an SM (measured: the
    2,048-token prefill's attention), 32 keys; elsewhere 64."""
    assert key_tile(d, qw) == want


def test_the_key_tile_is_laid_out_and_forced_by_its_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    base = dict(causal=True, qwarps=4)
    r64, src64 = K.prepare(S.AttentionSpec(1, 16, 8, 2048, 2048, 128, DType.BF16, 0.088, bn=64, **base))
    r32, src32 = K.prepare(S.AttentionSpec(1, 16, 8, 2048, 2048, 128, DType.BF16, 0.088, bn=32, **base))
    assert "#define BN 64" in src64 and "#define BN 32" in src32
    assert r64.shared_mem - r32.shared_mem == 2 * 2 * 32 * (128 + 8) * 2  # two stages of K and V, 32 keys fewer
    monkeypatch.setenv("FUSEC_ATTN_BN", "64")
    assert key_tile(128, 4) == 64
    with pytest.raises(ValueError, match="bn"):
        S.AttentionSpec(1, 2, 2, 8, 8, 64, DType.BF16, 0.125, qwarps=1, bn=32)  # 8 keys a split
    with pytest.raises(ValueError, match="bn"):
        S.AttentionSpec(1, 2, 2, 8, 8, 64, DType.BF16, 0.125, bn=48)


def test_the_long_prefill_records_and_launches_the_key_tile(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel selection records bn beside qwarps and the lowering renders what it records: a prompt long enough
    for 4 query warps at head_dim 128 takes 32-key tiles."""
    compile_ = _attention_specs(monkeypatch)
    seen = compile_({"head_dim": 128, "max_positions": 1024, "num_layers": 1}, batch=9, max_seq_len=528,
                    prefill_len=512)
    assert seen and all(sp.D == 128 and sp.qwarps == 4 and sp.bn == 32 for sp in seen), seen


def _attention_specs(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list]:  # type: ignore[type-arg]
    """A compile function: qwen3-tiny with a dict of config changes (the built-in with none) and compile_generation's
    arguments, returning the AttentionSpecs the lowering rendered."""
    import dataclasses

    import fusec.lower as LW
    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    seen: list = []
    kernel = LW.Context.kernel

    def spy(self, spec, args, label):  # noqa: ANN001, ANN202
        if isinstance(spec, S.AttentionSpec):
            seen.append(spec)
        return kernel(self, spec, args, label)

    monkeypatch.setattr(LW.Context, "kernel", spy)

    def compile_(changes: dict, **kw) -> list:  # type: ignore[type-arg]
        model = "qwen3-tiny"
        if changes:
            cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-tiny-variant", **changes)
            model = GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)
        seen.clear()
        compile_generation(model, dtype="bf16", eos_ids=[], arch="sm_90", **kw)
        return list(seen)

    return compile_
