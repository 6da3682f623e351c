"""Chat templates of the decoder families with template switches (``--chat-template-kwargs``):
Qwen3-style thinking switches and Gemma-style role renaming render as transformers renders them,
and ``fusec generate --chat --chat-template-kwargs`` feeds the model exactly those tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import decoder_families as DF  # noqa: E402

from fusec.chat_template import apply_chat_template  # noqa: E402
from fusec.cli import main  # noqa: E402

# Written for these tests in the style of the families' templates: a thinking switch read from a
# template variable, reasoning stripped from earlier turns, Gemma's "model" role, system text
# folded into the first user turn, bos_token, raise_exception on a bad order.
QWEN3_STYLE = """{%- for m in messages %}
{%- if m.role == 'assistant' and '</think>' in m.content %}
{%- set content = m.content.split('</think>')[-1].lstrip('\\n') %}
{%- else %}{%- set content = m.content %}{%- endif %}
{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""
GEMMA_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}{%- set rest = messages[1:] %}
{%- else %}{%- set first = '' %}{%- set rest = messages %}{%- endif %}
{%- for m in rest %}
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate user/assistant') }}{% endif %}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] %}
{{- '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"""
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello."}, {"role": "user", "content": "2+2?"}]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("name", ["qwen3", "gemma"])
def test_family_templates_render_as_transformers(name: str, kwargs: dict[str, Any]) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    template = QWEN3_STYLE if name == "qwen3" else GEMMA_STYLE
    msgs = MESSAGES if name == "qwen3" else MESSAGES[:2] + [{"role": "assistant", "content": "Hello."}] + MESSAGES[3:]
    want = render_jinja_template([msgs], chat_template=template, add_generation_prompt=True, bos_token="<bos>",
                                 **kwargs)[0][0]
    got = apply_chat_template(template, msgs, True, bos_token="<bos>", **kwargs)
    assert got == want
    if name == "qwen3":
        assert ("<think>\n\n</think>" in got) == (kwargs.get("enable_thinking") is False)


def _hf_dir_with_tokenizer(tmp_path: Path) -> Path:
    """The tiny Qwen3 checkpoint with a byte-level BPE tokenizer.json of its 320 tokens (ids 0-2 are
    <|im_start|>, <|im_end|>, <|endoftext|>) and QWEN3_STYLE as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    d, _ = DF.checkpoint("qwen3", tmp_path)
    md = DF.tiny_vocab()
    tokens = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"] + md["tokenizer.ggml.tokens"][0][3:]
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"][0]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens[:3]])
    tok.save(os.fspath(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_STYLE, "eos_token": "<|im_end|>"}))
    return d


def test_cli_passes_chat_template_kwargs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    d = _hf_dir_with_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(d)
    ids = {}
    for kw in (None, '{"enable_thinking": false}'):
        argv = ["generate", str(d), "--chat", "--prompt", "What is 2+2?", "--max-new-tokens", "2", "--json"]
        assert main(argv + (["--chat-template-kwargs", kw] if kw else [])) == 0
        ids[kw] = json.loads(capsys.readouterr().out)["prompt_ids"][0]
        extra = json.loads(kw) if kw else {}
        want = hf.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=True,
                                      add_generation_prompt=True, return_dict=True, **extra)["input_ids"]
        assert ids[kw] == want
    assert ids[None] != ids['{"enable_thinking": false}']


@pytest.mark.parametrize("value, words", [("{nope", "not JSON"), ("[1]", "JSON object"),
                                          ('{"messages": []}', "messages")])
def test_bad_chat_template_kwargs_are_one_line(value: str, words: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    assert main(["generate", "qwen3-tiny", "--chat", "--prompt", "x", "--chat-template-kwargs", value]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat-template-kwargs" in err[0] and words in err[0], err
    assert main(["generate", "qwen3-tiny", "--prompt", "x", "--chat-template-kwargs", "{}"]) == 1
    assert "add --chat" in capsys.readouterr().err
