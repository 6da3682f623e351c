"""Built-in models against Hugging Face transformers (torch, CPU, eager attention).

For each tiny model: create the HF model from the same config with random (then perturbed, so no
bias is zero and no norm weight is one) weights, save it as safetensors, build the fusec graph
from that directory, and compare the numpy reference with torch on a batch with one padded row.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the network
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import numpy as safetensors_numpy  # noqa: E402
from safetensors import safe_open  # noqa: E402

from fusec import models, reference
from fusec.errors import ModelError

BATCH, SEQ, PAD = 2, 12, 4  # row 1 ends with PAD padding tokens


def hf_model(cfg: models.ModelConfig) -> torch.nn.Module:
    """The HF model with the dims of ``cfg``, random weights, eager attention, eval mode."""
    T = transformers
    if cfg.family == "gpt2":
        hc = T.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_positions, n_embd=cfg.hidden_size,
                          n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.intermediate_size,
                          activation_function=cfg.activation, layer_norm_epsilon=cfg.norm_eps)
        auto = T.AutoModelForCausalLM
    elif cfg.family == "bert":
        hc = T.BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                          num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                          max_position_embeddings=cfg.max_positions, layer_norm_eps=cfg.norm_eps,
                          hidden_act=cfg.activation, type_vocab_size=cfg.type_vocab_size)
        auto = T.AutoModel
    else:
        kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.activation,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.attention_bias)
        hc = T.LlamaConfig(mlp_bias=cfg.mlp_bias, **kw) if cfg.family == "llama" else T.Qwen3Config(**kw)
        auto = T.AutoModelForCausalLM
    torch.manual_seed(0)
    model = auto.from_config(hc, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():  # HF inits biases to 0 and norm weights to 1: perturb them
            p.add_(torch.randn_like(p) * 0.02)
    return model


def inputs(vocab: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((BATCH, SEQ), np.int64)
    mask[1, SEQ - PAD:] = 0
    return {"input_ids": rng.integers(0, vocab, (BATCH, SEQ), dtype=np.int64), "attention_mask": mask}


def compare(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> None:
    """Compare where the mask is 1: every position of unpadded rows, the real tokens of the padded
    row (padded positions of an encoder, or a decoder's padded tail, are not meaningful)."""
    keep = mask.astype(bool)
    a, b = got[keep], want[keep]
    assert np.linalg.norm(b) > 0
    rel = np.linalg.norm(a - b) / np.linalg.norm(b)
    assert rel <= 1e-5, f"relative error {rel:.3g}"
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    out = {}
    for name in ("gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"):
        model = hf_model(models.get_config(name))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, model)
    return out


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"])
def test_matches_transformers_with_padding(name: str, checkpoints: dict) -> None:
    path, model = checkpoints[name]
    cfg = models.get_config(name)
    feed = inputs(cfg.vocab_size, seed=hash(name) % 1000)
    graph = models.build(name, {k: v.shape for k, v in feed.items()}, weights_dir=path)
    got = reference.run(graph, feed)[cfg.output_name]
    with torch.no_grad():
        res = model(input_ids=torch.from_numpy(feed["input_ids"]), attention_mask=torch.from_numpy(feed["attention_mask"]))
    want = (res.logits if cfg.is_decoder else res.last_hidden_state).numpy()
    assert got.shape == want.shape == (BATCH, SEQ, cfg.vocab_size if cfg.is_decoder else cfg.hidden_size)
    compare(got, want, feed["attention_mask"])
    if not cfg.is_decoder:  # the padding mask must matter: unmasked, row 1's real tokens change
        unmasked = reference.run(graph, {**feed, "attention_mask": np.ones_like(feed["attention_mask"])})
        assert not np.allclose(unmasked[cfg.output_name][1, : SEQ - PAD], got[1, : SEQ - PAD], atol=1e-4)


def test_checkpoint_dims_override_named_config(checkpoints: dict, tmp_path: Path) -> None:
    import json

    src, _ = checkpoints["llama-tiny"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = safetensors_numpy.load_file(str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["num_hidden_layers"] = 1  # keep only layer 0: the graph must follow config.json, not llama-tiny
    (dst / "config.json").write_text(json.dumps(cfg))
    safetensors_numpy.save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, str(dst / "model.safetensors"))
    graph = models.build("llama-tiny", weights_dir=dst)
    names = {c.name for c in graph.constants}
    assert any(".layers.0." in f".{n}" for n in names) and not any("layers.1." in n for n in names)


def _edited_checkpoint(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = safetensors_numpy.load_file(str(dst / "model.safetensors"))
    edit(tensors)
    safetensors_numpy.save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_bad_checkpoints_name_the_tensor(checkpoints: dict, tmp_path: Path) -> None:
    src, _ = checkpoints["gpt2-tiny"]
    key = "transformer.h.1.mlp.c_fc.weight"

    missing = _edited_checkpoint(src, tmp_path / "missing", lambda t: t.pop(key))
    with pytest.raises(ModelError, match=r"h\.1\.mlp\.c_fc\.weight"):
        models.build("gpt2-tiny", weights_dir=missing)

    def reshape(t: dict) -> None:
        t[key] = np.ascontiguousarray(t[key].T)

    bad_shape = _edited_checkpoint(src, tmp_path / "shape", reshape)
    with pytest.raises(ModelError, match=r"h\.1\.mlp\.c_fc\.weight.*shape"):
        models.build("gpt2-tiny", weights_dir=bad_shape)

    def add(t: dict) -> None:
        t["transformer.h.0.attn.extra_proj.weight"] = np.ones((2, 2), np.float32)

    extra = _edited_checkpoint(src, tmp_path / "extra", add)
    with pytest.raises(ModelError, match=r"extra_proj\.weight"):
        models.build("gpt2-tiny", weights_dir=extra)

    with pytest.raises(ModelError, match="model_type 'gpt2'"):
        models.build("bert-tiny", weights_dir=src)
    with pytest.raises(ModelError, match="config.json"):
        models.build("gpt2-tiny", weights_dir=tmp_path)


def test_bf16_checkpoint_loads_as_fp32(tmp_path: Path) -> None:
    # Real Qwen3/Llama checkpoints are bf16: the loader widens them to fp32 on the host.
    cfg = models.get_config("qwen3-tiny")
    model = hf_model(cfg)
    with torch.no_grad():  # make the weights bf16-representable, then compare in fp32
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    # Not model.to(bf16) and back: that would also round RoPE's inv_freq buffer.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    feed = inputs(cfg.vocab_size, seed=5)
    graph = models.build("qwen3-tiny", {k: v.shape for k, v in feed.items()}, weights_dir=tmp_path)
    got = reference.run(graph, feed)["logits"]
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).logits.numpy()
    compare(got, want, feed["attention_mask"])


def test_bare_model_names_and_buffers_are_accepted(checkpoints: dict, tmp_path: Path) -> None:
    # The hub's "gpt2" checkpoint is a GPT2Model: no "transformer." prefix, plus old causal-mask
    # buffers ("h.N.attn.bias"); both must load, and give the same graph as the prefixed one.
    src, _ = checkpoints["gpt2-tiny"]

    def bare(t: dict) -> None:
        for k in list(t):
            t[k.removeprefix("transformer.")] = t.pop(k)
        t["h.0.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))

    dst = _edited_checkpoint(src, tmp_path / "bare", bare)
    a = models.build("gpt2-tiny", weights_dir=dst)
    b = models.build("gpt2-tiny", weights_dir=src)
    assert str(a) == str(b)
    assert all(np.array_equal(x.data, y.data) for x, y in zip(a.constants, b.constants))
