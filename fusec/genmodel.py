"""Where a model to generate with comes from, and compiling it into a generation plan.

``load_generation_model(model)`` accepts a built-in name (``llama-tiny``, ``qwen3-tiny``,
``qwen3-0.6b``; random weights, or a local HF checkpoint with ``weights_dir``), a local HF
checkpoint directory (``config.json`` + ``*.safetensors`` + ``tokenizer.json`` of any Llama-style
family: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 1/2/3, Phi-3; models/families.py), a hub id
``org/name`` found in the local Hugging Face cache (``fusec.hubcache``; never downloaded), or a
GGUF file (architectures llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3; ``models/gguf.py``).
``fusec.compiler.compile_generation`` turns it into one plan with two entry points, "prefill" and
"decode", sharing the weights and the KV-cache state, the tokenizer stored in the plan when the
model has one.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fusec.errors import InputError, ModelError


@dataclasses.dataclass
class GenModel:
    config: Any  # fusec.models.ModelConfig (vocab_size, num_layers are read from it)
    weights: Any  # fusec.models.generate.SharedWeights (None when ``builder`` makes the graphs)
    tokenizer: Any  # fusec.text.Tokenizer or None
    eos_ids: tuple[int, ...]
    source: str
    # Makes {"prefill", "decode"} graphs from (GenerationShape, eos_ids) for sources that are not
    # built from a config (an imported ONNX decoder); None: models/generate.py's builders.
    builder: Callable[[Any, tuple[int, ...]], dict[str, Any]] | None = None


def load_generation_model(model: str | os.PathLike[str], weights_dir: str | os.PathLike[str] | None = None,
                          seed: int = 0, packed: bool = True) -> GenModel:
    """``packed=False``: a GGUF file's quantized weights are dequantized at load (``load_gguf``);
    refused for any other model (its weights are not packed)."""
    from fusec.models import registry
    from fusec.models.generate import SharedWeights, check_generation_model

    text = os.fspath(model)
    from fusec.hubcache import is_hub_id

    if is_hub_id(text) and weights_dir is None:  # org/name: the local Hugging Face cache's copy
        from fusec.hubcache import model_path

        text = model_path(text)
    if not packed and not text.lower().endswith(".gguf"):
        raise InputError(f"{text}: --dequantize applies to GGUF files (their quantized weights); this model's "
                         "weights are not packed")
    if text.lower().endswith(".gguf"):
        from fusec.models.gguf import load_gguf

        from fusec.models.weights import model_weights

        g = load_gguf(text, packed=packed)
        return GenModel(g.config, SharedWeights(model_weights(g.config, g.weights)), g.tokenizer, tuple(g.eos_ids),
                        os.path.basename(text))
    if text.lower().endswith(".onnx"):  # a decoder exported with a KV cache (past_key_values.* / present.*)
        from fusec.frontend.kv_cache import onnx_generation_model

        cfg, builder = onnx_generation_model(text)  # eos ids from a sibling generation_config.json / config.json
        return GenModel(cfg, None, None, _config_eos(Path(text).parent), os.path.basename(text), builder=builder)
    if os.path.isdir(text) and weights_dir is None:
        return _from_checkpoint(None, Path(text))
    cfg = registry.get_config(text)  # ModelError listing the names when unknown
    check_generation_model(cfg)
    if weights_dir is not None:
        return _from_checkpoint(cfg, Path(weights_dir))
    from fusec.models.weights import RandomWeights

    return GenModel(cfg, SharedWeights(RandomWeights(seed)), None, (), text)


def _from_checkpoint(base: Any, path: Path) -> GenModel:
    """A Hugging Face checkpoint directory: ``base`` None reads any Llama-style decoder family
    from its config.json (models/hf_config.py); a built-in config takes the checkpoint's dims."""
    from fusec.modelfiles import read_json_in_dir
    from fusec.models.generate import SharedWeights
    from fusec.models.hf_weights import HFWeights, config_from_hf, hf_decoder_config
    from fusec.models.weights import model_weights

    if base is None and read_json_in_dir(path, "config.json", missing_ok=True) is None:  # a link, a FIFO...: refused
        raise ModelError(f"{path}: not a Hugging Face checkpoint directory (it has no config.json)")
    cfg = hf_decoder_config(path) if base is None else config_from_hf(base, path)
    tok = None
    if os.path.lexists(path / "tokenizer.json"):  # a link or FIFO there is refused, not skipped
        from fusec.text import Tokenizer

        tok = Tokenizer.from_hf_dir(path)
    eos = tuple(tok.eos_ids) if tok is not None else _config_eos(path)
    return GenModel(cfg, SharedWeights(model_weights(cfg, HFWeights(path, cfg))), tok, eos, path.name)


def _config_eos(path: Path) -> tuple[int, ...]:
    """The eos_token_id (one id or a list) of ``path``'s generation_config.json, else its
    config.json; () when neither names one. ModelError for ids that are not ints >= 0."""
    from fusec.modelfiles import read_json_in_dir
    from fusec.text import config_token_ids

    for name in ("generation_config.json", "config.json"):
        data = read_json_in_dir(path, name, missing_ok=True)
        if data is not None and data.get("eos_token_id") is not None:
            return config_token_ids(data["eos_token_id"], f"{os.fspath(path / name)!r}: eos_token_id")
    return ()


def generation_support() -> dict[str, Any]:
    """What ``load_generation_model`` accepts, from the tables that decide it: decoder families
    (HF model_type, GGUF architecture), GGUF tensor types, RoPE scalings, refused kinds."""
    from fusec.models.families import FAMILIES, MOE, MULTIMODAL
    from fusec.models.gguf import supported_types
    from fusec.models.rope import ACCEPTED

    try:
        gguf_types = list(supported_types())
    except ImportError:  # the optional gguf package decides what dequantizes
        gguf_types = ["(install the gguf package to read GGUF files)"]

    return {"families": {f.name: {"hf_model_type": list(f.hf_types), "gguf_architecture": f.gguf_arch or "llama"}
                         for f in FAMILIES.values()},
            "gguf_types": gguf_types, "rope_scaling": list(ACCEPTED),
            "refused": {"mixture_of_experts": sorted(MOE), "multimodal": sorted(MULTIMODAL)}}


def support_text() -> str:
    """``generation_support()`` as the lines ``fusec generate --help`` prints."""
    import textwrap

    s = generation_support()
    fams = ", ".join(f"{'/'.join(v['hf_model_type'])} ({v['gguf_architecture']})" for v in s["families"].values())
    lines = [f"families, as HF model_type (GGUF architecture): {fams}",
             f"GGUF tensor types: {', '.join(s['gguf_types'])}",
             f"RoPE scaling: {', '.join(s['rope_scaling'])} (longrope up to its original context), and GGUF's "
             "rope_freqs / rope_factors tensors",
             "refused, in one line naming the architecture: mixture-of-experts (qwen3_moe, mixtral, llama4, ...) "
             "and multimodal checkpoints"]
    return "accepted models:\n" + "\n".join(textwrap.fill(ln, 96, initial_indent="  ", subsequent_indent="    ")
                                             for ln in lines)


def build_graphs(gm: GenModel, batch: int, max_seq_len: int, prefill_len: int | None,
                 eos_ids: Sequence[int] | None = None, storage: str | None = None,
                 admit_batch: int = 0, join: int = 0) -> dict[str, Any]:
    """The prefill and decode graphs (and with ``admit_batch`` the admit entry's:
    models/generate.py; with ``join`` (J prompts a step) the join entry's: models/join.py);
    ``storage`` ("f16"/"bf16"): the compile's storage dtype, in which the large weights are held
    (``fusec.models.weights.StoredWeights``)."""
    from fusec.models.generate import GenerationShape, build_generation

    shape = GenerationShape(batch, max_seq_len, prefill_len if prefill_len is not None else min(max_seq_len, 128),
                            admit_batch, join)
    eos = tuple(gm.eos_ids if eos_ids is None else eos_ids)
    if gm.builder is not None:
        if admit_batch or join:
            raise InputError(f"{gm.source}: {'an admit entry (--admit-batch)' if admit_batch else 'a join entry'} is "
                             "built for fusec's own decoder builders, not for a model exported with its KV cache")
        return gm.builder(shape, eos)
    weights = gm.weights.stored(storage)
    graphs = build_generation(gm.config, weights, shape, eos)
    weights.finish()
    return graphs


def plan_tokenizer(plan: Any) -> Any:
    """The tokenizer a generation plan carries, or None."""
    info = plan.manifest.get("generation", {}).get("tokenizer")
    if info is None:
        return None
    import tokenizers

    from fusec.text import Tokenizer

    try:
        backend = tokenizers.Tokenizer.from_str(bytes(plan.blob("tokenizer")).decode("utf-8"))
    except Exception as e:  # the tokenizers library raises its own exception types
        raise ModelError(f"the plan's tokenizer cannot be read: {e}") from None
    return Tokenizer(backend, bos_id=info.get("bos_id"), eos_ids=info.get("eos_ids") or (), add_bos=info.get("add_bos"),
                     chat_template=info.get("chat_template"))


def encode_prompts(tokenizer: Any, prompts: Sequence[Any], chat: bool = False, system: str | None = None,
                   template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Token ids of each prompt: lists of ids pass through; strings need a tokenizer. ``chat``:
    each text prompt is the user's message in the model's chat template, after ``system``'s;
    ``template_kwargs`` (e.g. ``{"enable_thinking": False}``) are passed to it as variables."""
    if system is not None and not chat:
        raise InputError("a system message goes into the chat template: give --chat (chat=True) with --system (system=)")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise InputError("this model carries no tokenizer: give token ids (--prompt-ids) instead of text")
            if chat:
                messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                    [{"role": "user", "content": p}]
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {}))
                out.append(tokenizer.encode(text, add_bos=False))
            else:
                out.append(tokenizer.encode(p))
        else:
            out.append([int(t) for t in p])
    return out
