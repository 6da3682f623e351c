"""The fp16/bf16 attention's block shape: the kernel selection's rule (``build_attention.query_warps``), its knob,
and what the lowering launches (CPU only; the kernels' results at every shape are in test_kernels_gpu)."""

from __future__ import annotations

import pytest

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_attention import query_warps
from fusec.codegen.build_decode import SMS
from fusec.compiler import compile_generation
from fusec.dtypes import DType


def _blocks(b: int, hq: int, s: int, qw: int) -> int:
    return -(-s // (16 * qw)) * hq * b


@pytest.mark.parametrize("b,hq,s", [(1, 16, 128), (8, 12, 128), (32, 12, 128), (1, 32, 32), (1, 32, 256),
                                    (2, 16, 128), (1, 2, 9)])
def test_the_rule_takes_two_query_warps_where_they_fill_the_sms(b: int, hq: int, s: int) -> None:
    qw = query_warps(b, hq, s)
    assert qw == (2 if _blocks(b, hq, s, 2) >= SMS else 1)
    spec = S.AttentionSpec(b, hq, hq, s, s, 64, DType.BF16, 0.125, causal=True, qwarps=qw)
    r, _ = K.prepare(spec)
    assert r.grid == (-(-s // (16 * qw)), hq, b)
    # Q, then two stages of a (K, V) tile pair where the keys span more than one 64-key tile
    stages = 2 if s > 64 else 1
    assert r.shared_mem == 2 * (64 + 8) * (16 * qw + stages * 2 * 64)
    masked = S.AttentionSpec(b, hq, hq, s, s, 64, DType.BF16, 0.125, mask="additive", mask_dtype=DType.BF16,
                             mask_strides=(s * s, 0, s, 1), qwarps=qw)
    rm, _ = K.prepare(masked)  # and the mask's tiles, one a stage
    assert rm.shared_mem == r.shared_mem + stages * 16 * qw * 64 * 2


def test_a_short_prompt_of_one_sequence_splits_the_keys() -> None:
    """Qwen3-0.6B's 128-token prefill: 32 blocks of 64 rows were a quarter of the SMs."""
    assert query_warps(1, 16, 128) == 1
    assert query_warps(8, 12, 128) == 2  # GPT-2 small at batch 8: 384 blocks of 32 rows


def test_the_knob_forces_the_block_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_ATTN_QWARPS", "4")
    assert query_warps(1, 16, 128) == 4
    monkeypatch.setenv("FUSEC_ATTN_QWARPS", "2")
    assert query_warps(32, 12, 128) == 2


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


def test_a_generation_prefills_mask_is_copied_in_16_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation prefill's [B, 1, S, S] mask: rows contiguous and 16-byte aligned, so its tiles go by cp.async."""
    import fusec.lower as LW

    seen = []
    kernel = LW.Context.kernel

    def spy(self, spec, args, label):  # noqa: ANN001, ANN202
        if isinstance(spec, S.AttentionSpec):
            seen.append(spec)
        return kernel(self, spec, args, label)

    monkeypatch.setattr(LW.Context, "kernel", spy)
    compile_generation("qwen3-tiny", batch=1, max_seq_len=48, prefill_len=40, dtype="bf16", eos_ids=[], arch="sm_90")
    assert seen and all(sp.mask == "additive" and sp.mask_vec for sp in seen), seen


def test_mask_vec_refuses_a_mask_it_cannot_copy_in_16_bytes() -> None:
    with pytest.raises(ValueError, match="mask_vec"):  # rows 7 elements apart: 14 bytes
        S.AttentionSpec(1, 2, 2, 7, 7, 64, DType.BF16, 0.125, mask="additive", mask_dtype=DType.BF16,
                        mask_strides=(49, 0, 7, 1), mask_vec=True)
