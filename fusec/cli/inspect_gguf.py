"""``fusec inspect FILE.gguf``: what a GGUF file holds, from its header alone (no weight is read or
dequantized, no tokenizer built): the architecture and whether ``fusec generate`` runs it (the
one-line reason when not), the model's dims and options as fusec reads them, the tokenizer's
metadata and the tensor types with their counts and bytes. Every string from the file is printed
escaped (``fmt_name``)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any

from fusec.cli._common import fmt_name
from fusec.errors import ModelError

# ModelConfig fields the report shows (the rest are the builder's bookkeeping)
_CONFIG_FIELDS = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "max_positions", "norm_eps", "activation", "tie_word_embeddings",
                  "attention_bias", "qkv_bias", "qk_norm", "sliding_window", "attn_softcap", "final_softcap",
                  "norm_offset", "sandwich_norms", "fused_projections", "rope_theta", "rope_local_theta")


def gguf_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON-able report of GGUF file ``path``. ModelError only for a file that is not GGUF."""
    from fusec.models.gguf import supported_types
    from fusec.models.gguf_arch import gguf_config
    from fusec.models.gguf_file import _open, read_metadata

    supported = supported_types()
    p = Path(path)
    reader = _open(p)
    md = read_metadata(reader, p)
    tensors = {t.name: t for t in reader.tensors}
    arch = md.get("general.architecture")
    rep: dict[str, Any] = {"file": os.fspath(p), "gguf_version": reader.version, "architecture": arch,
                           "name": md.get("general.name"), "file_bytes": p.stat().st_size}
    try:
        cfg = gguf_config(md, p, tensors)
    except ModelError as e:
        rep["generate"] = {"supported": False, "reason": str(e)}
        cfg = None
    else:
        rep["generate"] = {"supported": True}
        rep["config"] = {f: getattr(cfg, f) for f in _CONFIG_FIELDS}
        rep["config"]["rope_dims"] = cfg.rope_dims
        rep["config"]["windowed_layers"] = [i for i in range(cfg.num_layers) if cfg.window(i)]
        rep["config"]["attention_scale"] = cfg.attention_scale
        rs = cfg.rope_scaling
        rep["config"]["rope_scaling"] = None if rs is None else {  # the fields that differ from the defaults
            f.name: getattr(rs, f.name) for f in dataclasses.fields(rs)
            if f.name == "kind" or getattr(rs, f.name) != f.default}
    tok = md.get("tokenizer.ggml.tokens")
    template = md.get("tokenizer.chat_template")

    def token(key: str) -> Any:
        i = md.get(key)
        if isinstance(i, int) and isinstance(tok, list) and 0 <= i < len(tok):
            return {"id": i, "token": tok[i]}
        return i

    rep["tokenizer"] = {
        "model": md.get("tokenizer.ggml.model"), "pre": md.get("tokenizer.ggml.pre"),
        "tokens": len(tok) if isinstance(tok, list) else None,
        "merges": len(md["tokenizer.ggml.merges"]) if isinstance(md.get("tokenizer.ggml.merges"), list) else None,
        "bos": token("tokenizer.ggml.bos_token_id"), "eos": token("tokenizer.ggml.eos_token_id"),
        "eot": token("tokenizer.ggml.eot_token_id"), "add_bos_token": md.get("tokenizer.ggml.add_bos_token"),
        "add_space_prefix": md.get("tokenizer.ggml.add_space_prefix"),
        "chat_template_chars": len(template) if isinstance(template, str) else None,
    }
    types: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for t in reader.tensors:
        types[t.tensor_type.name] += 1
        nbytes[t.tensor_type.name] += t.n_bytes
    rep["tensors"] = {"count": len(reader.tensors), "elements": sum(t.n_elements for t in reader.tensors),
                      "types": {k: {"count": types[k], "bytes": nbytes[k], "supported": k in supported}
                                for k in sorted(types)}}
    return rep


def render_gguf(rep: dict[str, Any]) -> str:
    from fusec.runtime.guard import fmt_bytes

    lines = [f"GGUF file {fmt_name(rep['file'])} (version {rep['gguf_version']}, {fmt_bytes(rep['file_bytes'])})",
             f"architecture: {fmt_name(str(rep['architecture']))}" + (f"  name: {fmt_name(str(rep['name']))}"
                                                                       if rep.get("name") else "")]
    gen = rep["generate"]
    lines.append("fusec generate: " + ("supported" if gen["supported"] else f"not supported: {gen['reason']}"))
    cfg = rep.get("config")
    if cfg:
        lines.append("model:")
        for k, v in cfg.items():
            if v in (None, False, 0, 0.0, []) and k not in ("family", "num_kv_heads"):
                continue
            lines.append(f"  {k:<20} {fmt_name(str(v)) if isinstance(v, str) else v}")
    lines.append("tokenizer:" if rep["tokenizer"]["model"] is not None else "tokenizer: none (generate from token ids)")
    for k, v in rep["tokenizer"].items():
        if v is None:
            continue
        if isinstance(v, dict):
            v = f"{v['id']} {fmt_name(str(v['token']))}"
        elif isinstance(v, str):
            v = fmt_name(v)
        lines.append(f"  {k:<20} {v}")
    t = rep["tensors"]
    lines.append(f"tensors: {t['count']} ({t['elements']:,} elements)")
    for name, row in t["types"].items():
        mark = "" if row["supported"] else "  (fusec does not dequantize this type)"
        lines.append(f"  {fmt_name(name):<8} {row['count']:>5}  {fmt_bytes(row['bytes']):>10}{mark}")
    return "\n".join(lines)
