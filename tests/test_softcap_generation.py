"""Text generation from a Gemma-2-like ONNX decoder with attention logit soft-capping and a KV cache
(fusec/frontend/kv_cache.py): the decode step's kv_attention carries the cap, greedy generation on
the reference backend matches transformers, the generation plan's decode kernel applies the cap,
and on a GPU (``gpu`` mark) the plan generates what the reference does.

Every layer uses full attention: fusec's cache contract is present = Concat(past, new), which
transformers' sliding-window cache layers (they keep only the last window) do not meet; those
files are refused by the loader, not generated from wrongly. Built-in models (fusec/models) have
no Gemma-2 family.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import hf_kv_export
import llm_families as L
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec.generation import ReferenceEngine, generate  # noqa: E402
from fusec.compiler import compile_generation  # noqa: E402
from fusec.genmodel import build_graphs, load_generation_model  # noqa: E402
from fusec.ops import Op  # noqa: E402
from fusec.runtime.generation import generate_with_plan  # noqa: E402

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23], [31, 32, 33, 34, 35, 36]]
NEW = 12
# The tiny model's scores are ~1 and its greedy tokens repeat: Gemma-2's cap of 50 (or 2) changes none of
# them; 0.5 with this seed does (checked below), so a decode step that lost the cap picks other tokens.
CAP = 0.5
SEED = 2
_EXPORTS: dict[str, tuple[str, Any]] = {}


def _export(tmp_root: Path, exporter: str = "legacy") -> tuple[str, Any]:
    if exporter in _EXPORTS:
        return _EXPORTS[exporter]
    import torch
    import transformers as T

    cfg = T.Gemma2Config(**L._dec(2), head_dim=16, query_pre_attn_scalar=16, layer_types=["full_attention"] * 2,
                         attn_logit_softcapping=CAP, final_logit_softcapping=30.0)
    torch.manual_seed(SEED)
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    model.generation_config.eos_token_id = model.config.eos_token_id = hf_kv_export.EOS
    folder = tmp_root / f"gemma2-softcap-kv-{exporter}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    try:
        hf_kv_export._export(model, exporter, "bhsd", path)
    except Exception as e:  # the exporter's own failure, in one line
        pytest.skip(f"{exporter} export of a Gemma-2 decoder with a KV cache failed: {type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma2", "eos_token_id": hf_kv_export.EOS}))
    _EXPORTS[exporter] = (str(path), model)
    return _EXPORTS[exporter]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    return _export(tmp_path_factory.mktemp("softcap_gen"))


def _hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_soft_capped_decoder_generates_as_transformers(exported: tuple[str, Any]) -> None:
    path, model = exported
    assert hf_kv_export.check_export(path, model) < 1e-4
    gm = load_generation_model(path)
    graphs = build_graphs(gm, 3, 40, 12, eos_ids=[])
    kv = [n.attrs.softcap for n in graphs["decode"].nodes if n.op == Op.KV_ATTENTION]
    assert kv == [CAP] * L.LAYERS, kv
    got = generate(ReferenceEngine(graphs, optimize=True), PROMPTS, NEW, gm.config.vocab_size).new_ids
    want = [_hf_greedy(model, p) for p in PROMPTS]
    assert got == want
    # the cap matters for these prompts: transformers without it picks other tokens somewhere
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    try:
        assert [_hf_greedy(model, p) for p in PROMPTS] != want
    finally:
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = CAP


@pytest.mark.slow
def test_the_generation_plan_caps_in_prefill_and_decode(exported: tuple[str, Any]) -> None:
    path, _ = exported
    plan = compile_generation(path, batch=2, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90")
    assert set(plan.entries) == {"prefill", "decode"}
    srcs = [bytes(b).decode() for n, b in plan.blobs().items() if n.startswith("source/")]
    c2 = repr(CAP * math.log2(math.e)) + "f"
    assert any(f"dot = {c2} * tanhf(dot / {c2});" in s for s in srcs), "no decode kernel applies the cap"
    assert any(f"v = {CAP!r}f * tanhf(v / {CAP!r}f);" in s for s in srcs), "no prefill kernel applies the cap"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_soft_capped_generation_on_the_gpu(exported: tuple[str, Any], dtype: str) -> None:
    path, model = exported
    plan = compile_generation(path, batch=3, max_seq_len=40, prefill_len=12, dtype=dtype, eos_ids=[])
    got = generate_with_plan(plan, PROMPTS, max_new_tokens=NEW).new_ids
    want = [_hf_greedy(model, p) for p in PROMPTS]
    if dtype == "fp32":
        assert got == want
    else:  # bf16 may pick another token once logits are close; the first steps must agree
        assert all(g[:3] == w[:3] for g, w in zip(got, want)), (got, want)
