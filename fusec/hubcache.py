"""Hugging Face hub ids (``org/name``) found in the local hub cache, never downloaded.

The cache's layout (``huggingface_hub``'s): ``<cache>/models--<org>--<name>/`` holds ``refs/main``
(the commit the ``main`` branch pointed at when it was fetched), ``snapshots/<commit>/`` (the
repository's files, each a symbolic link into ``../../blobs/``) and ``blobs/`` (the contents).
``<cache>`` is ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``,
else ``~/.cache/huggingface/hub``.

``resolve(hub_id)`` names the snapshot directory; ``repo_of(path)`` tells ``fusec.modelfiles``
that a model directory is (inside) such a snapshot, so that its links are followed, each only
where it resolves inside the repository's own cache directory ``models--<org>--<name>/``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from fusec.errors import ModelError

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
_REV = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def cache_dir() -> Path:
    """The hub cache directory the environment names (see the module docstring)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = Path(os.environ["XDG_CACHE_HOME"]).expanduser() if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def is_hub_id(text: str) -> bool:
    """``org/name`` as the hub spells repository ids, and no such path exists here."""
    return bool(_ID.fullmatch(text)) and ".." not in text and not os.path.lexists(text)


def repo_dir(hub_id: str) -> Path:
    org, name = hub_id.split("/")
    return cache_dir() / f"models--{org}--{name}"


def resolve(hub_id: str) -> Path:
    """The snapshot directory of ``hub_id``'s ``main`` revision in the local cache (the only
    snapshot when ``refs/main`` is missing). ModelError when the cache has no copy."""
    from fusec.modelfiles import read_in_dir

    repo = repo_dir(hub_id)
    if not repo.is_dir():
        raise ModelError(f"{hub_id!r} is not a file, a directory or a built-in model, and the Hugging Face cache "
                         f"{os.fspath(cache_dir())!r} has no copy of it (fusec never downloads: fetch it first, e.g. "
                         f"`huggingface-cli download {hub_id}`, or set HF_HUB_CACHE / HF_HOME)")
    ref = read_in_dir(repo / "refs", "main", missing_ok=True, limit=256) if (repo / "refs").is_dir() else None
    if ref is not None:
        rev = ref.decode("ascii", "replace").strip()
        if not _REV.fullmatch(rev):
            raise ModelError(f"{os.fspath(repo / 'refs' / 'main')!r} does not name a revision")
    else:
        snaps = sorted(p.name for p in (repo / "snapshots").iterdir()) if (repo / "snapshots").is_dir() else []
        if len(snaps) != 1:
            raise ModelError(f"{os.fspath(repo)!r} has no refs/main and {len(snaps)} snapshots: give the snapshot "
                             "directory itself (snapshots/<revision>)")
        rev = snaps[0]
    snap = repo / "snapshots" / rev
    if not snap.is_dir():
        raise ModelError(f"{hub_id!r}: the cache's refs/main names revision {rev}, whose snapshot "
                         f"{os.fspath(snap)!r} is missing (fetch the model again)")
    return snap


def model_path(hub_id: str) -> str:
    """What in ``hub_id``'s snapshot fusec reads: the snapshot directory (a checkpoint with a
    config.json), else its one ``.gguf`` file."""
    snap = resolve(hub_id)
    if os.path.lexists(snap / "config.json"):
        return os.fspath(snap)
    ggufs = sorted(n for n in os.listdir(snap) if n.lower().endswith(".gguf"))
    if len(ggufs) == 1:
        return os.fspath(snap / ggufs[0])
    if ggufs:
        raise ModelError(f"{hub_id!r} holds {len(ggufs)} GGUF files ({', '.join(ggufs[:6])}): give one of them, "
                         f"e.g. {os.fspath(snap / ggufs[0])!r}")
    raise ModelError(f"{hub_id!r}: its snapshot {os.fspath(snap)!r} has neither a config.json nor a .gguf file")


def repo_of(root: str | os.PathLike[str]) -> tuple[str, list[str]] | None:
    """(the repository's cache directory, the path components from it to ``root``) when the
    directory ``root`` is a hub-cache snapshot or lies inside one, else None."""
    parts = Path(os.path.realpath(root)).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return os.path.join(*parts[:i]), list(parts[i:])
    return None
