"""Host memory while compiling (issue 21, point 5): a half-precision compile holds its weights in
the storage dtype from the start (never the fp32 copy: fusec.models.weights.StoredWeights), the
entries of a generation plan share what the passes derive from the weights (fusec.bulk.derived),
and the packed weights are written without being joined (fusec.planfile.Chunks). The plans are the
ones an fp32 build gives, byte for byte. Measured on the CPU with tracemalloc (numpy's allocations
are traced); benchmarks/compile_memory.py measures whole-process peak RSS on qwen3-0.6b."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tracemalloc

import pytest

import fusec
from fusec.genmodel import GenModel, load_generation_model
from fusec.compiler import compile_generation
from fusec.models import get_config
from fusec.models import weights as W
from fusec.models.generate import SharedWeights
from fusec.models.weights import RandomWeights


def _digest(plan) -> tuple[str, str]:
    m = plan.manifest
    launches = m.get("launches") or {k: v["launches"] for k, v in m["entries"].items()}
    weights = bytes(plan.blob("weights")) if m["memory"]["weights_bytes"] else b""
    return json.dumps(launches, sort_keys=True), hashlib.sha256(weights).hexdigest()


@pytest.mark.parametrize("name, dtype", [("gpt2-tiny", "fp16"), ("bert-tiny", "bf16"), ("qwen3-tiny", "bf16"),
                                         ("llama-tiny", "fp32")])
def test_weights_stored_narrow_give_the_same_plan(monkeypatch, name, dtype):
    monkeypatch.setattr(W.StoredWeights, "MIN_ELEMENTS", 0)  # every matrix of these tiny models stored narrow
    built_fp32 = fusec.compile(fusec.models.build(name), dtype=dtype, arch="sm_90")  # a Graph: built as it is
    assert _digest(fusec.compile(name, dtype=dtype, arch="sm_90")) == _digest(built_fp32)


def test_a_generation_plan_from_narrow_weights_is_the_same_plan(monkeypatch):
    from fusec.compiler import compile_entries
    from fusec.genmodel import build_graphs

    monkeypatch.setattr(W.StoredWeights, "MIN_ELEMENTS", 0)
    fp32 = build_graphs(load_generation_model("qwen3-tiny"), 2, 64, None)
    want = compile_entries(fp32, dtype="bf16", arch="sm_90", weights_nk=True)
    got = compile_generation("qwen3-tiny", batch=2, max_seq_len=64, dtype="bf16", arch="sm_90")
    assert _digest(got) == _digest(want)


def test_a_generation_compile_holds_about_one_copy_of_its_weights(tmp_path):
    cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-deep", vocab_size=4096, hidden_size=256,
                              num_layers=8, intermediate_size=1024, num_heads=4, num_kv_heads=2, head_dim=64)
    gm = GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)
    compile_generation(gm, batch=1, max_seq_len=32, dtype="bf16", arch="sm_90")  # kernels compiled, untraced
    gm = GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)
    tracemalloc.start()
    try:
        plan = compile_generation(gm, batch=1, max_seq_len=32, dtype="bf16", arch="sm_90")
        plan.save(tmp_path / "g.fplan")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    weights = plan.manifest["memory"]["weights_bytes"]
    assert weights > 8 << 20
    # before: the fp32 weights (2x), a bf16 copy per entry (2x), the joined blob (1x) and more:
    # 110 MB for these 17.9 MB; now the weights, the merged products' weights and one fp32 tensor
    # in conversion at a time: 38 MB
    assert peak < 3 * weights, (peak, weights)
