"""Programmatic dependent launch on the GPU (skipped without one; the overlap needs sm_90): a
generation plan whose decode launches overlap (PDL) draws the same tokens and leaves bit-identical
KV caches as the same plan launched plainly (FUSEC_PDL=0), and its fp32 plan is token-exact
against the reference engine. Its attention kernels load the older cache rows before their wait."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fusec.runtime.generation import generate_with_plan

pytestmark = pytest.mark.gpu


def _model():  # noqa: ANN202
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    # head_dim 64: every decode family runs (head_rope needs D % 64 == 0)
    cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-pdl", hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=64, intermediate_size=256, num_layers=3)
    return GenModel(cfg, SharedWeights(RandomWeights(7)), None, (), cfg.name)


PROMPTS = [[5, 9, 17, 300, 2], [11, 7, 3]]


def _run(path: str, pdl: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], np.ndarray]:
    import fusec

    monkeypatch.setenv("FUSEC_PDL", "1" if pdl else "0")
    plan = fusec.load(path)
    res = generate_with_plan(plan, PROMPTS, max_new_tokens=24)
    assert plan._engine.device.pdl == pdl
    return res.new_ids, plan._engine.read_state("k.2")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_overlapped_launches_give_bit_identical_results(dtype: str, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from fusec.device import gpu_arch
    from fusec.compiler import compile_generation

    arch = gpu_arch()
    plan = compile_generation(_model(), batch=2, max_seq_len=48, prefill_len=8, dtype=dtype, eos_ids=[])
    decode = plan.manifest["entries"]["decode"]["launches"]
    if int(arch[3:]) >= 90:  # every launch after the first may overlap the one before
        assert sum(bool(L.get("pdl")) for L in decode) == len(decode) - 1
    # and each attention loads the cache rows older than the step before its wait (the QKV product, the
    # kernel before it, writes no cache; the attention's own prologue writes the rows at pos): the race
    # this test would catch
    mods = {m["id"]: m for m in plan.manifest["modules"]}
    attn = [mods[plan.manifest["kernels"][L["kernel"]]["module"]] for L in decode if "kernel" in L]
    attn = [m for m in attn if m["template"] == "kv_attention.cu.jinja"]
    assert len(attn) == 3 and all("fc_pdl_wait_after(dep)" in plan._blobs[m["source"]].decode() for m in attn)
    path = str(tmp_path / "p.fplan")
    plan.save(path)
    ids_pdl, cache_pdl = _run(path, True, monkeypatch)
    ids_plain, cache_plain = _run(path, False, monkeypatch)
    assert ids_pdl == ids_plain
    assert np.array_equal(cache_pdl.view(np.uint8), cache_plain.view(np.uint8))
    if dtype == "fp32":  # and the fused decode step computes what the reference engine does
        from fusec.generation import ReferenceEngine, generate
        from fusec.genmodel import build_graphs

        ref = generate(ReferenceEngine(build_graphs(_model(), 2, 48, 8, [])), PROMPTS, 24,
                       _model().config.vocab_size)
        assert ref.new_ids == ids_pdl
