"""Opening the files of a model's directory, which are untrusted data (README, "Trust").

A model directory (a Hugging Face checkpoint; the external data beside an ONNX file) is read by
names fusec chose (``config.json``, ``*.safetensors``) or the model file chose (an ONNX
``location``); whoever made the directory chose what is behind each name. ``open_in_dir`` opens
one without following any symbolic link (``O_NOFOLLOW`` on every path component, each opened
relative to its parent's descriptor), without blocking (``O_NONBLOCK``: a FIFO cannot hang the
open) and accepts only a regular file with one link (a hard link can lead anywhere on the file
system); the descriptor it returns is the file that was checked. A Hugging Face hub-cache
snapshot (``.../models--org--name/snapshots/<rev>/``, see ``fusec.hubcache``) is made of links into
its repository's ``blobs/``: there each link met on the way is read and its target opened in turn,
every component again with ``O_NOFOLLOW`` from the repository's directory, so a link is followed
only where it resolves inside that repository's cache directory. ``read_in_dir`` reads such a
file whole after checking its size against a cap (``/dev/zero`` or a 100 GB "config.json" is one
error line, never an out-of-memory), ``read_json_in_dir`` parses it as a JSON object and
``fd_path`` names the checked descriptor for libraries that only take a path (safetensors).

Every problem of the file is a ModelError naming it; ``open_in_dir`` leaves OSErrors to its caller.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Sequence
from typing import Any

from fusec.errors import ModelError

# Text files of a model directory (config.json, tokenizer.json, chat templates): real
# tokenizer.json files are about 10 MB (Gemma 3's is 33 MB); anything larger is refused.
TEXT_LIMIT = 64 << 20

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def open_in_dir(root: str | os.PathLike[str], rel: Sequence[str], where: str) -> tuple[int, os.stat_result]:
    """Open ``root/rel...`` (``rel``: path components, none of them '', '.' or '..') read-only and
    check the descriptor: no symlink on the way (in a hub-cache snapshot: none leading outside its
    repository), a regular file with one link. Returns (fd, its stat); the caller closes fd.
    ModelError (naming ``where``) for a link, a FIFO, a device or a directory; OSError
    (FileNotFoundError...) when the file cannot be opened at all."""
    if not rel or any(c in ("", ".", "..") or "/" in c or "\0" in c for c in rel):
        raise ModelError(f"{where}: not a plain path inside the model's directory")
    from fusec.hubcache import repo_of

    hub = repo_of(root)
    if hub is not None:
        return _open_in_repo(hub[0], hub[1] + list(rel), where)
    fd = _walk(root, list(rel), where, None)
    assert isinstance(fd, int)
    return _checked(fd, where)


def _walk(root: str | os.PathLike[str], rel: list[str], where: str, repo: str | None) -> int | list[str]:
    """Open ``rel`` from ``root`` with O_NOFOLLOW on every component; the descriptor, or (``repo``
    given: root is that repository's directory) the components the first link met leads to."""
    flags_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        for i, comp in enumerate(rel):
            last = i == len(rel) - 1
            flags = (os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC) if last else flags_dir
            try:
                nfd = os.open(comp, flags, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.EMLINK) or (e.errno == errno.ENOTDIR and not last):
                    if repo is not None:
                        target = _link_target(fd, comp)
                        if target is not None:
                            return _inside(repo, rel[:i], target, rel[i + 1:], where)
                    raise ModelError(f"{where} is or passes through a symbolic link; a model's files must be "
                                     "regular files inside its directory (copy them in)") from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _link_target(dir_fd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except OSError:  # not a link (a file where a directory was expected)
        return None


def _inside(repo: str, parent: list[str], target: str, rest: list[str], where: str) -> list[str]:
    """The components, from the repository's directory, of the link ``target`` met at ``parent/``
    followed by ``rest``; ModelError when it leads outside the repository."""
    escape = ModelError(f"{where} is a symbolic link leading outside its Hugging Face cache repository "
                        f"{os.path.basename(repo)!r}; only links into the repository's own files are followed")
    if os.path.isabs(target):
        norm = os.path.normpath(target)
        bases = [b for b in (repo, os.path.realpath(repo)) if norm.startswith(b.rstrip(os.sep) + os.sep)]
        if not bases:
            raise escape
        parts = os.path.relpath(norm, bases[0]).split(os.sep)
    else:
        parts = list(parent) + target.split("/")
    out: list[str] = []
    for c in parts:
        if c in ("", "."):
            continue
        if c == "..":
            if not out:  # above the repository's directory
                raise escape
            out.pop()
        else:
            out.append(c)
    if not out:
        raise ModelError(f"{where}: a symbolic link to the repository's directory itself")
    return out + rest


def _open_in_repo(repo: str, rel: list[str], where: str) -> tuple[int, os.stat_result]:
    """``open_in_dir`` inside a hub-cache repository: links are followed (at most 40) while each
    resolves inside ``repo``; the file is opened from ``repo`` with O_NOFOLLOW on every component."""
    for _ in range(41):
        got = _walk(repo, rel, where, repo)
        if isinstance(got, int):
            return _checked(got, where)
        rel = got
    raise ModelError(f"{where}: too many levels of symbolic links")


def _checked(fd: int, where: str) -> tuple[int, os.stat_result]:
    """(fd, its stat) when fd is a regular file with one link; else closes fd, ModelError."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"{where} is not a regular file")
        if st.st_nlink != 1:
            raise ModelError(f"{where} has {st.st_nlink} hard links; a model's files must be files of their own "
                             "(a hard link can point outside the model's directory)")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def _where(root: str | os.PathLike[str], name: str) -> str:
    return repr(os.path.join(os.fspath(root), name))


def open_file(root: str | os.PathLike[str], name: str, *, missing_ok: bool = False) -> tuple[int, os.stat_result] | None:
    """``open_in_dir`` for the file ``name`` directly in ``root``, every failure a ModelError; None
    when it does not exist and ``missing_ok``."""
    where = _where(root, name)
    try:
        return open_in_dir(root, [name], where)
    except FileNotFoundError:
        if missing_ok:
            return None
        raise ModelError(f"{where} not found") from None
    except OSError as e:
        raise ModelError(f"cannot open {where}: {e.strerror or e}") from None


def read_in_dir(root: str | os.PathLike[str], name: str, *, missing_ok: bool = False,
                limit: int | None = None) -> bytes | None:
    """The bytes of the regular file ``root/name`` (see ``open_in_dir``), at most ``limit`` of them
    (default TEXT_LIMIT; ModelError past it, checked before reading); None when it does not exist
    and ``missing_ok``."""
    limit = TEXT_LIMIT if limit is None else limit
    opened = open_file(root, name, missing_ok=missing_ok)
    if opened is None:
        return None
    fd, st = opened
    where = _where(root, name)
    try:
        if st.st_size > limit:
            raise ModelError(f"{where} is {st.st_size} bytes, more than the {limit} a model's text file may have")
        chunks, total = [], 0
        while True:  # up to limit + 1 bytes: a file that grows meanwhile is still caught
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise ModelError(f"{where} is more than the {limit} bytes a model's text file may have")
    except OSError as e:
        raise ModelError(f"cannot read {where}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_text_in_dir(root: str | os.PathLike[str], name: str, *, missing_ok: bool = False) -> str | None:
    """``read_in_dir`` decoded as UTF-8 (ModelError when it is not)."""
    data = read_in_dir(root, name, missing_ok=missing_ok)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelError(f"cannot read {_where(root, name)}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json_in_dir(root: str | os.PathLike[str], name: str, *, missing_ok: bool = False) -> dict[str, Any] | None:
    """The JSON object in ``root/name``; ModelError for anything else (not JSON, nested too deep,
    a list...); None when it does not exist and ``missing_ok``."""
    text = read_text_in_dir(root, name, missing_ok=missing_ok)
    if text is None:
        return None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ModelError(f"cannot read {_where(root, name)}: {e}") from None
    except RecursionError:
        raise ModelError(f"cannot read {_where(root, name)}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelError(f"{_where(root, name)} does not hold a JSON object (it holds a {type(data).__name__})")
    return data


def fd_path(fd: int, fallback: str) -> str:
    """A path that opens the very file behind ``fd`` (``/proc/self/fd/N`` on Linux), for libraries
    that take only a path: a name swapped for a link after the check cannot redirect them. Where
    the system has no such path, ``fallback`` (the checked name)."""
    proc = f"/proc/self/fd/{fd}"
    return proc if os.path.exists(proc) else fallback
