"""Text in and out of a language model: a tokenizer and chat-template rendering.

    from fusec.text import Tokenizer, apply_chat_template
    tok = Tokenizer.from_gguf(model.metadata_or_reader)      # or Tokenizer.from_hf_dir("checkpoint/")
    ids = tok.encode("Hello")                                # list[int]
    tok.decode(ids)                                          # "Hello"
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])

The tokenizer runs on Hugging Face's ``tokenizers`` library. From a GGUF file it is rebuilt out
of llama.cpp's metadata (``tokenizer.ggml.*``): a byte-level BPE ("gpt2") with the pre-tokenizer
``tokenizer.ggml.pre`` names, or a sentencepiece BPE ("llama"); control tokens (token_type 3) are
special tokens. Chat templates come from model files: they render sandboxed and on a budget
(``fusec.chat_template``). The files of a HF directory are opened through fusec.modelfiles: inside the
directory only, no links, no FIFOs, a size cap.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .chat_template import apply_chat_template
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
        if not isinstance(types, list) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                  for t in types):
            raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.token_type is not a list of integers")
        if len(types) != len(tokens):
            raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.token_type has {len(types)} entries "
                             f"for {len(tokens)} tokens")
        if model == "gpt2":
            merges = _str_list(md, "tokenizer.ggml.merges", name)
            pre = md.get("tokenizer.ggml.pre", "default")
            if not isinstance(pre, str):
                raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.pre is {pre!r:.60}, not a string")
            backend = _byte_level_bpe(tokens, merges, types, pre, name)
        else:
            scores = md.get("tokenizer.ggml.scores")
            if not isinstance(scores, list) or len(scores) != len(tokens):
                raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.scores is missing or does not match the tokens")
            bad = next((i for i, x in enumerate(scores) if not _real(x)), None)
            if bad is not None:  # the merge ranks are sorted by score: each must be a number
                raise ModelError(f"GGUF file {name!r}: tokenizer.ggml.scores[{bad}] is {scores[bad]!r:.60}, "
                                 "not a number")
            merges = _str_list(md, "tokenizer.ggml.merges", name) if "tokenizer.ggml.merges" in md else None
            backend = _sentencepiece_bpe(tokens, scores, types, merges,
                                         _flag(md, "tokenizer.ggml.add_space_prefix", True, name), name)
        bos, eos = gguf_special_ids(md, name)
        template = md.get("tokenizer.chat_template")
        return cls(backend, bos_id=bos, eos_ids=eos,
                   add_bos=_flag(md, "tokenizer.ggml.add_bos_token", model == "llama", name),
                   chat_template=template if isinstance(template, str) else None, vocab_size=len(tokens))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer of a Hugging Face checkpoint directory: tokenizer.json, plus the chat
        template, bos/eos tokens from tokenizer_config.json (or chat_template.jinja) and the
        eos_token_id (one id or a list) of generation_config.json."""
        import tokenizers

        from .modelfiles import read_json_in_dir, read_text_in_dir

        d = Path(path)
        # every file is opened inside the directory only (no symlink, no FIFO, a size cap): fusec.modelfiles
        text = read_text_in_dir(d, "tokenizer.json", missing_ok=True)
        if text is None:
            raise ModelError(f"checkpoint directory {os.fspath(d)!r} has no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else repr(e)
            raise ModelError(f"cannot read {os.fspath(d / 'tokenizer.json')!r}: {first:.300}") from None
        del text
        config = read_json_in_dir(d, "tokenizer_config.json", missing_ok=True) or {}
        gen = read_json_in_dir(d, "generation_config.json", missing_ok=True) or {}

        def token_id(tok: Any, where: str) -> int | None:
            if isinstance(tok, dict):
                tok = tok.get("content")
            if tok is None:
                return None
            i = backend.token_to_id(tok) if isinstance(tok, str) else None
            if i is None:
                raise ModelError(f"{where} in {os.fspath(d)!r}: token {tok!r:.60} is not in the vocabulary")
            return i

        bos = token_id(config.get("bos_token"), "bos_token")
        gen_where = f"{os.fspath(d / 'generation_config.json')!r}"
        gen_eos = gen.get("eos_token_id")
        eos = list(config_token_ids(gen_eos, f"{gen_where}: eos_token_id")) if gen_eos is not None else []
        cfg_eos = token_id(config.get("eos_token"), "eos_token")
        if cfg_eos is not None and cfg_eos not in eos:
            eos.insert(0, cfg_eos)
        if bos is None and gen.get("bos_token_id") is not None:
            bos = _token_id_value(gen["bos_token_id"], f"{gen_where}: bos_token_id")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None:  # transformers >= 4.43 saves the template beside the config
            template = read_text_in_dir(d, "chat_template.jinja", missing_ok=True)
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


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)  # -inf sorts fine


def _flag(md: Mapping[str, Any], key: str, default: bool, name: str) -> bool:
    v = md.get(key, default)
    if not isinstance(v, bool):  # a string "false" is no flag (bool() of it is True)
        raise ModelError(f"GGUF file {name!r}: {key} is {v!r:.60}, not a bool")
    return v


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


def _token_id_value(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ModelError(f"{where} is {value!r:.60}, not a token id (an integer >= 0)")
    return value


def config_token_ids(value: Any, where: str) -> tuple[int, ...]:
    """Token ids from a Hugging Face config (``eos_token_id``: one id or a list of them): ints >= 0,
    never a bool, a float (2.7 is not 2), a string or an object; ModelError naming ``where``."""
    items = value if isinstance(value, list) else [value]
    return tuple(dict.fromkeys(_token_id_value(i, where) for i in items))
