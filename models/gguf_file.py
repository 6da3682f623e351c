"""Reading a GGUF file (llama.cpp's format) without trusting it: the header is parsed here, every
count and offset checked against the file before it is used; ``fusec.models.gguf`` maps what it
reads to a Llama model. Tensors are memory-mapped views, dequantized by ggml's ``gguf`` package."""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from fusec.errors import ModelError

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

    def release(self) -> None:
        """Drop this tensor's pages of the memory map from the process (they are read back from the
        file if touched again): a packed or dequantized copy replaces them, so host memory holds the
        file's bytes once, not twice, while a model loads."""
        page = mmap.PAGESIZE
        start = self.data_offset // page * page
        if hasattr(self._buf, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            self._buf.madvise(mmap.MADV_DONTNEED, start, self.data_offset + self.n_bytes - start)

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
    from fusec.modelfiles import open_in_dir

    where = f"GGUF file {os.fspath(path)!r}"
    try:
        # as a model directory's files: a link is refused, except in a Hugging Face cache snapshot
        # where it resolves inside the repository (fusec.modelfiles); no FIFO, device or hard link
        fd, st = open_in_dir(path.parent, [path.name], where)
    except FileNotFoundError:
        raise ModelError(f"{where} does not exist") from None
    except OSError as e:
        raise ModelError(f"cannot read {where}: {e.strerror or e}") from None
    try:
        size = st.st_size
        if size < 24:
            raise ModelError(f"cannot read GGUF file {os.fspath(path)!r} (truncated or corrupt?): "
                             f"{size} bytes, shorter than a GGUF header")
        buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelError(f"cannot read {where}: {e.strerror or e}") from None
    finally:
        os.close(fd)
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
