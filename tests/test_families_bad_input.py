"""Bad input to the decoder families is one line naming what is wrong: an architecture fusec does
not run (mixture-of-experts, multimodal, unknown), a RoPE scaling or layer type it does not
implement, a GGUF file missing a key its architecture needs, tensor shapes that disagree with the
metadata, values of the wrong type."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gguf")

import decoder_families as DF  # noqa: E402
from test_hf_dir_hostile import _edit_config, _refused  # noqa: E402

from fusec.cli import main  # noqa: E402
from fusec.genmodel import build_graphs, load_generation_model  # noqa: E402


@functools.lru_cache(maxsize=None)
def _saved(name: str, root: str) -> tuple[Path, Any]:
    return DF.checkpoint(name, Path(root))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.fspath(tmp_path_factory.mktemp("bad"))


def _edited_dir(root: str, name: str, tmp_path: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    src, _ = _saved(name, root)
    out = tmp_path / name
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    _edit_config(out, edit)
    return out


HF_CASES: dict[str, tuple[str, Callable[[dict[str, Any]], Any], tuple[str, ...]]] = {
    "moe": ("qwen3", lambda c: c.update(model_type="qwen3_moe"), ("'qwen3_moe'", "mixture-of-experts")),
    "mixtral": ("mistral", lambda c: c.update(model_type="mixtral"), ("'mixtral'", "mixture-of-experts")),
    "multimodal": ("gemma3", lambda c: c.update(model_type="gemma3", text_config={}), ("'gemma3'", "multimodal")),
    "unknown": ("llama3", lambda c: c.update(model_type="mamba"), ("'mamba'", "not supported", "gemma3_text")),
    "rope_dynamic": ("qwen3", lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}),
                     ("'dynamic'", "rope_type")),
    "rope_llama3_factor": ("llama3", lambda c: c["rope_parameters"].update(factor="8"), ("factor",)),
    "layer_type": ("gemma2", lambda c: c.update(layer_types=["chunked_attention", "full_attention"]),
                   ("'chunked_attention'",)),
    "layer_types_short": ("gemma2", lambda c: c.update(layer_types=["full_attention"]), ("layer_types",)),
    "bidirectional": ("gemma3", lambda c: c.update(use_bidirectional_attention=True), ("use_bidirectional_attention",)),
    "window_str": ("mistral", lambda c: c.update(sliding_window="7"), ("sliding_window",)),
    "softcap_negative": ("gemma2", lambda c: c.update(attn_logit_softcapping=-1.0), ("attn_logit_softcapping",)),
    "qpas_zero": ("gemma2", lambda c: c.update(query_pre_attn_scalar=0), ("query_pre_attn_scalar",)),
    "activation": ("gemma", lambda c: c.update(hidden_act="swish"), ("'swish'", "hidden_act")),
    "partial_rotary": ("phi3", lambda c: c["rope_parameters"].update(partial_rotary_factor=1.5),
                       ("partial_rotary_factor",)),
    "longrope_lists": ("phi3", lambda c: c["rope_parameters"].update(short_factor="x"), ("short_factor",)),
    "no_hidden": ("qwen2", lambda c: c.pop("hidden_size"), ("'hidden_size'",)),
    "pattern": ("gemma3", lambda c: (c.pop("layer_types"), c.update(sliding_window_pattern="6")),
                ("sliding_window_pattern",)),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_bad_hf_directory_is_one_line(root: str, tmp_path: Path, case: str) -> None:
    name, edit, needles = HF_CASES[case]
    d = _edited_dir(root, name, tmp_path, edit)
    _refused(lambda: load_generation_model(d), "config.json", *needles)


def test_longrope_past_its_original_context_is_refused(root: str) -> None:
    d, _ = _saved("phi3", root)
    gm = load_generation_model(d)
    build_graphs(gm, 1, 32, 8, eos_ids=[])  # within original_max_position_embeddings (32)
    _refused(lambda: build_graphs(load_generation_model(d), 1, 64, 8, eos_ids=[]),
             "longrope", "original_max_position_embeddings 32", "--max-seq-len")


def _gguf(root: str, name: str, tmp_path: Path, edit: Callable[[dict[str, Any], dict[str, Any]], Any]) -> Path:
    _, model = _saved(name, root)
    return DF.write_gguf(name, model, tmp_path / f"{name}.gguf", edit=edit)


def _set(key: str, value: Any, vtype: str) -> Callable[[dict[str, Any], dict[str, Any]], Any]:
    return lambda md, t: md.update({key: (value, vtype)})


GGUF_CASES: dict[str, tuple[str, Callable[[dict[str, Any], dict[str, Any]], Any], tuple[str, ...]]] = {
    "missing_heads": ("gemma2", lambda md, t: md.pop("gemma2.attention.head_count"),
                      ("has no metadata key 'gemma2.attention.head_count'",)),
    "missing_eps": ("phi3", lambda md, t: md.pop("phi3.attention.layer_norm_rms_epsilon"),
                    ("'phi3.attention.layer_norm_rms_epsilon'",)),
    "kv_heads_vs_qkv": ("phi3", _set("phi3.attention.head_count_kv", 4, "UINT32"),
                        ("'blk.0.attn_qkv.weight'", "the config implies")),
    "ffn_vs_tensors": ("qwen3", _set("qwen3.feed_forward_length", 80, "UINT32"), ("'blk.0.ffn_gate.weight'", "[80, 64]")),
    "no_q_norm": ("gemma3", lambda md, t: t.update({"blk.0.attn_qnorm.weight": t.pop("blk.0.attn_q_norm.weight")}),
                  ("has no tensor 'blk.0.attn_q_norm.weight'",)),
    "extra_tensor": ("gemma", lambda md, t: t.update({"blk.0.post_ffw_norm.weight": t["output_norm.weight"]}),
                     ("'blk.0.post_ffw_norm.weight'", "gemma model does not use")),
    "softcap_str": ("gemma2", _set("gemma2.attn_logit_softcapping", "50", "STRING"), ("'gemma2.attn_logit_softcapping'",)),
    "window_negative": ("gemma2", _set("gemma2.attention.sliding_window", -4, "INT32"),
                        ("'gemma2.attention.sliding_window'",)),
    "rope_type": ("qwen2", _set("qwen2.rope.scaling.type", "longrope", "STRING"), ("'longrope'", "not supported")),
    "rope_factors_len": ("phi3", lambda md, t: t.update({k: t[k][:2] for k in ("rope_factors_short.weight",
                                                                                "rope_factors_long.weight")}),
                         ("2 per-frequency factors for 4 frequencies",)),
    "rope_freqs_zero": ("llama3", lambda md, t: t["rope_freqs.weight"].__setitem__(0, 0.0), ("'rope_freqs.weight'",)),
    "pattern": ("gemma3", _set("gemma3.attention.sliding_window_pattern", "six", "STRING"),
                ("'gemma3.attention.sliding_window_pattern'",)),
    "rotary_llama": ("llama3", _set("llama.rope.dimension_count", 8, "UINT32"), ("llama.rope.dimension_count",)),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_bad_gguf_file_is_one_line(root: str, tmp_path: Path, case: str) -> None:
    name, edit, needles = GGUF_CASES[case]
    path = _gguf(root, name, tmp_path, edit)
    _refused(lambda: load_generation_model(path), f"{name}.gguf", *needles)


def test_cli_names_the_architecture_in_one_line(root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    d = _edited_dir(root, "qwen3", tmp_path, lambda c: c.update(model_type="qwen3_moe"))
    capsys.readouterr()  # what writing the fixture's model printed (transformers' shard progress), if this test made it
    assert main(["generate", str(d), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fusec: error:") and "'qwen3_moe'" in err[0], err
