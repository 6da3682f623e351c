"""Hostile Hugging Face checkpoint directories (``fusec generate DIR``, ``models.build(...,
weights_dir=DIR)``), tokenizers and chat templates: every file is opened inside the directory only
(no symlink, no FIFO, no device, a size cap for text files: fusec.modelfiles), every config.json
field is checked by type, the layer count against the checkpoint's tensors, tensor dtypes from the
safetensors header before any read, and a chat template renders on a budget. Each failure is one
ModelError naming the file and key, never a hang, an out-of-memory or an exit 70.

The checkpoints are tiny Llamas written with numpy (no torch); cases that hung before the fix run
under a watchdog (FIFOs get a writer that ends the blocked open) or in a memory-capped subprocess.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from fusec import models
from fusec.errors import ModelError
from fusec.genmodel import build_graphs, load_generation_model
from fusec.models.hf_weights import config_from_hf
from fusec.text import Tokenizer, apply_chat_template

V, D, LAYERS, HEADS, KV, FFN = 256, 64, 2, 4, 2, 128
HD = D // HEADS

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
    "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": KV, "head_dim": HD, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "bos_token_id": 1, "eos_token_id": 2,
}


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": 1 + w(D), "lm_head.weight": w(V, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.q_proj.weight": w(HEADS * HD, D), p + "self_attn.k_proj.weight": w(KV * HD, D),
                  p + "self_attn.v_proj.weight": w(KV * HD, D), p + "self_attn.o_proj.weight": w(D, HEADS * HD),
                  p + "mlp.gate_proj.weight": w(FFN, D), p + "mlp.up_proj.weight": w(FFN, D),
                  p + "mlp.down_proj.weight": w(D, FFN), p + "input_layernorm.weight": 1 + w(D),
                  p + "post_attention_layernorm.weight": 1 + w(D)})
    return t


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, pre_tokenizers
    from tokenizers import models as tmodels

    from fusec.text import _byte_alphabet

    alphabet = _byte_alphabet()
    vocab = {alphabet[b]: b for b in range(254)}
    vocab.update({"<s>": 254, "</s>": 255})
    tok = HFTok(tmodels.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("ckpt") / "llama"
    d.mkdir()
    save_file(_tensors(), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(CONFIG))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (d / "tokenizer.json").write_text(_tokenizer_json())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the checkpoint (a directory of its own, with an 'outside' beside it)."""
    d = tmp_path / "model"
    shutil.copytree(pristine, d)
    (tmp_path / "outside").mkdir()
    return d


def _edit_config(d: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _refused(fn: Callable[[], Any], *needles: str) -> str:
    with pytest.raises(ModelError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


class _Hung(BaseException):
    pass


@contextlib.contextmanager
def _fifo_watchdog(fifo: Path, seconds: float = 5.0) -> Iterator[None]:
    """Before the fix, opening the FIFO blocked forever (in safetensors' Rust code too, which
    retries EINTR and keeps the GIL): from ``seconds`` on, a separate process opens it for writing
    and closes it, again and again until the block ends, so each blocked open of the reader sees
    EOF and the test fails instead of hanging."""
    writer = subprocess.Popen(["sh", "-c", 'sleep "$1"; while :; do : > "$2"; sleep 0.05; done', "sh",
                               str(seconds), str(fifo)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        writer.kill()
        writer.wait()


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``, failing (not hanging) when it runs longer than ``seconds`` (pure-Python loops)."""
    import signal

    def stop(*_: Any) -> None:
        raise _Hung(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_the_checkpoint_generates(ckpt: Path) -> None:
    gm = load_generation_model(ckpt)
    assert gm.config.num_layers == LAYERS and gm.eos_ids == (255, 2) and gm.tokenizer is not None
    build_graphs(gm, 1, 16, 8)


# ---- 1. files outside the directory, FIFOs, devices, sizes ---------------------------------------------------

def test_symlinked_chat_template_outside_is_not_read(ckpt: Path) -> None:
    secret = ckpt.parent / "outside" / "secret.txt"
    secret.write_text("SECRET {{ 'rendered' }}")
    (ckpt / "chat_template.jinja").symlink_to(secret)
    _refused(lambda: Tokenizer.from_hf_dir(ckpt), "chat_template.jinja", "symbolic link")


def test_symlinked_tokenizer_json_is_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "outside" / "tokenizer.json"
    shutil.move(ckpt / "tokenizer.json", outside)
    (ckpt / "tokenizer.json").symlink_to(outside)
    _refused(lambda: load_generation_model(ckpt), "tokenizer.json", "symbolic link")


def test_symlinked_weights_outside_are_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "outside" / "model.safetensors"
    shutil.move(ckpt / "model.safetensors", outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    _refused(lambda: load_generation_model(ckpt), "model.safetensors", "symbolic link")
    _refused(lambda: models.build("llama-tiny", weights_dir=ckpt), "model.safetensors", "symbolic link")


def test_hard_link_to_a_file_outside_is_refused(ckpt: Path) -> None:
    outside = ckpt.parent / "outside" / "tokenizer_config.json"
    outside.write_text(json.dumps({"bos_token": "<s>"}))
    (ckpt / "tokenizer_config.json").unlink()
    os.link(outside, ckpt / "tokenizer_config.json")
    _refused(lambda: Tokenizer.from_hf_dir(ckpt), "tokenizer_config.json", "hard links")


def test_a_dangling_symlink_is_refused_not_skipped(ckpt: Path) -> None:
    (ckpt / "tokenizer_config.json").unlink()
    (ckpt / "tokenizer_config.json").symlink_to(ckpt.parent / "outside" / "gone.json")
    _refused(lambda: Tokenizer.from_hf_dir(ckpt), "tokenizer_config.json", "symbolic link")


@pytest.mark.parametrize("name", ["config.json", "zz.safetensors", "tokenizer.json"])
def test_a_fifo_is_refused_without_blocking(ckpt: Path, name: str) -> None:
    if (ckpt / name).exists():
        (ckpt / name).unlink()
    os.mkfifo(ckpt / name)
    t0 = time.monotonic()
    with _fifo_watchdog(ckpt / name):
        _refused(lambda: load_generation_model(ckpt), name, "not a regular file")
    assert time.monotonic() - t0 < 4.0


def test_a_text_file_past_the_cap_is_refused_before_it_is_read(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec import modelfiles

    monkeypatch.setattr(modelfiles, "TEXT_LIMIT", 4096)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "pad": "x" * 5000}))
    _refused(lambda: Tokenizer.from_hf_dir(ckpt), "tokenizer_config.json", "bytes")


def test_config_json_linked_to_dev_zero_is_one_line(ckpt: Path) -> None:
    """Before the fix this read /dev/zero until memory ran out: run in a capped subprocess."""
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("/dev/zero")

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    code = "import sys; from fusec.cli import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "generate", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens",
                        "1"], capture_output=True, text=True, timeout=120, preexec_fn=cap)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fusec: error: ")]
    assert r.returncode == 1 and len(lines) == 1, r.stderr[-2000:]
    assert "config.json" in lines[0] and "symbolic link" in lines[0], lines[0]


# ---- 2./3. config.json: types, values, the layer count -------------------------------------------------------

BAD_CONFIGS: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "tie_str": (lambda c: c.update(tie_word_embeddings="no"), "tie_word_embeddings"),
    "bias_str": (lambda c: c.update(attention_bias="false"), "attention_bias"),
    "mlp_bias_str": (lambda c: c.update(mlp_bias="false"), "mlp_bias"),
    "rope_list": (lambda c: c.update(rope_parameters=[1]), "rope_parameters"),
    "rope_scaling_str": (lambda c: (c.pop("rope_parameters"), c.update(rope_scaling="linear")), "rope_scaling"),
    "theta_str": (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), "rope_theta"),
    "theta_zero": (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 0}), "rope_theta"),
    "theta_top_inf": (lambda c: (c.pop("rope_parameters"), c.update(rope_theta=math.inf)), "rope_theta"),
    "heads0_no_head_dim": (lambda c: (c.pop("head_dim"), c.update(num_attention_heads=0)), "num_attention_heads"),
    "hidden_float": (lambda c: c.update(hidden_size=64.0), "hidden_size"),
    "heads_float": (lambda c: c.update(num_attention_heads=4.0, num_key_value_heads=2.0), "num_attention_heads"),
    "maxpos_str": (lambda c: c.update(max_position_embeddings="64"), "max_position_embeddings"),
    "vocab_str": (lambda c: c.update(vocab_size="256"), "vocab_size"),
    "vocab_bool": (lambda c: c.update(vocab_size=True), "vocab_size"),
    "negative_heads": (lambda c: c.update(head_dim=-16, num_attention_heads=-4, num_key_value_heads=-2),
                       "num_attention_heads"),
    "eps_nan": (lambda c: c.update(rms_norm_eps=math.nan), "rms_norm_eps"),
    "eps_str": (lambda c: c.update(rms_norm_eps="1e-6"), "rms_norm_eps"),
    "act_list": (lambda c: c.update(hidden_act=["silu"]), "hidden_act"),
    "eos_str": (lambda c: c.update(eos_token_id="x"), "eos_token_id"),
    "eos_dict": (lambda c: c.update(eos_token_id={"a": 1}), "eos_token_id"),
    "eos_float": (lambda c: c.update(eos_token_id=2.7), "eos_token_id"),
    "eos_negative_in_list": (lambda c: c.update(eos_token_id=[2, -1]), "eos_token_id"),
    "layers_huge": (lambda c: c.update(num_hidden_layers=10**12), "num_hidden_layers"),
    "layers_short": (lambda c: c.update(num_hidden_layers=1), "num_hidden_layers"),
    "head_dim_odd": (lambda c: c.update(head_dim=15), "head_dim"),
    "sliding_str": (lambda c: c.update(model_type="qwen3", use_sliding_window="false"), "use_sliding_window"),
    "vocab_past_limit": (lambda c: c.update(vocab_size=2**40), "elements"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_config_fields_are_checked_by_type(ckpt: Path, case: str) -> None:
    edit, needle = BAD_CONFIGS[case]
    _edit_config(ckpt, edit)
    family = json.loads((ckpt / "config.json").read_text())["model_type"]
    base = models.get_config({"llama": "llama-tiny", "qwen3": "qwen3-tiny"}[family])
    msg = _refused(lambda: config_from_hf(base, ckpt), needle)
    assert "config.json" in msg


def test_a_config_that_is_not_an_object_is_one_error(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("[1, 2]")
    _refused(lambda: load_generation_model(ckpt), "config.json", "JSON object")
    (ckpt / "config.json").write_text("[" * 100_000)  # nested past the recursion limit
    _refused(lambda: load_generation_model(ckpt), "config.json")


def test_a_huge_layer_count_is_refused_before_building(ckpt: Path) -> None:
    _edit_config(ckpt, lambda c: c.update(num_hidden_layers=10**12))
    _refused(lambda: _within(20, lambda: build_graphs(load_generation_model(ckpt), 1, 16, 8)),
             "num_hidden_layers", "2 layers")


@pytest.mark.parametrize("value", ["x", {"a": 1}, 2.7, True])
def test_eos_from_config_json_alone_is_checked(ckpt: Path, value: Any) -> None:
    """No tokenizer, no generation_config.json: the eos ids come from config.json (genmodel)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (ckpt / name).unlink()
    _edit_config(ckpt, lambda c: c.update(eos_token_id=value))
    _refused(lambda: load_generation_model(ckpt), "eos_token_id")


@pytest.mark.parametrize("value", ["x", [2, "x"], 2.5, -3])
def test_eos_of_generation_config_is_checked(ckpt: Path, value: Any) -> None:
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    _refused(lambda: Tokenizer.from_hf_dir(ckpt), "generation_config.json", "eos_token_id")


def test_registry_refuses_zero_heads_without_dividing() -> None:
    import dataclasses

    base = models.get_config("llama-tiny")
    for change in ({"num_heads": 0}, {"num_heads": -4, "head_dim": -16, "num_kv_heads": -2},
                   {"hidden_size": 2, "head_dim": 0}, {"num_layers": 2.0}):
        with pytest.raises(ModelError):
            dataclasses.replace(base, **change)


# ---- 4. tensor dtypes from the header ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype,nbytes", [("F8_E4M3", 1.0), ("F8_E5M2", 1.0), ("F4", 0.5), ("F6_E2M3", 0.75),
                                          ("I32", 4.0)])
def test_unsupported_tensor_dtypes_are_one_error(ckpt: Path, dtype: str, nbytes: float) -> None:
    raw = (ckpt / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    tensors = {k: (v["dtype"], v["shape"], body[v["data_offsets"][0]:v["data_offsets"][1]])
               for k, v in header.items() if k != "__metadata__"}
    shape = tensors["model.norm.weight"][1]
    tensors["model.norm.weight"] = (dtype, shape, b"\x01" * math.ceil(math.prod(shape) * nbytes))
    head, data = {}, b""
    for k, (dt, s, blob) in tensors.items():
        head[k] = {"dtype": dt, "shape": s, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    hj = json.dumps(head).encode()
    hj += b" " * (-len(hj) % 8)
    (ckpt / "model.safetensors").write_bytes(struct.pack("<Q", len(hj)) + hj + data)
    _refused(lambda: models.build("llama-tiny", weights_dir=ckpt), "model.norm.weight", dtype)


# ---- 5. a sentencepiece vocabulary's scores ---------------------------------------------------------------

@pytest.mark.parametrize("bad", ["x", None, [1.0], math.nan])
def test_sentencepiece_scores_must_be_numbers(bad: Any) -> None:
    tokens = ["<unk>", "<s>", "</s>", "\u2581a", "b", "\u2581ab"]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": [0.0, 0.0, 0.0, -1.0, bad, -0.5], "tokenizer.ggml.token_type": [2, 3, 3, 1, 1, 1]}
    _refused(lambda: Tokenizer.from_gguf(md, name="spm.gguf"), "tokenizer.ggml.scores[4]")


def test_gguf_tokenizer_flags_must_be_bools() -> None:
    tokens = ["<unk>", "<s>", "</s>", "\u2581a"]
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": [0.0] * 4,
          "tokenizer.ggml.add_bos_token": "false"}
    _refused(lambda: Tokenizer.from_gguf(md, name="spm.gguf"), "add_bos_token")


# ---- 6. chat templates on a budget ------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}]

HOSTILE_TEMPLATES = {
    "nested_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    "repeat": "{{ 'x' * 10000000 }}",
    # sizes that stay affordable without the budget (16M characters), so the test fails, not crashes, without it
    "doubling_concat": "{% set ns = namespace(s='ab') %}{% for i in range(23) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling_plus": "{% set ns = namespace(s='ab') %}{% for i in range(23) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "replace_growth": "{% set ns = namespace(s='aaaa') %}{% for i in range(11) %}"
                      "{% set ns.s = ns.s.replace('a', 'aaaa') %}{% endfor %}",
    "center": "{{ 'x'|center(10000000) }}",
    "width": "{{ '%010000000d' % 1 }}",
    "power": "{{ 7 ** 10000 }}",
    "shared_list": "{% set ns = namespace(x=[1]) %}{% for i in range(22) %}{% set ns.x = [ns.x, ns.x] %}"
                   "{% endfor %}{{ ns.x }}",
    "long_output": "{% for i in range(100000) %}{% for j in range(9) %}{{ 'x' * 100 }}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_hostile_template_is_stopped(name: str) -> None:
    _refused(lambda: _within(30, lambda: apply_chat_template(HOSTILE_TEMPLATES[name], MSGS)), "budget")


def test_hf_template_loop_is_stopped(ckpt: Path) -> None:
    (ckpt / "chat_template.jinja").write_text(HOSTILE_TEMPLATES["nested_loops"])
    tok = Tokenizer.from_hf_dir(ckpt)
    _refused(lambda: _within(30, lambda: tok.apply_chat_template(MSGS)), "chat template", "budget")


def test_long_real_conversation_renders_as_transformers_does() -> None:
    """The budget leaves real templates alone: 600 messages through the Llama-3-style and SmolLM2
    templates of test_text, compared with transformers' renderer."""
    from test_text import TEMPLATES
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = []
    for i in range(300):
        msgs += [{"role": "user", "content": f"question {i} " + "lorem ipsum " * 40},
                 {"role": "assistant", "content": f"answer {i} " + "dolor sit " * 40}]
    for name in ("smollm2", "llama3-ish", "chatml"):
        want = render_jinja_template([msgs], chat_template=TEMPLATES[name], add_generation_prompt=True,
                                     bos_token="<s>", eos_token="</s>")[0][0]
        assert apply_chat_template(TEMPLATES[name], msgs, True, bos_token="<s>", eos_token="</s>") == want
