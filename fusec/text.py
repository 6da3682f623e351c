"""Text in and out of a language model: a tokenizer and chat-template rendering.

    from fusec.text import Tokenizer, apply_chat_template
    tok = Tokenizer.from_gguf(model.metadata_or_reader)      # or Tokenizer.from_hf_dir("checkpoint/")
    ids = tok.encode("Hello")                                # list[int]
    tok.decode(ids)                                          # "Hello"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])

The tokenizer runs on Hugging Face's ``tokenizers`` library. From a GGUF file it is rebuilt out
of llama.cpp's metadata (``tokenizer.ggml.*``): a byte-level BPE ("gpt2") with the pre-tokenizer
``tokenizer.ggml.pre`` names, or a sentencepiece BPE ("llama"); control tokens (token_type 3) are
special tokens. Chat templates come from model files, so they render in jinja2's immutable sandbox.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import InputError, ModelError

UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # llama.cpp token types

# GPT-2's pre-tokenizer regex is ByteLevel(use_regex=True)'s own; these replace it. Patterns as
# published with the models' tokenizers (Llama 3 / tiktoken cl100k, Qwen2).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's pre-tokenizer types).
_PRE_GPT2 = ("default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat")
_PRE_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_PRE_SPLIT = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the
    others (controls, space, ...) move to code points 256 and up, in byte order."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


class Tokenizer:
    """Encode text to token ids and back; ``bos_id``, ``eos_ids``, ``vocab_size``, ``chat_template``."""

    def __init__(self, backend: Any, *, bos_id: int | None, eos_ids: Sequence[int], add_bos: bool | None,
                 chat_template: str | None = None, vocab_size: int | None = None):
        self.backend = backend  # a tokenizers.Tokenizer
        self.bos_id = bos_id
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.add_bos = add_bos  # None: the backend's post-processor decides (HF tokenizer.json)
        self.chat_template = chat_template
        self.vocab_size = int(vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True))

    # ---- building -------------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: Any, *, name: str = "<gguf>") -> Tokenizer:
        """The tokenizer of a GGUF file, from its metadata: a ``{key: value}`` mapping (as
        ``fusec.models.gguf.read_metadata`` returns), a ``gguf.GGUFReader`` or a file path."""
        from fusec.models.gguf import _open, read_metadata

        if isinstance(source, (str, os.PathLike)):
            name = os.fspath(source)
            source = read_metadata(_open(Path(source)), source)
        elif hasattr(source, "fields"):  # a gguf.GGUFReader
            source = read_metadata(source, name)
        md: Mapping[str, Any] = source
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ModelError(f"GGUF file {name!r} has no metadata key 'tokenizer.ggml.model'")
        if model not in ("gpt2", "llama"):
            raise ModelError(f"GGUF file {name!r}: tokenizer model {model!r} is not supported "
                             "(only 'gpt2', byte-level BPE, and 'llama', sentencepiece BPE)")
        tokens = _str_list(md, "tokenizer.ggml.tokens", name)
        types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.token_type has {len(types)} entries "
                             f"for {len(tokens)} tokens")
        if model == "gpt2":
            merges = _str_list(md, "tokenizer.ggml.merges", name)
            backend = _byte_level_bpe(tokens, merges, types, md.get("tokenizer.ggml.pre", "default"), name)
        else:
            scores = md.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.scores is missing or does not match the tokens")
            merges = _str_list(md, "tokenizer.ggml.merges", name) if "tokenizer.ggml.merges" in md else None
            backend = _sentencepiece_bpe(tokens, scores, types, merges, bool(md.get("tokenizer.ggml.add_space_prefix",
                                                                                    True)), name)
        bos, eos = gguf_special_ids(md, name)
        template = md.get("tokenizer.chat_template")
        return cls(backend, bos_id=bos, eos_ids=eos,
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", model == "llama")),
                   chat_template=template if isinstance(template, str) else None, vocab_size=len(tokens))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint directory: tokenizer.json, plus the chat
        template, bos/eos tokens from tokenizer_config.json (or chat_template.jinja) and the
        eos_token_id (one id or a list) of generation_config.json."""
        import tokenizers

        d = Path(path)
        file = d / "tokenizer.json"
        if not file.is_file():
            raise ModelError(f"checkpoint directory {os.fspath(d)!r} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(os.fspath(file))
        except Exception as e:
            raise ModelError(f"cannot read {os.fspath(file)!r}: {str(e).splitlines()[0] if str(e) else e!r}") from None
        config = _json(d / "tokenizer_config.json")
        gen = _json(d / "generation_config.json")

        def token_id(tok: Any, where: str) -> int | None:
            if isinstance(tok, dict):
                tok = tok.get("content")
            if tok is None:
                return None
            i = backend.token_to_id(tok) if isinstance(tok, str) else None
            if i is None:
                raise ModelError(f"{where} in {os.fspath(d)!r}: token {tok!r} is not in the vocabulary")
            return i

        bos = token_id(config.get("bos_token"), "bos_token")
        eos: list[int] = []
        gen_eos = gen.get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(i, int) and not isinstance(i, bool):
                eos.append(i)
        cfg_eos = token_id(config.get("eos_token"), "eos_token")
        if cfg_eos is not None and cfg_eos not in eos:
            eos.insert(0, cfg_eos)
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = d / "chat_template.jinja"  # transformers >= 4.43 saves the template beside the config
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return cls(backend, bos_id=bos, eos_ids=eos, add_bos=None,
                   chat_template=template if isinstance(template, str) else None)

    # ---- use ------------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``. ``add_bos`` None: as the model file says (GGUF
        ``tokenizer.ggml.add_bos_token``; a HF tokenizer.json's post-processor); True/False: force."""
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a str, got {type(text).__name__}")
        try:  # lone surrogates (undecodable argv bytes arrive so) are no text: the backend raises TypeError on them
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"text to encode is not valid Unicode: lone surrogate U+{ord(text[e.start]):04X} at "
                             f"character {e.start} (bytes that were not UTF-8?)") from None
        if add_bos is None and self.add_bos is None:
            return list(self.backend.encode(text, add_special_tokens=True).ids)
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        if add_bos if add_bos is not None else self.add_bos:
            if self.bos_id is None:
                raise InputError("this tokenizer has no BOS token to add")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids; special (control) tokens are dropped unless ``skip_special_tokens`` is False."""
        try:
            ids = [int(i) for i in ids]
        except (TypeError, ValueError):
            raise InputError("token ids to decode must be integers") from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    @property
    def bos_token(self) -> str:
        return (self.backend.id_to_token(self.bos_id) or "") if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return (self.backend.id_to_token(self.eos_ids[0]) or "") if self.eos_ids else ""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, **extra: Any) -> str:
        """Render ``messages`` with the model's chat template (or ``template``)."""
        template = template if template is not None else self.chat_template
        if template is None:
            raise ModelError("the model has no chat template")
        extra.setdefault("bos_token", self.bos_token)
        extra.setdefault("eos_token", self.eos_token)
        return apply_chat_template(template, messages, add_generation_prompt, **extra)


def gguf_special_ids(md: Mapping[str, Any], name: str = "<gguf>") -> tuple[int | None, tuple[int, ...]]:
    """(bos id, end-of-generation ids) of GGUF metadata: tokenizer.ggml.eos/eot/eom_token_id."""
    count = len(md.get("tokenizer.ggml.tokens") or ())

    def token_id(key: str) -> int | None:
        v = md.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < count):
            raise ModelError(f"GGUF file {name!r}: {key} {v!r} is not a token id")
        return v

    eos = (token_id(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return token_id("tokenizer.ggml.bos_token_id"), tuple(dict.fromkeys(i for i in eos if i is not None))


def _str_list(md: Mapping[str, Any], key: str, name: str) -> list[str]:
    v = md.get(key)
    if v is None:
        raise ModelError(f"GGUF file {name!r} has no metadata key {key!r}")
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ModelError(f"GGUF file {name!r}: metadata key {key!r} is not a list of strings")
    return v


def _byte_level_bpe(tokens: list[str], merges: list[str], types: Sequence[Any], pre: Any, name: str) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    alphabet = _byte_alphabet()
    letters = set(alphabet.values())

    def spelled(tok: str) -> bool:
        return set(tok) <= letters

    # Vocabulary tokens are written in the byte alphabet; a token that is not (an added token
    # stored as plain text) gets spelled in it, so BPE can still produce it.
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab[tok if spelled(tok) else "".join(alphabet[b] for b in tok.encode("utf-8"))] = i
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep or not a or not b:
            raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.merges entry {m!r} is not two tokens")
        pairs.append((a, b))
    try:
        # Llama 3's BPE (llama.cpp and Meta's tokenizer.json alike) takes a word found whole in
        # the vocabulary as one token, merges or not.
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=_PRE_SPLIT.get(pre) == _LLAMA3_SPLIT)
    except Exception as e:
        raise ModelError(f"GGUF file {name!r}: the BPE vocabulary/merges are unusable: {e}") from None
    backend = Tokenizer(bpe)
    if pre in _PRE_GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _PRE_DIGITS:  # llama.cpp splits off every digit first, then applies GPT-2's regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=True)])
    elif pre in _PRE_SPLIT:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_PRE_SPLIT[pre]), "isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    else:
        raise ModelError(f"GGUF file {name!r}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported")
    backend.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a mislabelled one nobody can reach: left out.
    _add_tokens(backend, tokens, types, spelled)
    return backend


def _add_tokens(backend: Any, tokens: list[str], types: Sequence[Any], keep: Any,
                special: tuple[int, ...] = (CONTROL,)) -> None:
    """Control tokens (<|im_start|>, </s>...) match whole in the text and are special (dropped by
    ``decode(skip_special_tokens=True)``); user-defined ones (<think>) match whole but are text."""
    from tokenizers import AddedToken

    def added(want: tuple[int, ...], is_special: bool) -> list[Any]:
        return [AddedToken(t, special=is_special, normalized=False)
                for t, ty in zip(tokens, types) if ty in want and keep(t)]

    backend.add_special_tokens(added(special, True))
    backend.add_tokens(added((USER_DEFINED,), False))


def _sentencepiece_bpe(tokens: list[str], scores: list[Any], types: Sequence[Any], merges: list[str] | None,
                       add_space_prefix: bool, name: str) -> Any:
    """A sentencepiece BPE vocabulary ("▁" for spaces, <0xXX> byte tokens as fallback) as a
    tokenizers BPE. Without merges in the file they come from the scores: sentencepiece joins the
    adjacent pair whose union scores best, so a pair's rank is its union's score."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        ranked = []
        for tok, score in zip(tokens, scores):
            splits = sorted(((tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in vocab and tok[k:] in vocab),
                            key=lambda p: (vocab[p[0]], vocab[p[1]]))
            ranked.extend((float(score), len(a), len(b), a, b) for a, b in splits)
        ranked.sort(key=lambda r: (r[0], r[1], r[2]), reverse=True)  # stable: ties keep the order above
        pairs = [(a, b) for _, _, _, a, b in ranked]
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True)
    except Exception as e:
        raise ModelError(f"GGUF file {name!r}: the sentencepiece vocabulary is unusable: {e}") from None
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                     prepend_scheme="first" if add_space_prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_tokens(backend, tokens, types, lambda t: True, special=(CONTROL, UNKNOWN))
    return backend


def _json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read {os.fspath(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ModelError(f"{os.fspath(path)!r} does not hold a JSON object")
    return data


# ---- chat templates -------------------------------------------------------------------------------------

class _TemplateRaised(Exception):
    """raise_exception() called by a template: the messages do not fit it."""


def _raise_exception(message: Any) -> None:
    raise _TemplateRaised(str(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _environment() -> Any:
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks in
        HF templates): renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV: Any = None


def apply_chat_template(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                        **extra: Any) -> str:
    """Render a chat ``template`` (jinja2, from a model file: run sandboxed) over ``messages``
    (``[{"role": ..., "content": ...}, ...]``), as Hugging Face's ``apply_chat_template(...,
    tokenize=False)`` does. ``extra`` (bos_token, eos_token, tools, ...) goes to the template.
    ModelError for a broken template, InputError when the template rejects the messages."""
    import jinja2

    global _ENV
    if not isinstance(template, str):
        raise ModelError(f"chat template must be a string, got {type(template).__name__}")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not all(
            isinstance(m, Mapping) for m in messages):
        raise InputError("chat messages must be a list of {'role': ..., 'content': ...} mappings")
    if _ENV is None:
        _ENV = _environment()
    try:
        compiled = _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ModelError(f"chat template has a syntax error (line {e.lineno}): {e.message}") from None
    context = {"bos_token": "", "eos_token": "", **extra}
    try:
        return compiled.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                               **context)
    except _TemplateRaised as e:
        raise InputError(f"chat template rejected the messages: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ModelError(f"chat template tried an unsafe operation: {e}") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"chat template failed on these messages: {first}") from None
