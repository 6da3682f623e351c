"""The on-disk kernel cache's storage: private directories, the secret MAC key, entry encoding
(see ``fusec.codegen.compile``'s docstring for the format and the trust rules)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import stat
import struct
import threading
import time
from pathlib import Path

from fusec.errors import FusecError
from fusec.fsutil import atomic_write

_MAGIC = b"FUSECBN3"  # 3: the MAC covers the entry's key (its file name) too


class KernelCacheError(FusecError):
    """The on-disk kernel cache is not private to this user (see the module docstring)."""


def cache_dir() -> Path:
    from fusec import knobs

    return Path(knobs.get("FUSEC_CACHE_DIR") or Path.home() / ".cache" / "fusec")


def _entry_path(key: str) -> Path:
    return cache_dir() / "kernels" / key[:2] / f"{key}.bin"


def _check_private_dir(path: Path) -> None:
    """``path`` (if it exists) is a directory owned by this user that others cannot write."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):  # cannot exist: making it fails, and compiles go on without
        return
    except OSError as e:
        raise KernelCacheError(f"kernel cache directory {str(path)!r}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise KernelCacheError(f"kernel cache directory {str(path)!r} is not a directory (set FUSEC_CACHE_DIR)")
    if st.st_uid != os.getuid():
        raise KernelCacheError(f"kernel cache directory {str(path)!r} belongs to another user (uid {st.st_uid}); "
                               "its entries would become code in your plans: set FUSEC_CACHE_DIR to a directory of yours")
    if st.st_mode & 0o022:
        raise KernelCacheError(f"kernel cache directory {str(path)!r} is writable by others (mode "
                               f"{stat.S_IMODE(st.st_mode):o}); its entries would become code in your plans: "
                               f"run chmod go-w {str(path)!r} or set FUSEC_CACHE_DIR")


def check_cache_dirs(key: str | None = None) -> None:
    """The cache root, ``kernels`` and (given a key) the entry's subdirectory are private."""
    root = cache_dir()
    paths = [root, root / "kernels"] + ([root / "kernels" / key[:2]] if key else [])
    for p in paths:
        _check_private_dir(p)


def _mac_key() -> bytes:
    """The cache's secret (32 random bytes in ``$FUSEC_CACHE_DIR/key``, 0600), made on first use."""
    root = cache_dir()
    path = root / "key"
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for attempt in range(50):
        try:
            fd = os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError):  # made here (an OSError when it cannot be)
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            _create_key(path)
            continue
        except OSError as e:
            raise KernelCacheError(f"kernel cache key {str(path)!r}: {e.strerror or e}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise KernelCacheError(f"kernel cache key {str(path)!r} is not a private file of this user "
                                       "(mode 0600); remove it or set FUSEC_CACHE_DIR")
            key = f.read(64)
        if len(key) == 32:
            return key
        if key or attempt >= 49:
            raise KernelCacheError(f"kernel cache key {str(path)!r} is damaged; remove it (the cache is rebuilt)")
        time.sleep(0.01)  # empty: another process is still writing it (a file system without hard links)
    raise KernelCacheError(f"kernel cache key {str(path)!r} cannot be created")


def _create_key(path: Path) -> None:
    """Write a new key whole under a temporary name, then link it to ``path`` unless another
    thread or process made one first: a reader never sees a key file still being written (NVRTC
    compiles run on several threads, each reading the key)."""
    tmp = path.with_name(f".key.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another writer's key won: use it
        except OSError:  # no hard links here: create it in place (readers wait while it is empty)
            with contextlib.suppress(FileExistsError):
                fd2 = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
                with os.fdopen(fd2, "wb") as f:
                    f.write(os.urandom(32))
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _mac(key: bytes, entry: str, body: bytes) -> bytes:
    """Over the entry's key (the hash of its source and options) and its contents: an entry moved or
    copied to another key's file fails it, as a changed one does."""
    return hmac.new(key, entry.encode() + b"\0" + body, hashlib.sha256).digest()


def _encode(cubin: bytes, log: str, key: bytes, entry: str) -> bytes:
    lb = log.encode()
    body = struct.pack("<I", len(lb)) + lb + cubin
    return _MAGIC + _mac(key, entry, body) + body


def _decode(blob: bytes, key: bytes, entry: str) -> tuple[bytes, str] | None:
    if len(blob) < 44 or blob[:8] != _MAGIC:
        return None
    digest, body = blob[8:40], blob[40:]
    if not hmac.compare_digest(_mac(key, entry, body), digest):
        return None
    (n,) = struct.unpack("<I", body[:4])
    if 4 + n > len(body):
        return None
    return body[4 + n:], body[4:4 + n].decode(errors="replace")


def _read_private(path: Path) -> bytes | None:
    """The entry's bytes, or None if it is not a regular file of this user that others cannot write
    (a directory, a FIFO, a link... in its place: recompiled, and replaced by ``_write_atomic``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None
        chunks, total = [], 0
        while total < (64 << 20):
            chunk = os.read(fd, min(1 << 20, (64 << 20) - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    missing = []
    d = path.parent
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):  # every directory fusec makes in the cache is private
        d.mkdir(mode=0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):  # an entry that became a directory: it goes, the entry is rewritten
        import shutil

        shutil.rmtree(path)
    with atomic_write(path, private=True, what="kernel cache entry") as f:
        f.write(data)
