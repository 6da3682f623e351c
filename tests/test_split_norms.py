"""A norm read by products that could not merge (a Q4_K_M file's q/k in Q4_K, its v in Q6_K): one launch with both
products where the dp4a form takes them (packed_siblings), else (passes/split_norms.py) each product's prologue, and the V cache copy joins the q/k RoPEs and the attention; where a reader
cannot take the norm (tensor-core rows, the rule off), the norm stays one launch. CPU: plans compiled for sm_90
with NVRTC; the greedy tokens through the numpy reference backend against transformers."""

from __future__ import annotations

import os

import pytest

gguf = pytest.importorskip("gguf")

from test_gguf import LAYERS, Q, write_gguf  # noqa: E402

from fusec.compiler import compile_generation  # noqa: E402
from fusec.plan import entry_points  # noqa: E402

MIXED = {f"blk.{i}.attn_v.weight": Q.Q6_K for i in range(LAYERS)}  # q/k/gate/up/down Q4_K, v Q6_K


def _decode(path, batch: int, disabled: tuple[str, ...] = ()):  # noqa: ANN001, ANN202
    plan = compile_generation(str(path), batch=batch, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90",
                              eos_ids=(), disabled_fusions=disabled)
    launches = [L for L in entry_points(plan.manifest)["decode"]["launches"] if L["type"] == "kernel"]
    return plan, launches


def test_a_norm_shared_by_two_packed_formats_is_one_launch_with_both_products(tmp_path):
    """packed_siblings (the default): at one row of x, in bf16, the attention norm, the q/k product (Q4_K) and the v
    product (Q6_K) are one launch of the dp4a form, as many launches as a file whose q/k/v merged; the norm is not
    split; both products' heads still go to the attention's prologue."""
    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, types=MIXED)
    plan, launches = _decode(path, 1)
    labels = [L["label"] for L in launches]
    assert "norms_split" not in plan.manifest["reports"]["decode"]
    assert sum("fused[packed_siblings] qgemv siblings" in x for x in labels) == LAYERS, labels
    assert not [x for x in labels if "rmsnorm" in x], labels
    _, uniform = _decode(write_gguf(tmp_path / "u.gguf", Q.Q4_K), 1)  # q/k/v one merged product
    assert len(launches) == len(uniform)
    assert sum("rope_siblings+rope_attention" in x for x in labels) == LAYERS


def test_a_norm_shared_by_two_packed_formats_is_each_products_prologue(tmp_path):
    """Without packed_siblings: the norm is copied into each product (norm_copies)."""
    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, types=MIXED)
    plan, launches = _decode(path, 1, ("packed_siblings",))
    labels = [L["label"] for L in launches]
    report = plan.manifest["reports"]["decode"]
    assert report["norms_split"] == LAYERS  # each layer's attention norm, read by the q/k and the v products
    assert not [x for x in labels if "rmsnorm" in x], labels
    _, uniform = _decode(write_gguf(tmp_path / "u.gguf", Q.Q4_K), 1)  # q/k/v one merged product
    assert len(launches) == len(uniform) + LAYERS  # only the v product's launch more: no norm, no cache write
    qk_v = [x for x in labels if "fused[norm_gemm]" in x and "qgemv" in x]
    assert len(qk_v) == 2 * LAYERS  # q/k and v: each normalizes x itself (the LM head: norm_gemm+gemm_sample)
    heads = [x for x in labels if "rope_siblings+rope_attention" in x]
    assert len(heads) == LAYERS  # both caches written by the attention's prologue
    _, off = _decode(path, 1, ("norm_gemm", "packed_siblings"))
    assert sum("rmsnorm" in L["label"] for L in off) >= 2 * LAYERS  # the rule off: no copies, norms launch
    assert len(off) > len(launches)
    _, kept = _decode(path, 1, ("norm_copies", "packed_siblings"))
    assert sum("rmsnorm" in L["label"] for L in kept) == LAYERS  # the attention norm, read by two products
    assert len(kept) > len(launches)


def test_a_norm_stays_one_launch_where_its_readers_cannot_take_it(tmp_path):
    """At 8 rows Q4_K and Q6_K run on tensor cores, which take no norm prologue: no copies."""
    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, types=MIXED)
    plan, launches = _decode(path, 8)
    assert "norms_split" not in plan.manifest["reports"]["decode"]
    assert sum("rmsnorm" in L["label"] for L in launches) >= LAYERS
    assert not any("_copy" in L["label"] for L in launches)


def test_greedy_tokens_with_split_norms_match_transformers(tmp_path):
    """The optimized graphs (the norm's copies and the widened RoPE group included) run by the reference
    backend give transformers' greedy tokens on the same mixed-format file."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from test_generation_gguf import _hf_greedy

    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, load_generation_model

    path = write_gguf(tmp_path / "m.gguf", Q.Q8_0, types={f"blk.{i}.attn_v.weight": Q.Q4_0 for i in range(LAYERS)})
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21]]
    gm = load_generation_model(str(path))
    engine = ReferenceEngine(build_graphs(gm, len(prompts), 7 + 10, 7), optimize=True)
    assert engine.graphs["decode"].meta["norms_split"] == LAYERS
    got = generate(engine, prompts, 10, gm.config.vocab_size).new_ids
    assert got == _hf_greedy(str(path), prompts, 10, list(gm.eos_ids))


def test_past_the_siblings_rows_the_norm_is_copied_into_each_product(tmp_path):
    """At 3 rows of x the two-format launch is not made (it spilled on sm_80; fusec.lower.skinny.plan_siblings says
    so): split_norms copies the norm into each product as before (norm_copies), and no siblings group is applied."""
    from fusec.lower.skinny import SIBLINGS_MAX_M

    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, types=MIXED)
    plan, launches = _decode(path, SIBLINGS_MAX_M + 1)
    report = plan.manifest["reports"]["decode"]
    assert not any("packed_siblings" in L["label"] for L in launches)
    assert report["norms_split"] == LAYERS
