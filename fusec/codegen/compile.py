"""NVRTC compilation to CUBIN (no GPU needed), an in-process cache and an atomic on-disk cache.

The route is CuPy's thin NVRTC binding (``cupy_backends.cuda.libs.nvrtc``): NVRTC runs on any
machine with libnvrtc, and with a real ``sm_XX`` target it emits a CUBIN that a GPU machine later
loads with ``cupy.cuda.function.Module().load(cubin)``. Sources are self-contained (templates
inline their ``.cuh`` helpers and include no CUDA headers), so the cache key
sha256(source, options, arch, NVRTC version) determines the binary.

Disk entries live under ``$FUSEC_CACHE_DIR`` (default ``~/.cache/fusec``) as
``kernels/<key[:2]>/<key>.bin``: magic, sha256 of the body, body (log length, log, cubin). They are
written to a temp file in the same directory and ``os.replace``d, so a reader never sees half an
entry; an entry whose digest does not match is recompiled and rewritten, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from fusec.errors import FusecError
from fusec.fsutil import atomic_write

_MAGIC = b"FUSECBN1"
_ARCH_RE = re.compile(r"^sm_[0-9]{2,3}[a-z]?$")


class KernelCompileError(FusecError):
    """NVRTC rejected a generated kernel; carries the kernel name and the NVRTC log."""

    def __init__(self, kernel: str, log: str, source: str):
        self.kernel = kernel
        self.log = log
        self.source = source
        super().__init__(f"NVRTC failed to compile kernel {kernel!r}:\n{log.strip()}")


@dataclass(frozen=True)
class Binary:
    cubin: bytes
    log: str  # ptxas -v output: registers, shared memory, spills
    key: str
    from_disk: bool = False

    @property
    def registers(self) -> int | None:
        m = re.search(r"Used (\d+) registers", self.log)
        return int(m.group(1)) if m else None

    @property
    def spill_bytes(self) -> int:
        return sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", self.log))

    @property
    def static_smem(self) -> int:
        m = re.search(r"(\d+) bytes smem", self.log)
        return int(m.group(1)) if m else 0


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return int(major), int(minor)


def default_arch() -> str:
    """The current GPU's ``sm_XX``, or ``sm_90`` on a machine without one."""
    from fusec.device import gpu_arch

    return gpu_arch() or "sm_90"


def cache_dir() -> Path:
    return Path(os.environ.get("FUSEC_CACHE_DIR") or Path.home() / ".cache" / "fusec")


def cache_key(source: str, options: tuple[str, ...], arch: str) -> str:
    blob = json.dumps([source, list(options), arch, list(nvrtc_version())], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


_MEM: dict[str, Binary] = {}
_LOCK = threading.Lock()
STATS = {"compiled": 0, "disk_hits": 0, "memory_hits": 0, "corrupt": 0}


def _entry_path(key: str) -> Path:
    return cache_dir() / "kernels" / key[:2] / f"{key}.bin"


def _encode(cubin: bytes, log: str) -> bytes:
    lb = log.encode()
    body = struct.pack("<I", len(lb)) + lb + cubin
    return _MAGIC + hashlib.sha256(body).digest() + body


def _decode(blob: bytes) -> tuple[bytes, str] | None:
    if len(blob) < 44 or blob[:8] != _MAGIC:
        return None
    digest, body = blob[8:40], blob[40:]
    if hashlib.sha256(body).digest() != digest:
        return None
    (n,) = struct.unpack("<I", body[:4])
    if 4 + n > len(body):
        return None
    return body[4 + n:], body[4:4 + n].decode(errors="replace")


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, private=True) as f:
        f.write(data)


def _numbered(source: str) -> str:
    return "\n".join(f"{i:5d}  {line}" for i, line in enumerate(source.splitlines(), 1))


def _nvrtc(source: str, kernel: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{kernel}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            if os.environ.get("FUSEC_DUMP_SOURCE_ON_ERROR") == "1":
                dump = cache_dir() / "errors" / f"{kernel}.cu"
                dump.parent.mkdir(parents=True, exist_ok=True)
                dump.write_text(source)
                print(f"--- fusec: source of kernel {kernel} (also in {dump}) ---\n{_numbered(source)}\n"
                      f"--- NVRTC log ---\n{log}", file=sys.stderr)
            raise KernelCompileError(kernel, log, source) from None
        return bytes(nvrtc.getCUBIN(prog)), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cuda(source: str, kernel: str, arch: str | None = None, options: tuple[str, ...] = (),
                 use_disk: bool = True) -> Binary:
    """Compile ``source`` (defining ``extern "C"`` kernel ``kernel``) to a CUBIN for ``arch``.

    Identical (source, options, arch) compile once per process; the disk cache is consulted
    unless ``use_disk`` is false. Raises KernelCompileError with the NVRTC log on failure.
    """
    arch = arch or default_arch()
    if not _ARCH_RE.match(arch):
        raise ValueError(f"bad target arch {arch!r} (expected e.g. sm_90)")
    opts = (f"--gpu-architecture={arch}", "-std=c++17", "-Xptxas=-v") + tuple(options)
    key = cache_key(source, opts, arch)
    with _LOCK:
        hit = _MEM.get(key)
        if hit is not None:
            STATS["memory_hits"] += 1
            return hit
    path = _entry_path(key)
    if use_disk and path.exists():
        try:
            decoded = _decode(path.read_bytes())
        except OSError:
            decoded = None
        if decoded is not None:
            b = Binary(decoded[0], decoded[1], key, from_disk=True)
            with _LOCK:
                STATS["disk_hits"] += 1
                _MEM[key] = b
            return b
        STATS["corrupt"] += 1  # recompile below and overwrite the bad entry
    cubin, log = _nvrtc(source, kernel, opts)
    if cubin[:4] != b"\x7fELF":
        raise KernelCompileError(kernel, "NVRTC returned no ELF cubin\n" + log, source)
    b = Binary(cubin, log, key)
    if use_disk:
        try:
            _write_atomic(path, _encode(cubin, log))
        except OSError as e:  # a read-only cache must not stop compilation
            print(f"fusec: warning: cannot write kernel cache {path}: {e}", file=sys.stderr)
    with _LOCK:
        STATS["compiled"] += 1
        _MEM[key] = b
    return b


def clear_memory_cache() -> None:
    with _LOCK:
        _MEM.clear()
