"""Built-in model registry: every model builds and verifies with the documented signature and the
HF op forms; bad names and shapes are user errors; weights are deterministic per seed; the tiny
models behave like masked transformers (padding and batch rows do not leak)."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import models, reference
from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.ir import Graph, verify
from fusec.ops import Op

TINY = ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"]
LARGE = ["gpt2-small", "minilm", "bert-base", "qwen3-0.6b"]
_NOT_WEIGHTS = ("position_ids", "causal_mask", "rope_cos", "rope_sin", "scalar_")


def test_names_are_the_documented_set() -> None:
    assert sorted(models.names()) == sorted(TINY + LARGE)
    for name in models.names():
        cfg = models.get_config(name)
        assert cfg.name == name and cfg.description
        assert set(cfg.default_shapes) == {"input_ids", "attention_mask"}


def expected_parameters(cfg: models.ModelConfig) -> int:
    """Parameter count of the HF model (without pooler/heads), from the config's dims."""
    d, f, v, n = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    if cfg.family == "gpt2":
        layer = 4 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
        return v * d + cfg.max_positions * d + n * layer + 2 * d
    if cfg.family == "bert":
        layer = 4 * (d * d + d) + 4 * d + (d * f + f) + (f * d + d)
        return v * d + cfg.max_positions * d + d + 2 * d + n * layer  # token type 0 row: d
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f + (2 * cfg.head_dim if cfg.qk_norm else 0)
    return v * d + n * layer + d + (0 if cfg.tie_word_embeddings else v * d)


def check_structure(g: Graph, cfg: models.ModelConfig, batch: int, seq: int) -> None:
    verify(g)
    assert [(v.name, v.shape, v.dtype) for v in g.inputs] == [
        ("input_ids", (batch, seq), DType.I64), ("attention_mask", (batch, seq), DType.I64)]
    width = cfg.vocab_size if cfg.is_decoder else cfg.hidden_size
    assert [(v.name, v.shape, v.dtype) for v in g.outputs] == [(cfg.output_name, (batch, seq, width), DType.F32)]
    hist = g.op_histogram()
    n = cfg.num_layers
    assert hist["softmax"] == n
    if cfg.family in ("gpt2", "bert"):
        assert hist["layernorm"] == 2 * n + 1
    else:  # RMSNorm stays decomposed, as HF writes it: REDUCE_MEAN, SQRT and DIV(1, .) (rsqrt) each
        norms = 2 * n + 1 + (2 * n if cfg.qk_norm else 0)
        assert hist["reduce_mean"] == hist["div"] == hist["sqrt"] == hist["pow"] == norms
        assert hist["neg"] == 2 * n and hist["concat"] == 2 * n  # rotate_half on q and k
        assert hist.get("expand", 0) == (2 * n if cfg.num_kv_heads < cfg.num_heads else 0)  # repeat_kv
    # nn.Linear projections: TRANSPOSE of a constant [out, in] weight feeding a MATMUL
    producers = g.producers()
    linear = [m for m in g.nodes if m.op == Op.MATMUL and m.inputs[1] in producers
              and producers[m.inputs[1]].op == Op.TRANSPOSE and producers[m.inputs[1]].inputs[0].is_const]
    per_layer = {"gpt2": 0, "bert": 6, "llama": 7, "qwen3": 7}[cfg.family]
    lm_head = 1 if cfg.is_decoder else 0
    assert len(linear) == per_layer * n + lm_head
    weights = sum(c.numel for c in g.constants if not c.name.startswith(_NOT_WEIGHTS))
    assert weights == expected_parameters(cfg)
    assert all(c.dtype == DType.F32 for c in g.constants if not c.name.startswith(("position_ids",)))


@pytest.mark.parametrize("name", LARGE)
def test_large_models_build_with_default_shapes(name: str) -> None:
    cfg = models.get_config(name)
    g = models.build(name)
    check_structure(g, cfg, cfg.default_batch, cfg.default_seq)


def test_gpt2_small_is_the_hf_gpt2_size() -> None:
    # 124,439,808 is HF's parameter count of "gpt2"; check the config reproduces that shape.
    assert expected_parameters(models.get_config("gpt2-small")) == 124_439_808


def feed(cfg: models.ModelConfig, batch: int, seq: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = np.ones((batch, seq), np.int64)
    mask[-1, seq - 3:] = 0
    return {"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int64), "attention_mask": mask}


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_run_and_do_not_leak_across_padding_or_rows(name: str) -> None:
    cfg = models.get_config(name)
    batch, seq = 3, 9
    g = models.build(name, {"input_ids": (batch, seq), "attention_mask": [batch, seq]})
    check_structure(g, cfg, batch, seq)
    rng = np.random.default_rng(20261123)
    x = feed(cfg, batch, seq, rng)
    out = reference.run(g, x)[cfg.output_name]
    assert np.isfinite(out).all() and out.std() > 0
    real = x["attention_mask"].astype(bool)

    # Changing the padded tokens must not change any real position's output.
    y = {k: v.copy() for k, v in x.items()}
    y["input_ids"][~real] = rng.integers(0, cfg.vocab_size, int((~real).sum()))
    np.testing.assert_allclose(reference.run(g, y)[cfg.output_name][real], out[real], rtol=1e-5, atol=1e-6)

    # A row computed alone (batch 1) equals the same row in the batch.
    g1 = models.build(name, {"input_ids": (1, seq), "attention_mask": (1, seq)})
    alone = reference.run(g1, {k: v[-1:] for k, v in x.items()})[cfg.output_name]
    np.testing.assert_allclose(alone[0][real[-1]], out[-1][real[-1]], rtol=1e-5, atol=1e-6)

    if cfg.is_decoder:  # causal: a prefix's logits do not depend on later tokens
        z = {k: v.copy() for k, v in x.items()}
        z["input_ids"][0, 5:] = rng.integers(0, cfg.vocab_size, seq - 5)
        np.testing.assert_allclose(reference.run(g, z)[cfg.output_name][0, :5], out[0, :5], rtol=1e-5, atol=1e-6)


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    shapes = {"input_ids": (1, 4), "attention_mask": (1, 4)}
    a, b = models.build("llama-tiny", shapes, seed=7), models.build("llama-tiny", shapes, seed=7)
    c = models.build("llama-tiny", shapes, seed=8)
    assert [x.name for x in a.constants] == [x.name for x in b.constants]
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.constants, b.constants))
    assert str(a) == str(b)
    differ = [x.name for x, y in zip(a.constants, c.constants) if not np.array_equal(x.data, y.data)]
    assert "embed_tokens.weight" in differ and "layers.0.self_attn.q_proj.weight" in differ


def test_random_weights_have_the_documented_statistics() -> None:
    g = models.build("gpt2-tiny", seed=1)
    w = {c.name: c.data for c in g.constants}
    assert 0.015 < w["h.0.mlp.c_fc.weight"].std() < 0.025 and abs(w["h.0.mlp.c_fc.weight"].mean()) < 0.005
    assert np.all(w["h.0.attn.c_attn.bias"] != 0)  # biases non-zero so that tests exercise them
    assert abs(w["h.0.ln_1.weight"].mean() - 1.0) < 0.01 and w["h.0.ln_1.weight"].std() > 0


def test_unknown_model_lists_the_known_names() -> None:
    with pytest.raises(ModelError, match="gpt2-tiny.*qwen3-0.6b"):
        models.build("gpt3-huge")
    with pytest.raises(ModelError, match="unknown built-in model"):
        models.get_config("bert-large")


@pytest.mark.parametrize("shapes, match", [
    ({"input_ids": (1, 8)}, "attention_mask"),
    ({"input_ids": (1, 8), "attention_mask": (1, 8), "token_type_ids": (1, 8)}, "token_type_ids"),
    ({"input_ids": (8,), "attention_mask": (8,)}, "input_ids.*rank 2"),
    ({"input_ids": (1, 8, 1), "attention_mask": (1, 8)}, "input_ids.*rank 2"),
    ({"input_ids": (0, 8), "attention_mask": (0, 8)}, "input_ids.*positive"),
    ({"input_ids": (1, -8), "attention_mask": (1, -8)}, "input_ids.*positive"),
    ({"input_ids": (1, 129), "attention_mask": (1, 129)}, "input_ids.*129.*128 positions"),
    ({"input_ids": (1, 8), "attention_mask": (1, 9)}, "attention_mask.*differs"),
    ({"input_ids": (1, 8.0), "attention_mask": (1, 8)}, "input_ids.*ints"),
    ({"input_ids": "1x8", "attention_mask": (1, 8)}, "input_ids"),
])
def test_bad_shapes_name_the_input(shapes: dict, match: str) -> None:
    with pytest.raises(InputError, match=match):
        models.build("gpt2-tiny", shapes)


def test_numpy_integer_dims_are_accepted() -> None:
    dims = np.array([2, 5])
    g = models.build("bert-tiny", {"input_ids": dims, "attention_mask": tuple(dims)})
    assert g.inputs[0].shape == (2, 5)
