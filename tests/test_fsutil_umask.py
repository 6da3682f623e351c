"""fsutil._umask reads the process umask without opening a window in which it is 0."""

from __future__ import annotations

import os

import pytest

from fusec import fsutil


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o027
    finally:
        os.umask(old)


def test_umask_is_read_without_setting_it(umask_027: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status here: the set-and-restore path applies")
    calls = []
    monkeypatch.setattr(fsutil.os, "umask", lambda m: calls.append(m) or 0)
    assert fsutil._umask() == umask_027
    assert calls == []  # never set, not even for an instant


def test_fallback_window_is_stricter_never_open(umask_027: int, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = open

    def no_proc(path, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(path) == "/proc/self/status":
            raise FileNotFoundError(path)
        return real_open(path, *a, **kw)

    monkeypatch.setattr("builtins.open", no_proc)
    seen = []
    real_umask = os.umask
    monkeypatch.setattr(fsutil.os, "umask", lambda m: seen.append(m) or real_umask(m))
    assert fsutil._umask() == umask_027
    assert seen == [0o077, umask_027]  # the window held 0o077, then the mask was put back
    assert real_umask(umask_027) == umask_027


def test_atomic_write_mode_follows_the_umask(umask_027: int, tmp_path) -> None:  # noqa: ANN001
    target = tmp_path / "out.bin"
    with fsutil.atomic_write(str(target)) as f:
        f.write(b"x")
    assert (target.stat().st_mode & 0o777) == 0o666 & ~umask_027
