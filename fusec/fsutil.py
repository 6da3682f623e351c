"""Atomic file writes: every file fusec writes (plans, kernel cache entries, outputs, ledgers)
goes through ``atomic_write``, so a reader never sees half a file and a failure leaves the old
file (or nothing) in place.

The temporary file is ``.NAME.<pid>.<random>.tmp`` next to the target. A write interrupted by
SIGKILL cannot remove its own; the next write to the same target removes those whose process is
gone (or that are older than a day). Every OS failure is an ``OutputError`` naming the path (a
``FusecError`` and an ``OSError``); the target must be a regular file or not exist yet: a
directory, a device node (``/dev/null``), a FIFO or a file under ``/proc`` is refused before
anything is written.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from typing import IO

from fusec.errors import FusecError

_STALE_SECONDS = 24 * 3600
_PSEUDO_FS = ("/proc", "/sys", "/dev")


class OutputError(FusecError, OSError):
    """A file fusec was asked to write cannot be written; the message names the path."""


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask, read without changing it where the system says it (Linux 4.7+:
    /proc/self/status). Elsewhere it is set and put back, the only portable way; the window then
    holds 0o077, so a file another thread makes meanwhile (kernel compiles write the cache from a
    thread pool) gets a stricter mode, never one without any umask."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o077)
        os.umask(mask)
    return mask


def check_output_path(path: str | os.PathLike[str], what: str = "output file",
                      not_same_as: Iterable[str | os.PathLike[str]] = ()) -> str:
    """Refuse an output path that cannot or must not be written, before any work is done.

    Refused: an empty path, a directory, anything but a regular file where the target exists, a
    path under /proc, /sys or /dev, a directory that does not exist, and a path that is one of
    ``not_same_as`` (the model being read, say). Returns the path as a string.
    """
    target = os.fspath(path)
    if not isinstance(target, str) or not target:
        raise OutputError(f"{what}: the path is empty")
    if "\0" in target:
        raise OutputError(f"{what} {target!r}: the path contains a NUL character")
    full = os.path.realpath(target)
    directory = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(directory):
        raise OutputError(f"cannot write {what} {target!r}: directory {directory!r} does not exist")
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"cannot write {what} {target!r}: {e.strerror or e}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputError(f"cannot write {what} {target!r}: it is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise OutputError(f"cannot write {what} {target!r}: it exists and is not a regular file "
                              "(a device, pipe or socket); fusec replaces only regular files")
    pseudo = next((p for p in _PSEUDO_FS if full == p or full.startswith(p + "/")), None)
    if pseudo is not None and not full.startswith("/dev/shm/"):
        raise OutputError(f"cannot write {what} {target!r}: it lies under {pseudo}, which holds no regular files")
    if st is not None:
        for other in not_same_as:
            try:
                same = os.path.samefile(target, other)
            except OSError:
                same = False
            if same:
                raise OutputError(f"{what} {target!r} is the input file {os.fspath(other)!r}; "
                                  "writing it would destroy the input: choose another path")
    return target


def clean_stale_temps(target: str) -> int:
    """Remove ``.NAME.<pid>.<random>.tmp`` files of ``target`` left by writers that died.

    A file counts as stale when the process id in its name is gone, or it is older than a day;
    files of live writers are left alone. Returns how many were removed."""
    directory = os.path.dirname(os.path.abspath(target)) or "."
    prefix = "." + os.path.basename(target) + "."
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".tmp")]
    except OSError:
        return 0
    for name in names:
        middle = name[len(prefix):-len(".tmp")]
        pid_text = middle.split(".", 1)[0]
        full = os.path.join(directory, name)
        try:
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue
            stale = time.time() - st.st_mtime > _STALE_SECONDS
            if not stale and pid_text.isdigit() and "." in middle:
                stale = not _alive(int(pid_text))
            if stale:
                os.unlink(full)
                removed += 1
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], private: bool = False, what: str = "file") -> Iterator[IO[bytes]]:
    """Yield a binary file; on a clean exit it is synced and renamed over ``path``, otherwise
    deleted (KeyboardInterrupt included). ``private``: keep mkstemp's 0600 (cache entries);
    default: the usual 0666 & ~umask. OS failures raise ``OutputError`` naming ``path``."""
    target = check_output_path(path, what)
    directory = os.path.dirname(os.path.abspath(target))
    clean_stale_temps(target)
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.{os.getpid()}.", suffix=".tmp")
    except OSError as e:
        raise OutputError(f"cannot write {what} {target!r}: {e.strerror or e}") from None
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            if not private:
                os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, target)
        except OutputError:
            raise
        except OSError as e:
            raise OutputError(f"cannot write {what} {target!r}: {e.strerror or e}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
