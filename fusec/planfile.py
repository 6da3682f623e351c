"""The ``.fplan`` container: one file, no pickle, validated whole before anything is used.

Layout (all integers little-endian)::

    magic      8 bytes   b"FUSECPLN"
    version    u32       FORMAT_VERSION
    mlen       u64       length of the manifest
    manifest   mlen      UTF-8 JSON object; manifest["blobs"] lists every blob as
                         {"name", "offset", "length", "sha256"} (offset relative to the data section)
    data       ...       the blobs, each 256-byte aligned (weights can be uploaded straight from it)
    trailer    32 bytes  sha256 of everything before it

``read_plan`` checks the magic, the version, that every length fits in the file, the trailer
hash (any flipped byte anywhere is caught), then each blob's own hash; every failure raises
``PlanFileError`` naming the broken part (header, manifest, trailer, or the blob's name).
``write_plan`` writes to a temporary file in the target directory and renames it into place, so
a failed or interrupted save never leaves a half-written plan behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Mapping
from typing import Any

from fusec.errors import FusecError
from fusec.fsutil import atomic_write

MAGIC = b"FUSECPLN"
FORMAT_VERSION = 1
_ALIGN = 256
_HEADER = struct.Struct("<8sIQ")


class PlanFileError(FusecError):
    """The plan file is truncated, tampered with, or of another format; the message names the part."""


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def write_plan(path: str | os.PathLike, manifest: Mapping[str, Any], blobs: Mapping[str, bytes]) -> None:
    """Write ``manifest`` (JSON-able, without a "blobs" key) and ``blobs`` atomically to ``path``."""
    if "blobs" in manifest:
        raise ValueError("manifest key 'blobs' is reserved for the container")
    table = []
    offset = 0
    for name, data in blobs.items():
        table.append({"name": name, "offset": offset, "length": len(data),
                      "sha256": hashlib.sha256(data).hexdigest()})
        offset += len(data) + _pad(len(data))
    man = dict(manifest)
    man["blobs"] = table
    mbytes = json.dumps(man, sort_keys=True, separators=(",", ":")).encode("utf-8")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(mbytes))
    head = header + mbytes
    head += b"\0" * _pad(len(head))

    h = hashlib.sha256()
    with atomic_write(path) as f:
        for chunk in _chunks(head, blobs):
            h.update(chunk)
            f.write(chunk)
        f.write(h.digest())


def _chunks(head: bytes, blobs: Mapping[str, bytes]):
    yield head
    for data in blobs.values():
        yield data
        if _pad(len(data)):
            yield b"\0" * _pad(len(data))


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number fusec accepts (the manifest must hold finite numbers)")


def _short(v: Any) -> str:
    try:
        text = repr(v)
    except RecursionError:
        text = "(nested too deeply)"
    return text[:80]


class PlanFile:
    """A validated plan file: ``manifest`` (dict) and ``blob(name) -> memoryview``."""

    def __init__(self, path: str, manifest: dict[str, Any], data: memoryview, table: dict[str, dict[str, Any]]):
        self.path = path
        self.manifest = manifest
        self._data = data
        self._table = table

    def names(self) -> list[str]:
        return list(self._table)

    def blob(self, name: str) -> memoryview:
        entry = self._table.get(name)
        if entry is None:
            raise PlanFileError(f"{self.path}: the plan has no part named {name!r}")
        return self._data[entry["offset"]: entry["offset"] + entry["length"]]


def read_plan(path: str | os.PathLike) -> PlanFile:
    """Read and fully validate a plan file (see the module docstring)."""
    p = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO named as a plan is refused below instead of blocking the open
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise PlanFileError(f"plan file {p!r} is not a regular file")
            raw = f.read()
    except PlanFileError:
        raise
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {p!r}: {e.strerror or e}") from None
    if len(raw) < _HEADER.size + 32:
        raise PlanFileError(f"{p}: header: file is truncated ({len(raw)} bytes)")
    magic, version, mlen = _HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise PlanFileError(f"{p}: header: not a fusec plan file (bad magic)")
    if version != FORMAT_VERSION:
        raise PlanFileError(f"{p}: header: format_version is {version}, this fusec reads {FORMAT_VERSION}")
    body, trailer = raw[:-32], raw[-32:]
    mend = _HEADER.size + mlen
    if mend > len(body):
        raise PlanFileError(f"{p}: manifest: length {mlen} runs past the end of the file (truncated)")
    if hashlib.sha256(body).digest() != trailer:
        raise PlanFileError(f"{p}: trailer: checksum mismatch (the file is truncated or was modified)")
    try:
        manifest = json.loads(raw[_HEADER.size:mend].decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanFileError(f"{p}: manifest: not valid JSON ({e})") from None
    except ValueError as e:  # NaN/Infinity, or an integer too long to parse
        raise PlanFileError(f"{p}: manifest: {e}") from None
    except RecursionError:
        raise PlanFileError(f"{p}: manifest: JSON nested too deeply") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("blobs"), list):
        raise PlanFileError(f"{p}: manifest: missing the blob table")
    data_start = mend + _pad(mend)
    data = memoryview(body)[data_start:]
    table: dict[str, dict[str, Any]] = {}
    for entry in manifest["blobs"]:
        try:
            name, off, length, digest = entry["name"], entry["offset"], entry["length"], entry["sha256"]
            if not (isinstance(name, str) and isinstance(digest, str) and type(off) is int and type(length) is int):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise PlanFileError(f"{p}: manifest: malformed blob entry {_short(entry)}") from None
        if name in table:
            raise PlanFileError(f"{p}: blob {name!r}: listed twice")
        if off < 0 or length < 0 or off + length > len(data):
            raise PlanFileError(f"{p}: blob {name!r}: extends past the end of the file")
        if hashlib.sha256(data[off:off + length]).hexdigest() != digest:
            raise PlanFileError(f"{p}: blob {name!r}: checksum mismatch")
        table[name] = entry
    del manifest["blobs"]
    return PlanFile(p, manifest, data, table)
