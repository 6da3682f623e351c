"""Model inputs and outputs on the host: random inputs that are valid for a model, and the
``.npz`` files ``fusec run --inputs/--save-outputs`` read and write (never pickles).
"""

from __future__ import annotations

import io
import os
import stat
import zipfile
from collections.abc import Collection, Mapping
from typing import IO, Any

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.fsutil import OutputError, atomic_write
from fusec.ir import Graph, Value
from fusec.ops import Op
from fusec.reference import check_inputs
from fusec.shapes import MAX_BYTES_ENV, check_size, max_bytes

# Ops through which an integer input keeps its meaning as an index (token ids cast to i32, an
# unsqueeze/reshape, a transpose or broadcast) before it reaches a gather.
_INDEX_PRESERVING = frozenset({Op.CAST, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND, Op.SLICE, Op.TILE})


def index_bound(graph: Graph, value: Value) -> int | None:
    """The smallest gather data dim that ``value`` (through casts/reshapes) indexes, or None.

    A token id must be valid for every table it indexes, so the minimum over all of them.
    """
    users = graph.users()
    bound: int | None = None
    stack, seen = [value], {value}
    while stack:
        v = stack.pop()
        for node in users.get(v, []):
            if node.op == Op.GATHER and len(node.inputs) == 2 and node.inputs[1] is v:
                dim = node.inputs[0].shape[node.attrs.axis]
                bound = dim if bound is None else min(bound, dim)
            elif node.op in _INDEX_PRESERVING and node.inputs[0] is v:
                out = node.outputs[0]
                if out.dtype.is_int and out not in seen:
                    seen.add(out)
                    stack.append(out)
    return bound


def input_signature(graph: Graph) -> list[dict[str, Any]]:
    """Each graph input as {"name", "shape", "dtype", "bound"}; ``bound`` is the index bound of
    integer inputs used as gather indices (None otherwise). Plans store this signature, so that
    random inputs for a compiled plan follow the same rules as for its graph."""
    return [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype.value,
             "bound": index_bound(graph, v) if v.dtype.is_int else None} for v in graph.inputs]


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs (per ``seed``) that are valid for ``graph``; see ``random_inputs_for``."""
    return random_inputs_for(input_signature(graph), seed)


def random_inputs_for(signature: list[dict[str, Any]], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs (per ``seed``) for a signature as made by ``input_signature``.

    Integer inputs used as gather indices get ids uniform in [0, table size); other integer
    inputs (attention masks, say) get ones, so that nothing is masked out; floats are standard
    normal; bools are True.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise InputError(f"seed must be a non-negative integer, got {seed!r}")
    for sig in signature:
        check_size(tuple(sig["shape"]), f"input {sig['name']!r}", DType(sig["dtype"]).itemsize)
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for sig in signature:
        dt, shape = DType(sig["dtype"]), tuple(sig["shape"])
        if dt.is_float:
            arr = rng.standard_normal(shape, dtype=np.float32).astype(dt.np)
        elif dt.is_int:
            bound = sig.get("bound")
            if bound is not None and bound > 0:
                arr = rng.integers(0, bound, size=shape, dtype=dt.np)
            else:
                arr = np.ones(shape, dtype=dt.np)
        elif dt == DType.BOOL:
            arr = np.ones(shape, dtype=np.bool_)
        else:  # a new DType must decide what a valid random input is
            raise NotImplementedError(f"random_inputs: no rule for dtype {dt.value}")
        out[sig["name"]] = arr
    return out


def _open_once(path: str | os.PathLike[str], where: str) -> IO[bytes]:
    """Open the inputs file once; a pipe or FIFO (``--inputs <(cat in.npz)``) is read into memory
    (up to the byte limit), since a zip archive needs seeking and a pipe can be read only once;
    anything else but a regular file (a device, a socket) is refused."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (returned)
    except FileNotFoundError:
        raise InputError(f"inputs file {where} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"inputs file {where} is a directory") from None
    except OSError as e:
        raise InputError(f"cannot read inputs file {where}: {e.strerror or e}") from None
    try:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"inputs file {where} is a directory")
        if stat.S_ISREG(st.st_mode):
            return f
        if not stat.S_ISFIFO(st.st_mode):  # /dev/zero, /dev/urandom, a socket: never an archive, read forever
            raise InputError(f"inputs file {where} is not a regular file or a pipe (a device or socket); "
                             "give an .npz file")
        limit = max_bytes()
        chunks, total = [], 0
        while total <= limit:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise InputError(f"inputs file {where} (a pipe) holds more than {limit} bytes "
                             f"(set {MAX_BYTES_ENV} to raise the limit)")
        f.close()
        return io.BytesIO(data)
    except OSError as e:
        f.close()
        raise InputError(f"cannot read inputs file {where}: {e.strerror or e}") from None
    except BaseException:
        f.close()
        raise


def _read_members(zf: zipfile.ZipFile, graph: Graph, where: str) -> dict[str, np.ndarray]:
    """Every member as an array, each checked before it is inflated (see ``read_npz_members``):
    a known input name and the header's shape equal to the input's."""
    return read_npz_members(zf, f"inputs file {where}", "input", {v.name: tuple(v.shape) for v in graph.inputs})


def read_npz_members(zf: zipfile.ZipFile, where: str, what: str, shapes: Mapping[str, tuple[int, ...]] | None = None,
                     names: Collection[str] | None = None) -> dict[str, np.ndarray]:
    """The ``.npy`` members of an open archive as arrays, keyed by name, each checked before it is
    inflated: a plain numeric dtype (no objects, strings or records; bf16 comes as 2-byte voids), a
    size within the limits (``FUSEC_MAX_ELEMENTS``/``FUSEC_MAX_BYTES``, also for all members
    together), and a declared size that fits the header (neither a lying header nor a deflate bomb
    allocates more than expected). ``shapes``: the names and shapes the members must have (an
    unknown name is refused); ``names``: read only these members (the others' headers are still
    checked). ``what`` names a member in messages ("input", "output")."""
    arrays: dict[str, np.ndarray] = {}
    seen: set[str] = set()
    total = 0
    for info in zf.infolist():
        if info.is_dir():
            continue
        if not info.filename.endswith(".npy"):
            raise InputError(f"{where}: member {info.filename!r} is not an .npy array")
        name = info.filename[:-4]
        if name in seen:
            raise InputError(f"{where}: {what} {name!r} appears twice")
        seen.add(name)
        if shapes is not None and name not in shapes:
            raise InputError(f"{where}: unexpected {what}(s): {name!r} "
                             f"(expected {', '.join(repr(n) for n in shapes)})")
        try:
            member = zf.open(info)
        except (RuntimeError, NotImplementedError) as e:  # encrypted, or an unsupported compression method
            raise InputError(f"{where}: {what} {name!r} cannot be read ({_one_line(e)})") from None
        with member:
            try:
                version = np.lib.format.read_magic(member)
                if version not in ((1, 0), (2, 0)):
                    raise ValueError(f".npy format version {version[0]}.{version[1]} (fusec reads 1.0 and 2.0)")
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read_header(member)
            except Exception as e:  # noqa: BLE001 -- numpy's header parser on untrusted bytes: any failure is the file's
                raise InputError(f"{where}: {what} {name!r} is not a readable .npy array ({_one_line(e)})") from None
            if dtype.hasobject:
                raise InputError(f"{where} holds pickled objects ({what} {name!r}), which fusec "
                                 "does not load; save plain numeric arrays (np.savez)")
            if dtype.kind not in "biuf" and dtype != np.dtype("V2"):
                raise InputError(f"{where}: {what} {name!r} has dtype {dtype.str!r}; fusec reads numeric arrays only")
            if shapes is not None and tuple(shape) != tuple(shapes[name]):
                raise InputError(f"{where}: {what} {name!r}: expected shape {list(shapes[name])}, got {list(shape)}")
            try:
                check_size(shape, f"{what} {name!r}", dtype.itemsize)
            except InputError as e:
                raise InputError(f"{where}: {e}") from None
            need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if info.file_size > need + 65536 + 4096:
                raise InputError(f"{where}: {what} {name!r} declares {info.file_size} bytes, but "
                                 f"its header describes {need}")
            if names is not None and name not in names:
                continue
            total += need
            if total > max_bytes():
                raise InputError(f"{where}: its arrays hold more than {max_bytes()} bytes "
                                 f"(set {MAX_BYTES_ENV} to raise the limit)")
            try:
                arr = _read_array(member, tuple(shape), fortran, dtype, f"{where}: {what} {name!r}")
            except InputError:
                raise
            except (ValueError, EOFError, OSError, zipfile.BadZipFile) as e:
                raise InputError(f"{where}: {what} {name!r} is not a readable .npy array "
                                 f"({_one_line(e)})") from None
        arrays[name] = arr
    return arrays


def _read_array(f: Any, shape: tuple[int, ...], fortran: bool, dtype: np.dtype, label: str) -> np.ndarray:
    """The data of an .npy member after its header: exactly the bytes the header describes."""
    count = int(np.prod(shape, dtype=np.int64))
    need = count * dtype.itemsize
    data = bytearray(need)
    view, done = memoryview(data), 0
    while done < need:
        n = f.readinto(view[done:])
        if not n:
            raise InputError(f"{label} is truncated ({done} of {need} bytes)")
        done += n
    arr = np.frombuffer(data, dtype=dtype, count=count)
    return arr.reshape(shape[::-1]).transpose() if fortran else arr.reshape(shape)


def check_index_bounds(graph: Graph, arrays: Mapping[str, np.ndarray], bounds: Mapping[str, int | None] | None = None,
                       where: str = "") -> None:
    """Integer inputs used as gather indices (token ids) lie in [-rows, rows) of every table they
    index; an InputError names the input (and ``where``, the file) otherwise."""
    prefix = f"{where}: " if where else ""
    by_name = {v.name: v for v in graph.inputs}
    for name, arr in arrays.items():
        v = by_name.get(name)
        if v is None or not v.dtype.is_int or not np.asarray(arr).size:
            continue
        bound = bounds.get(name) if bounds is not None else index_bound(graph, v)
        if not bound:
            continue
        lo, hi = int(np.min(arr)), int(np.max(arr))
        if lo < -bound or hi >= bound:
            bad = hi if hi >= bound else lo
            raise InputError(f"{prefix}input {name!r}: value {bad} is out of range [-{bound}, {bound}) "
                             f"(it indexes a table of {bound} rows, e.g. token ids)")


def load_inputs_npz(path: str | os.PathLike[str], graph: Graph,
                    bounds: Mapping[str, int | None] | None = None) -> dict[str, np.ndarray]:
    """Read the inputs of ``graph`` from an ``.npz`` file, keyed by input name.

    Raises InputError naming the file when it cannot be read (missing, not an npz, holds pickled
    objects), and naming the input when one is missing, extra, of the wrong dtype or shape, or
    (token ids) out of range. Each member's header is checked before it is inflated; the file is
    opened once, so a pipe works. ``bounds``: index bounds by input name (plans store them).
    """
    where = repr(os.fspath(path))
    f = _open_once(path, where)
    with f:
        try:
            magic = f.read(6)
            f.seek(0)
        except OSError as e:
            raise InputError(f"cannot read inputs file {where}: {e.strerror or e}") from None
        # Check the magic first: numpy reports any non-npy/npz file as "pickled data".
        if magic.startswith(b"\x93NUMPY"):
            raise InputError(f"inputs file {where} is a single .npy array, not an .npz archive of named inputs")
        if not magic.startswith(b"PK"):
            raise InputError(f"inputs file {where} is not an .npz file (save inputs with np.savez)")
        try:
            with zipfile.ZipFile(f) as zf:
                arrays = _read_members(zf, graph, where)
        except InputError:
            raise
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError, NotImplementedError, RuntimeError) as e:
            raise InputError(f"inputs file {where} is not a readable .npz file ({_one_line(e)})") from None
    # bf16 has no numpy dtype of its own; np.savez stores ml_dtypes.bfloat16 arrays as raw 2-byte voids
    for v in graph.inputs:
        arr = arrays.get(v.name)
        if v.dtype == DType.BF16 and arr is not None and arr.dtype == np.dtype("V2"):
            arrays[v.name] = arr.view(DType.BF16.np)
    try:
        out = check_inputs(graph, arrays)
        check_index_bounds(graph, out, bounds)
        return out
    except InputError as e:
        raise InputError(f"inputs file {where}: {e}") from None


def save_outputs_npz(path: str | os.PathLike[str], outputs: Mapping[str, np.ndarray]) -> None:
    """Write ``outputs`` to ``path`` as an ``.npz`` keyed by output name, atomically.

    The archive is written to a temporary file in the same directory and renamed over ``path``,
    so a reader never sees a half-written file. Written member by member (not ``np.savez(**kw)``)
    because an output may be named anything, including ``file``.
    """
    target = os.fspath(path)
    for name in outputs:
        check_member_name(name)
    try:
        with atomic_write(target, what="outputs file") as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in outputs.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asarray(arr), allow_pickle=False)
    except OutputError as e:  # atomic_write's: it names the file already
        raise InputError(str(e)) from None
    except OSError as e:
        raise InputError(f"cannot write outputs file {target!r}: {e.strerror or e}") from None


def check_member_name(name: str) -> None:
    """An output name becomes the archive member ``NAME.npy``: refuse names that an unzip tool
    would turn into a path outside the target directory, or that cannot be a member name."""
    bad = ""
    if not isinstance(name, str) or not name:
        bad = "is empty"
    elif "\0" in name:
        bad = "contains a NUL character"
    elif "\\" in name:
        bad = "contains a backslash"
    elif name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        bad = "is an absolute path"
    elif any(part in ("..", ".") for part in name.split("/")):
        bad = "contains a '..' or '.' path component"
    if bad:
        raise InputError(f"output {name!r} {bad}, so it cannot be a member of the outputs .npz archive "
                         "(it would name a path outside the archive); rename it in the model")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
