"""Safe loading of ONNX files: parse without touching external data, validate every external-data
reference before any byte of it is read, check the model, and convert tensors to numpy.

Why by hand: ``onnx.load`` with external data follows whatever ``location`` the file names; a
hostile file could make us read ``/etc/passwd`` or ``../../secret`` into a weight. We parse with
``load_external_data=False``, validate each location against the model's directory (no absolute
paths, no ``..``, no symlink escaping the directory, file present, range inside the file) and only
then read the bytes ourselves. Models over 2 GB are never serialized: the checker gets the path.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from fusec.dtypes import DType
from fusec.errors import FusecError, ModelError
from fusec.modelfiles import open_in_dir
from fusec.shapes import check_size

_PROTO_LIMIT = 2**31 - 1  # protobuf refuses to serialize a message this large

# ONNX elem types fusec can hold in the IR. Other types may appear in folded shape arithmetic only.
ONNX_TO_DTYPE: dict[int, DType] = {
    TensorProto.FLOAT: DType.F32,
    TensorProto.FLOAT16: DType.F16,
    TensorProto.BFLOAT16: DType.BF16,
    TensorProto.INT64: DType.I64,
    TensorProto.INT32: DType.I32,
    TensorProto.BOOL: DType.BOOL,
    # reference-only dtypes (the GPU lowering refuses them, naming op and dtype)
    TensorProto.DOUBLE: DType.F64,
    TensorProto.INT16: DType.I16,
    TensorProto.INT8: DType.I8,
    TensorProto.UINT8: DType.U8,
    TensorProto.UINT16: DType.U16,
    TensorProto.UINT32: DType.U32,
    TensorProto.UINT64: DType.U64,
}


def onnx_type_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(elem_type).lower()
    except ValueError:
        return f"elem_type {elem_type}"


def np_dtype_of(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX elem type (bf16 via ml_dtypes); ModelError for types without one."""
    if elem_type in ONNX_TO_DTYPE:
        return ONNX_TO_DTYPE[elem_type].np
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except Exception:
        raise ModelError(f"unsupported ONNX element type {onnx_type_name(elem_type)}") from None


@dataclass
class LoadedModel:
    model: onnx.ModelProto
    label: str  # how error messages name the model (repr of the path, or '<ModelProto>')
    base_dir: str | None  # directory external data is relative to (None for an in-memory proto)

    def to_array(self, t: TensorProto, what: str) -> np.ndarray:
        """The contents of ``t`` as a numpy array; ``what`` names it in error messages."""
        if t.data_location == TensorProto.EXTERNAL:
            return self._read_external(t, what)
        try:
            return numpy_helper.to_array(t)
        except Exception as e:
            raise ModelError(f"{self.label}: cannot decode tensor {what!r} "
                             f"({onnx_type_name(t.data_type)}): {_one_line(e)}") from None

    def _read_external(self, t: TensorProto, what: str) -> np.ndarray:
        # validated again right before reading: protobuf wrappers have no stable identity to
        # remember the first validation by, and the file may have changed since. The bytes come
        # from the one descriptor that was checked (see fusec.modelfiles.open_in_dir), never from a new open.
        if self.base_dir is None:
            raise ModelError(f"{self.label}: tensor {what!r} stores its data externally; "
                             "import the model from its path so the data can be found")
        dt = np_dtype_of(t.data_type)
        shape = tuple(int(d) for d in t.dims)
        if any(d < 0 for d in shape):
            raise ModelError(f"{self.label}: external tensor {what!r} has a negative dim {list(shape)}")
        try:
            check_size(shape, f"external tensor {what!r}", dt.itemsize)
        except FusecError as e:
            raise ModelError(f"{self.label}: {e}") from None
        want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        fd, name, offset, length, size = _validate_external(t, what, self.base_dir, self.label, keep_open=True)
        try:
            if length is not None and length != want:
                raise ModelError(f"{self.label}: external tensor {what!r} has length {length} bytes, "
                                 f"its type {onnx_type_name(t.data_type)}{list(shape)} needs {want}")
            if offset + want > size:
                raise ModelError(f"{self.label}: external tensor {what!r}: offset {offset} + {want} bytes "
                                 f"is past the end of {name!r} ({size} bytes)")
            buf = bytearray(want)
            view, done = memoryview(buf), 0
            while done < want:
                n = os.preadv(fd, [view[done:]], offset + done)
                if n <= 0:
                    raise ModelError(f"{self.label}: external tensor {what!r}: {name!r} shrank while it was read")
                done += n
        except OSError as e:
            raise ModelError(f"{self.label}: external tensor {what!r}: cannot read {name!r}: {e.strerror or e}") from None
        finally:
            os.close(fd)
        return np.frombuffer(buf, dtype=dt.newbyteorder("<")).astype(dt, copy=False).reshape(shape)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(e).__name__)


def iter_tensors(graph: onnx.GraphProto) -> Iterator[tuple[TensorProto, str]]:
    """Every tensor stored in ``graph`` (initializers, Constant values, subgraphs), with a label."""
    for t in graph.initializer:
        yield t, t.name
    for st in graph.sparse_initializer:
        yield st.values, st.values.name
        yield st.indices, st.indices.name
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t, a.t.name or f"{node.name or node.op_type}.{a.name}"
            for t in a.tensors:
                yield t, t.name or f"{node.name or node.op_type}.{a.name}"
            if a.HasField("g"):
                yield from iter_tensors(a.g)
            for g in a.graphs:
                yield from iter_tensors(g)


def check_names(graph: onnx.GraphProto, label: str) -> None:
    """Every name in the graph (subgraphs included) is valid UTF-8: protobuf hands invalid UTF-8
    back as ``bytes``, which nothing downstream expects. Iterative: subgraphs may nest deeply."""
    stack = [graph]
    while stack:
        g = stack.pop()
        named = [("graph input", vi.name) for vi in g.input] + [("graph output", vi.name) for vi in g.output]
        named += [("value info", vi.name) for vi in g.value_info] + [("initializer", t.name) for t in g.initializer]
        for n in g.node:
            named.append(("node name", n.name))
            named += [(f"node {n.name!r} input", x) for x in n.input] + [(f"node {n.name!r} output", x) for x in n.output]
            for a in n.attribute:
                if a.HasField("g"):
                    stack.append(a.g)
                stack.extend(a.graphs)
        for what, name in named:
            if not isinstance(name, str):
                shown = bytes(name).decode("utf-8", "backslashreplace")
                raise ModelError(f"{label}: {what} {shown!r} is not valid UTF-8")


def _validate_external(t: TensorProto, what: str, base_dir: str, label: str,
                       keep_open: bool = False) -> tuple[int, str, int, int | None, int]:
    """Check one external-data reference; returns (fd or -1, location, offset, length, file size).
    With ``keep_open`` the caller reads from ``fd`` and closes it."""
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    where = f"{label}: external tensor {what!r} location {loc!r}"
    if not loc:
        raise ModelError(f"{label}: external tensor {what!r} has no location")
    parts = loc.replace("\\", "/").split("/")
    if os.path.isabs(loc) or loc.startswith(("/", "\\")) or (len(loc) > 1 and loc[1] == ":"):
        raise ModelError(f"{where} is an absolute path; external data must lie next to the model")
    if ".." in parts:
        raise ModelError(f"{where} contains '..'; external data must lie inside the model's directory")
    if "\0" in loc:
        raise ModelError(f"{where} contains a NUL character")
    try:  # realpath reads links: one swapped meanwhile (removed, replaced) is an OSError
        root = os.path.realpath(base_dir)
        full = os.path.realpath(os.path.join(root, *parts))
    except OSError as e:
        raise ModelError(f"{where}: cannot resolve the path ({e.strerror or e}; was it changed during the import?)") from None
    if os.path.commonpath([root, full]) != root:
        raise ModelError(f"{where} resolves outside the model's directory (symlink?)")
    try:
        offset = int(info.get("offset", "0"))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise ModelError(f"{where}: offset/length are not integers") from None
    if offset < 0 or (length is not None and length < 0):
        raise ModelError(f"{where}: negative offset or length")
    try:
        validated = os.stat(full)
    except FileNotFoundError:
        raise ModelError(f"{where}: file not found") from None
    except OSError as e:
        raise ModelError(f"{where}: {e.strerror or e}") from None
    if stat.S_ISDIR(validated.st_mode):
        raise ModelError(f"{where}: is a directory, not a file")
    rel = [p for p in parts if p not in ("", ".")]
    try:
        fd, st = open_in_dir(root, rel, where)
    except FileNotFoundError:
        raise ModelError(f"{where}: file not found") from None
    except OSError as e:
        raise ModelError(f"{where}: cannot open: {e.strerror or e}") from None
    try:
        if (st.st_dev, st.st_ino) != (validated.st_dev, validated.st_ino):
            raise ModelError(f"{where}: the file changed while it was checked (replaced or relinked); refusing it")
        size = st.st_size
        end = offset + (length or 0)
        if offset > size or end > size:
            raise ModelError(f"{where}: offset {offset} + length {length or 0} is past the end of the file ({size} bytes)")
    except BaseException:
        os.close(fd)
        raise
    if not keep_open:
        os.close(fd)
        fd = -1
    return fd, loc, offset, length, size


def load_model(model: str | os.PathLike | onnx.ModelProto) -> LoadedModel:
    """Parse and check ``model``; every failure is a one-line ModelError naming the file."""
    if isinstance(model, onnx.ModelProto):
        loaded = LoadedModel(model, "<ModelProto>", None)
        path = None
    else:
        path = os.fspath(model)
        label = repr(path)
        if not os.path.exists(path):
            raise ModelError(f"model file {label} not found")
        if not os.path.isfile(path):
            raise ModelError(f"model path {label} is not a file")
        try:
            proto = onnx.load(path, load_external_data=False)
        except Exception as e:  # DecodeError, truncated files, text files...
            raise ModelError(f"{label} is not a readable ONNX model: {_one_line(e)}") from None
        loaded = LoadedModel(proto, label, os.path.dirname(os.path.abspath(path)))
    proto = loaded.model
    if not proto.HasField("graph") or proto.ir_version <= 0 or not proto.opset_import:
        raise ModelError(f"{loaded.label} is not an ONNX model (no graph, IR version or opset)")
    check_names(proto.graph, loaded.label)
    for t, what in iter_tensors(proto.graph):
        if t.data_location == TensorProto.EXTERNAL:
            if loaded.base_dir is None:
                raise ModelError(f"{loaded.label}: tensor {what!r} stores its data externally; "
                                 "import the model from its path so the data can be found")
            _validate_external(t, what, loaded.base_dir, loaded.label)
    try:
        # The checker reads the file itself for big models: a >2 GB proto cannot be serialized.
        # It runs after our own validation, so hostile locations get our message; it also refuses
        # every symlinked external file (even one inside the directory), which we accept.
        if path is not None:
            onnx.checker.check_model(path)
        elif proto.ByteSize() < _PROTO_LIMIT:
            onnx.checker.check_model(proto)
    except Exception as e:
        raise ModelError(f"{loaded.label} fails the ONNX checker: {_one_line(e)}") from None
    return loaded
