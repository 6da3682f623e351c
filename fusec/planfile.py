"""The ``.fplan`` container: one file, no pickle, memory-mapped, every part checked before use.

Layout (all integers little-endian)::

    magic      8 bytes   b"FUSECPLN"
    version    u32       FORMAT_VERSION
    mlen       u64       length of the manifest
    manifest   mlen      UTF-8 JSON object; manifest["blobs"] lists every blob, in file order, as
                         {"name", "offset", "length", "sha256"} (offset relative to the data section)
    (zeros up to the next 256-byte boundary)
    data       ...       the blobs, each 256-byte aligned and followed by zeros up to the next
                         boundary (weights can be uploaded straight from the mapping)
    trailer    32 bytes  sha256 of the header, the manifest and its padding

Each part is hashed once, when it is first used, never the whole file: ``read_plan`` reads only
the header and the manifest, checks the trailer against them (the manifest holds every blob's
hash, so the trailer covers the blob table), that the blob table tiles the data section exactly
and that the file has exactly the size it describes (a truncated or extended file is refused
before any blob is read); the data section is memory-mapped. ``PlanFile.blob(name)`` checks that
blob's sha256 (and its zero padding) the first time it is asked for; ``verify="all"`` checks every
blob at once. ``fusec.load`` checks the kernels at load and the weights when they are uploaded,
and ``fusec inspect`` never reads the weights. Every failure raises ``PlanFileError`` naming the
broken part (header, manifest, trailer, or the blob's name).

The mapping stays valid while the file is replaced by a rename (what ``write_plan`` and every
fusec command do); truncating or rewriting a loaded plan file in place is not supported (the
operating system may kill the process that later reads the vanished pages).

``write_plan`` writes to a temporary file in the target directory and renames it into place, so
a failed or interrupted save never leaves a half-written plan behind.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import stat
import struct
import threading
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fusec.errors import FusecError
from fusec.fsutil import atomic_write

MAGIC = b"FUSECPLN"
FORMAT_VERSION = 3  # 3: packed 5- and 6-bit weights hold their high bits byte-aligned (fusec/quant.py), not in planes
_ALIGN = 256
_HEADER = struct.Struct("<8sIQ")
_CHUNK = 64 << 20  # hashing granularity: pages of a hashed chunk are released from the mapping


class PlanFileError(FusecError):
    """The plan file is truncated, tampered with, or of another format; the message names the part."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


class Chunks:
    """A blob made of byte chunks (a compiled plan's packed weights: views of the weight arrays and
    zero padding): written and hashed a chunk at a time by ``write_plan``, so that compiling never
    holds a second, joined copy of the weights. ``bytes(chunks)`` joins them where one buffer is
    needed (the GPU upload of a plan used before it is saved: ``fusec.plan.Plan.blob``)."""

    def __init__(self, parts: Sequence[Any]):
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def _nbytes(data: Any) -> int:
    return data.nbytes if isinstance(data, Chunks) else memoryview(data).nbytes


def _views(data: Any) -> list[memoryview]:
    return data.parts if isinstance(data, Chunks) else [memoryview(data).cast("B")]


def write_plan(path: str | os.PathLike, manifest: Mapping[str, Any], blobs: Mapping[str, Any],
               digests: Mapping[str, str] | None = None) -> None:
    """Write ``manifest`` (JSON-able, without a "blobs" key) and ``blobs`` (bytes-like: bytes,
    memoryview, a mapped plan's parts, ``Chunks``; nothing is copied) atomically to ``path``.
    ``digests``: sha256 already known for some blobs (parts of a checked plan file), not computed
    again."""
    if "blobs" in manifest:
        raise ValueError("manifest key 'blobs' is reserved for the container")
    # The blobs are hashed on threads (hashlib releases the GIL) while they are written: the blob
    # table is first laid out with placeholder digests of the final length, the data section is
    # written after the header's space, and the header is written last, over that space.
    known = digests or {}
    todo = [name for name in blobs if not known.get(name)]
    table = []
    offset = 0
    for name, data in blobs.items():
        n = _nbytes(data)
        table.append({"name": name, "offset": offset, "length": n, "sha256": known.get(name) or "0" * 64})
        offset += n + _pad(n)
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1, 8))) as pool:
        # the largest first: the weights' hash is the one the write waits for
        futures = {name: pool.submit(_sha256, blobs[name])
                   for name in sorted(todo, key=lambda k: -_nbytes(blobs[k]))}
        head_len = len(_head(manifest, table))
        with atomic_write(path) as f:
            f.seek(head_len)
            for data in blobs.values():
                for view in _views(data):
                    f.write(view)
                if _pad(_nbytes(data)):
                    f.write(b"\0" * _pad(_nbytes(data)))
            for rec in table:
                if rec["name"] in futures:
                    rec["sha256"] = futures[rec["name"]].result()
            head = _head(manifest, table)
            if len(head) != head_len:  # a digest is always 64 hex digits
                raise AssertionError("plan header changed size")
            f.write(hashlib.sha256(head).digest())
            f.seek(0)
            f.write(head)


def _head(manifest: Mapping[str, Any], table: list[dict[str, Any]]) -> bytes:
    """Header, manifest (with the blob ``table``) and zero padding to the data section."""
    man = dict(manifest)
    man["blobs"] = table
    mbytes = json.dumps(man, sort_keys=True, separators=(",", ":")).encode("utf-8")
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, len(mbytes)) + mbytes
    return head + b"\0" * _pad(len(head))


def _sha256(data: Any) -> str:
    h = hashlib.sha256()
    for view in _views(data):
        for start in range(0, view.nbytes, _CHUNK):
            h.update(view[start: start + _CHUNK])
    return h.hexdigest()


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number fusec accepts (the manifest must hold finite numbers)")


def _short(v: Any) -> str:
    try:
        text = repr(v)
    except RecursionError:
        text = "(nested too deeply)"
    return text[:80]


class PlanFile:
    """A plan file whose header, manifest and blob table were checked: ``manifest`` (dict),
    ``blob(name) -> memoryview`` (checked on first use), ``length(name)`` (no read)."""

    def __init__(self, path: str, manifest: dict[str, Any], data: memoryview, table: dict[str, dict[str, Any]],
                 mapping: mmap.mmap | None = None, data_start: int = 0):
        self.path = path
        self.manifest = manifest
        self._data = data
        self._table = table
        self._map = mapping
        self._data_start = data_start
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return list(self._table)

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self._table.get(name)
        if entry is None:
            raise PlanFileError(f"{self.path}: the plan has no part named {name!r}")
        return entry

    def length(self, name: str) -> int:
        """The size of blob ``name`` in bytes, without reading it."""
        return int(self._entry(name)["length"])

    def blob(self, name: str) -> memoryview:
        """Blob ``name`` (a read-only view of the mapping), its checksum checked on first use."""
        entry = self._entry(name)
        off, n = entry["offset"], entry["length"]
        if name not in self._checked:
            with self._lock:
                if name not in self._checked:
                    self._check(name, entry)
                    self._checked.add(name)
        return self._data[off: off + n]

    def verify(self) -> None:
        """Check every blob now (each is hashed once per PlanFile)."""
        for name in self._table:
            self.blob(name)

    def _check(self, name: str, entry: Mapping[str, Any]) -> None:
        off, n = entry["offset"], entry["length"]
        h = hashlib.sha256()
        for start in range(off, off + n, _CHUNK):
            end = min(start + _CHUNK, off + n)
            h.update(self._data[start:end])
            self._release(start, end)
        if h.hexdigest() != entry["sha256"]:
            raise PlanFileError(f"{self.path}: blob {name!r}: checksum mismatch")
        if any(self._data[off + n: off + n + _pad(n)]):
            raise PlanFileError(f"{self.path}: blob {name!r}: padding after it is not zero (the file was modified)")

    def _release(self, start: int, end: int) -> None:
        """Drop the hashed pages from this process's mapping (they stay in the page cache):
        hashing a large blob does not grow the resident set by its size."""
        madvise = getattr(self._map, "madvise", None)
        dontneed = getattr(mmap, "MADV_DONTNEED", None)
        if madvise is None or dontneed is None:
            return
        page = mmap.PAGESIZE
        a = -(-(self._data_start + start) // page) * page
        b = (self._data_start + end) // page * page
        if b > a:
            try:
                madvise(dontneed, a, b - a)
            except (OSError, ValueError):
                pass  # an optimization only


class PlanBlobs(MutableMapping):
    """A plan's parts by name, read from its file on demand (each checked on first access) and
    replaced in memory where the plan is changed (``recompile``). ``length(name)`` reads nothing."""

    def __init__(self, pf: PlanFile):
        self._pf = pf
        self._own: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name in self._own:
            return self._own[name]
        if name not in self._pf._table:
            raise KeyError(name)
        return self._pf.blob(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._own[name] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("a plan's parts cannot be removed")

    def __iter__(self) -> Iterator[str]:
        yield from self._pf._table
        yield from (k for k in self._own if k not in self._pf._table)

    def __len__(self) -> int:
        return len(self._pf._table) + sum(1 for k in self._own if k not in self._pf._table)

    def __contains__(self, name: object) -> bool:
        return name in self._own or name in self._pf._table

    def length(self, name: str) -> int:
        if name in self._own:
            return memoryview(self._own[name]).nbytes
        return self._pf.length(name)

    def checked_digests(self) -> dict[str, str]:
        """sha256 of the file's parts already checked and not replaced (``write_plan(digests=)``)."""
        return {n: self._pf._table[n]["sha256"] for n in self._pf._checked if n not in self._own}

    @property
    def path(self) -> str:
        return self._pf.path


def blob_length(blobs: Mapping[str, Any], name: str) -> int:
    """The size of blob ``name`` without reading it where the mapping can say (PlanBlobs)."""
    length = getattr(blobs, "length", None)
    return int(length(name)) if length is not None else _nbytes(blobs[name])


def read_plan(path: str | os.PathLike, verify: str = "all") -> PlanFile:
    """Open and check a plan file (see the module docstring). ``verify``: "all" checks every
    blob's checksum now; "lazy" checks each on first use (``PlanFile.blob``)."""
    if verify not in ("all", "lazy"):
        raise ValueError(f"verify must be 'all' or 'lazy', got {verify!r}")
    p = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO named as a plan is refused below instead of blocking the open
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {p!r}: {e.strerror or e}") from None
    try:
        pf = _open(p, fd)
    finally:
        os.close(fd)  # the mapping keeps its own reference to the file
    if verify == "all":
        pf.verify()
    return pf


def _pread(fd: int, n: int, off: int, p: str) -> bytes:
    try:
        out = os.pread(fd, n, off)
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {p!r}: {e.strerror or e}") from None
    if len(out) != n:
        raise PlanFileError(f"{p}: file is truncated (short read at byte {off})")
    return out


def _open(p: str, fd: int) -> PlanFile:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise PlanFileError(f"plan file {p!r} is not a regular file")
    size = st.st_size
    if size < _HEADER.size + 32:
        raise PlanFileError(f"{p}: header: file is truncated ({size} bytes)")
    magic, version, mlen = _HEADER.unpack(_pread(fd, _HEADER.size, 0, p))
    if magic != MAGIC:
        raise PlanFileError(f"{p}: header: not a fusec plan file (bad magic)")
    if version != FORMAT_VERSION:
        raise PlanFileError(f"{p}: header: format_version is {version}, this fusec reads {FORMAT_VERSION}; "
                            "recompile the model with this fusec (fusec compile MODEL -o PLAN)")
    mend = _HEADER.size + mlen
    data_start = mend + _pad(mend)
    if data_start + 32 > size:
        raise PlanFileError(f"{p}: manifest: length {mlen} runs past the end of the file (truncated)")
    head = _pread(fd, data_start, 0, p)
    if hashlib.sha256(head).digest() != _pread(fd, 32, size - 32, p):
        raise PlanFileError(f"{p}: trailer: checksum mismatch (the file is truncated or was modified)")
    if any(head[mend:]):
        raise PlanFileError(f"{p}: manifest: padding after it is not zero")
    try:
        manifest = json.loads(head[_HEADER.size:mend].decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanFileError(f"{p}: manifest: not valid JSON ({e})") from None
    except ValueError as e:  # NaN/Infinity, or an integer too long to parse
        raise PlanFileError(f"{p}: manifest: {e}") from None
    except RecursionError:
        raise PlanFileError(f"{p}: manifest: JSON nested too deeply") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("blobs"), list):
        raise PlanFileError(f"{p}: manifest: missing the blob table")
    table: dict[str, dict[str, Any]] = {}
    top = 0  # the blobs tile the data section in order, each padded to the alignment
    for entry in manifest["blobs"]:
        try:
            name, off, length, digest = entry["name"], entry["offset"], entry["length"], entry["sha256"]
            if not (isinstance(name, str) and isinstance(digest, str) and type(off) is int and type(length) is int):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise PlanFileError(f"{p}: manifest: malformed blob entry {_short(entry)}") from None
        if name in table:
            raise PlanFileError(f"{p}: blob {name!r}: listed twice")
        if off != top or length < 0:
            raise PlanFileError(f"{p}: blob {name!r}: offset {off} is not where the previous blob ends ({top})")
        top = off + length + _pad(length)
        if data_start + top + 32 > size:
            raise PlanFileError(f"{p}: blob {name!r}: extends past the end of the file (truncated)")
        table[name] = entry
    if data_start + top + 32 != size:
        raise PlanFileError(f"{p}: file is {size} bytes, its blob table describes {data_start + top + 32} "
                            "(truncated, or data appended)")
    del manifest["blobs"]
    mapping = None
    data = memoryview(b"")
    if top:
        try:
            mapping = mmap.mmap(fd, data_start + top, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise PlanFileError(f"cannot map plan file {p!r}: {e}") from None
        data = memoryview(mapping)[data_start: data_start + top]
    return PlanFile(p, manifest, data, table, mapping, data_start)
