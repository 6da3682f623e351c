"""The decode benchmark's divergence report (benchmarks/decode_report.py): where two engines' greedy tokens part,
whether the first differing tokens are a near-tie within bf16 rounding (issue 19's batch-8 agreement question)."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.fixture
def tiny_qwen3(tmp_path):
    """(torch, transformers, checkpoint directory, its bf16 model) of a tiny random Qwen3 saved as decode.py saves its
    model."""
    torch = pytest.importorskip("torch")
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = T.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    T.Qwen3ForCausalLM(cfg).eval().save_pretrained(tmp_path)
    return torch, T, str(tmp_path), T.Qwen3ForCausalLM.from_pretrained(tmp_path).to(torch.bfloat16).eval()


def test_first_divergences_examine_each_diverging_rows_first_differing_step() -> None:
    import decode_report as R

    V = 50
    prompt = np.arange(12, dtype=np.int64).reshape(3, 4)
    a = [[1, 2, 3, 4], [9, 9, 5, 1], [3, 3, 3, 3]]
    b = [[1, 2, 3, 4], [9, 9, 7, 1], [3, 8, 3, 3]]  # row 0 agrees; row 1 parts at step 2, row 2 at step 1
    seen = []

    def logits_at(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        seen.append(ids.tolist())
        l32 = np.linspace(-3.0, 3.0, V)
        if len(ids) == 6:  # row 1: tokens 5 and 7 the top two, 0.01 apart; the bf16 model errs by 0.05
            l32[5], l32[7] = 9.0, 8.99
            return l32, l32 + 0.05
        l32[3], l32[8] = 9.0, 4.0  # row 2: a wide gap
        return l32, l32 + 0.05

    rows = R.first_divergences(prompt, a, b, logits_at)
    assert seen == [[4, 5, 6, 7, 9, 9], [8, 9, 10, 11, 3]]  # the prompt and the tokens both engines chose
    assert [(r["row"], r["step"], r["tokens"]) for r in rows] == [(1, 2, [5, 7]), (2, 1, [3, 8])]
    near, wide = rows
    assert near["fp32_gap"] == pytest.approx(0.01) and near["fp32_ranks"] == [0, 1]
    assert near["bf16_max_abs_error"] == pytest.approx(0.05) and near["within_bf16_rounding"]
    assert wide["fp32_gap"] == pytest.approx(5.0) and not wide["within_bf16_rounding"]
    assert near["bf16_spacing"] == 2.0 ** (3 - 7)  # bf16 at 9.0: 8 significant bits


def test_divergences_read_the_checkpoints_fp32_logits_after_the_common_tokens(tiny_qwen3) -> None:
    import decode_report as R

    torch, T, ckpt, hf = tiny_qwen3
    ctx = types.SimpleNamespace(torch=torch, dev="cpu", hf=hf)
    ref = T.Qwen3ForCausalLM.from_pretrained(ckpt).float().eval()
    prompt = np.array([[5, 6, 7]], dtype=np.int64)
    got = R._divergences(ctx, ref, prompt, [[1, 2, 3]], [[1, 4, 3]])
    (row,) = got["rows"]
    assert (row["row"], row["step"], row["tokens"]) == (0, 1, [2, 4])
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([[5, 6, 7, 1]])).logits[0, -1]
    assert row["fp32_logits"] == pytest.approx([float(want[2]), float(want[4])], rel=1e-5, abs=1e-6)
    assert row["bf16_max_abs_error"] > 0 and got["within_bf16_rounding"] == int(row["within_bf16_rounding"])


def test_agreement_examines_where_fusec_and_the_peer_part(tiny_qwen3) -> None:
    """``agreement`` at batch 2: the row where fusec's and torch's tokens part gets its first differing step examined
    (against the checkpoint in fp32, which ``agreement`` loads); with --no-fp32-check it does not."""
    import decode_report as R

    torch, _, ckpt, hf = tiny_qwen3
    prompt = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int64)
    for skip in (False, True):
        ctx = types.SimpleNamespace(torch=torch, ckpt=ckpt, dev="cpu", hf=hf, new_tokens=4, max_prefill=16,
                                    args=types.SimpleNamespace(no_fp32_check=skip))
        eng = {"fusec": {"tokens": [[1, 2, 3, 4], [1, 2, 3, 4]]}, "torch": {"tokens": [[1, 2, 3, 4], [1, 2, 9, 4]]}}
        got = R.agreement(ctx, 2, 3, prompt, eng, True)["fusec~torch"]
        assert got["common_prefix_min"] == 2
        if skip:
            assert "first_divergence" not in got
            continue
        (row,) = got["first_divergence"]["rows"]
        assert (row["row"], row["step"], row["tokens"]) == (1, 2, [3, 9])
