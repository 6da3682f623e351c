"""On-disk cache of A/B measurements: ``$FUSEC_CACHE_DIR/ab/<key[:2]>/<key>.json``.

The key hashes everything a measurement depends on: the region's structural signature, the
experiment (kind, rule, variant), dtype, execution mode, decision margin, and the environment
(GPU name, driver, NVRTC, CuPy and fusec versions). Writes go to a temp file in the same
directory and are ``os.replace``d, so a reader never sees half an entry; an unreadable entry is
a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _dir() -> Path:
    from fusec.codegen.compile import cache_dir

    return cache_dir() / "ab"


def key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def get(k: str) -> dict[str, Any] | None:
    path = _dir() / k[:2] / f"{k}.json"
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == k else None


def put(k: str, value: dict[str, Any]) -> None:
    directory = _dir() / k[:2]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".ab-", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({**value, "key": k}, f)
        os.replace(tmp, directory / f"{k}.json")
    except OSError:
        pass  # a cache that cannot be written only costs a re-measurement
