"""Generation plans on the GPU against the reference backend (same graphs, same weights)."""

from __future__ import annotations

import re

import pytest

from fusec.compiler import compile_generation
from fusec.generation import ReferenceEngine, generate
from fusec.genmodel import build_graphs, load_generation_model
from fusec.runtime.generation import generate_with_plan
from fusec.sampling import Sampling

pytestmark = pytest.mark.gpu

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23], [31, 32, 33, 34, 35, 36]]


def _reference(name: str, sampling: Sampling, eos: list[int], prompts, new: int, seed: int = 0):
    gm = load_generation_model(name)
    graphs = build_graphs(gm, 4, 48, 12, eos)
    return generate(ReferenceEngine(graphs), prompts, new, gm.config.vocab_size, seed, sampling=sampling).new_ids


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_greedy_generation_matches_reference(name):
    plan = compile_generation(name, batch=4, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[7])
    res = generate_with_plan(plan, PROMPTS, max_new_tokens=20)
    want = _reference(name, Sampling(), [7], PROMPTS, 20)
    assert res.new_ids == want
    assert all(len(n) == 20 or n[-1] == 7 for n in res.new_ids)


def test_sampled_generation_is_reproducible_and_matches_reference():
    s = Sampling(temperature=0.9, top_k=40, top_p=0.9)
    plan = compile_generation("qwen3-tiny", batch=4, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[])
    a = generate_with_plan(plan, PROMPTS, max_new_tokens=16, seed=3, sampling=s).new_ids
    b = generate_with_plan(plan, PROMPTS, max_new_tokens=16, seed=3, sampling=s).new_ids
    c = generate_with_plan(plan, PROMPTS, max_new_tokens=16, seed=4, sampling=s).new_ids
    assert a == b
    assert a != c
    assert a == _reference("qwen3-tiny", s, [], PROMPTS, 16, seed=3)


def test_decode_steps_do_no_host_work():
    plan = compile_generation("llama-tiny", batch=2, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[])
    res = generate_with_plan(plan, [[5, 6, 7], [8, 9]], max_new_tokens=24, measure=True)
    assert [len(n) for n in res.new_ids] == [24, 24]
    assert_no_host_work(res.stats["decode"], 23)


def assert_no_host_work(dec: dict, steps: int) -> None:
    """A generation's decode stats: ``steps`` CUDA-graph replays and nothing else the driver did
    (no sync, allocation, copy or loose kernel launch); skips where CUPTI counters are unavailable."""
    assert dec["steps"] == steps and dec["cuda_graph"]
    if dec.get("counters") != "cupti":
        pytest.skip(f"driver counters unavailable: {dec.get('counters')}")
    per = dec["per_step"]
    assert per["syncs"] == 0 and per["allocations"] == 0 and per["h2d_bytes"] == 0 and per["d2h_bytes"] == 0
    assert dec["total"]["graph_launches"] == steps and dec["total"]["kernel_launches"] == 0


def test_bf16_generation_runs_and_stops_at_eos():
    plan = compile_generation("qwen3-tiny", batch=4, max_seq_len=48, prefill_len=12, dtype="bf16", eos_ids=[7])
    res = generate_with_plan(plan, PROMPTS, max_new_tokens=20)
    assert all(1 <= len(n) <= 20 for n in res.new_ids)
    assert all(len(n) == 20 or n[-1] == 7 for n in res.new_ids)
    assert all(0 <= t < 1000 for n in res.new_ids for t in n)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_head_rope_fusion_generates_like_the_reference(head_dim):
    """Qwen3 with head_dim 64/128: q norm + RoPE and k norm + RoPE + the K cache write run as one
    launch per layer (rope_siblings: one head_rope kernel over the q and k heads), in decode the
    attention's prologue (rope_attention)."""
    import dataclasses

    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("qwen3-tiny"), head_dim=head_dim, name=f"qwen3-d{head_dim}")

    def model():
        return GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)

    plan = compile_generation(model(), batch=4, max_seq_len=48, prefill_len=12, dtype="fp32", eos_ids=[])
    labels = [L["label"] for L in plan.manifest["entries"]["decode"]["launches"]]
    assert sum("fused[rope_siblings+rope_attention]" in x for x in labels) == cfg.num_layers
    res = generate_with_plan(plan, PROMPTS, max_new_tokens=16)
    want = generate(ReferenceEngine(build_graphs(model(), 4, 48, 12, [])), PROMPTS, 16, cfg.vocab_size)
    assert res.new_ids == want.new_ids


def test_tensor_core_key_loop_generates_as_the_simt_loop(monkeypatch):
    """A bf16 plan at GQA 4 and head_dim 128 takes the tensor-core key loop by the rule (FUSEC_KV_MMA=auto); its
    greedy tokens equal those of the same plan with the SIMT loop (FUSEC_KV_MMA=0) over 16 steps (random weights: no
    near-ties at these logits), and the fp32 plan (SIMT) still equals the reference."""
    import dataclasses

    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("qwen3-tiny"), head_dim=128, num_heads=8, num_kv_heads=2, name="qwen3-g4")

    def model():
        return GenModel(cfg, SharedWeights(RandomWeights(2)), None, (), cfg.name)

    def tokens(knob: str, dtype: str) -> tuple[list, str]:
        monkeypatch.setenv("FUSEC_KV_MMA", knob)
        plan = compile_generation(model(), batch=4, max_seq_len=48, prefill_len=12, dtype=dtype, eos_ids=[])
        srcs = [bytes(plan.blob(m["source"])).decode() for m in plan.manifest["modules"]
                if m["entry"].startswith("fc_kvattn")]
        return generate_with_plan(plan, PROMPTS, max_new_tokens=16).new_ids, "".join(srcs)

    mma, src_mma = tokens("auto", "bf16")
    simt, src_simt = tokens("0", "bf16")
    def warp_groups(src: str) -> bool:  # the merge's groups: a warp each
        return re.search(r"#define NGM (\d+)", src)[1] == str(int(re.search(r"#define NT (\d+)", src)[1]) // 32)

    assert warp_groups(src_mma) and not warp_groups(src_simt)
    assert mma == simt
    exact, _ = tokens("auto", "fp32")
    assert exact == generate(ReferenceEngine(build_graphs(model(), 4, 48, 12, [])), PROMPTS, 16, cfg.vocab_size).new_ids
