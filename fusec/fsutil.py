"""Atomic file writes: every file fusec writes (plans, kernel cache entries, outputs, ledgers)
goes through ``atomic_write``, so a reader never sees half a file and a failure leaves the old
file (or nothing) in place."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], private: bool = False) -> Iterator[IO[bytes]]:
    """Yield a binary file; on a clean exit it is synced and renamed over ``path``, otherwise
    deleted. ``private``: keep mkstemp's 0600 (cache entries); default: the usual 0666 & ~umask."""
    target = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(target))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(target) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if not private:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
