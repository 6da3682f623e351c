"""Hostile input, the kernel cache (issue 10, item 2): cache entries become code in every plan
compiled here. Entries are MACed with the cache's private key and read only from private files, so
bytes planted with a valid plain digest are recompiled, never used; a cache directory writable by
others (or owned by someone else) is refused with one line naming it."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
from hostile_helpers import fails

from fusec.codegen import compile as CC
from fusec.plancheck import cubin_arch

SRC = 'extern "C" __global__ void fc_hostile_k(float* x) { x[threadIdx.x] = %s; }'


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(root))
    CC.clear_memory_cache()
    yield root
    CC.clear_memory_cache()


def _entry(root: Path) -> Path:
    (path,) = sorted((root / "kernels").rglob("*.bin"))
    return path


def _plain_digest_entry(cubin: bytes, log: str = "") -> bytes:
    """What an attacker can forge without the key: magic, sha256 of the body, body."""
    lb = log.encode()
    body = struct.pack("<I", len(lb)) + lb + cubin
    return CC._MAGIC + hashlib.sha256(body).digest() + body


def test_planted_entry_with_a_valid_digest_is_not_used(cache) -> None:
    good = CC.compile_cuda(SRC % "1.0f", "fc_hostile_k", "sm_90")
    path = _entry(cache)
    evil = CC.compile_cuda(SRC % "666.0f", "fc_hostile_k", "sm_90", use_disk=False).cubin
    assert evil != good.cubin
    path.write_bytes(_plain_digest_entry(evil))
    CC.clear_memory_cache()
    again = CC.compile_cuda(SRC % "1.0f", "fc_hostile_k", "sm_90")
    assert not again.from_disk and again.cubin == good.cubin


def test_entry_with_a_valid_mac_but_another_arch_is_not_used(cache) -> None:
    good = CC.compile_cuda(SRC % "2.0f", "fc_hostile_k", "sm_90")
    path = _entry(cache)
    other = CC.compile_cuda(SRC % "2.0f", "fc_hostile_k", "sm_80", use_disk=False).cubin
    path.write_bytes(CC._encode(other, "", CC._mac_key(), path.stem))
    CC.clear_memory_cache()
    again = CC.compile_cuda(SRC % "2.0f", "fc_hostile_k", "sm_90")
    assert not again.from_disk and cubin_arch(again.cubin) == 90 and again.cubin == good.cubin


def test_an_entry_moved_to_another_key_is_not_used(cache) -> None:
    """Entries are MAC'd with their key: swapping two valid entries' files makes both misses."""
    one = CC.compile_cuda(SRC % "4.0f", "fc_hostile_k", "sm_90")
    two = CC.compile_cuda(SRC % "5.0f", "fc_hostile_k", "sm_90")
    assert one.cubin != two.cubin
    p1, p2 = sorted((cache / "kernels").rglob("*.bin"))
    b1, b2 = p1.read_bytes(), p2.read_bytes()
    p1.write_bytes(b2)
    p2.write_bytes(b1)
    CC.clear_memory_cache()
    again = (CC.compile_cuda(SRC % "4.0f", "fc_hostile_k", "sm_90"), CC.compile_cuda(SRC % "5.0f", "fc_hostile_k", "sm_90"))
    assert [b.from_disk for b in again] == [False, False]
    assert (again[0].cubin, again[1].cubin) == (one.cubin, two.cubin)


def test_entry_writable_by_others_is_not_used(cache) -> None:
    CC.compile_cuda(SRC % "3.0f", "fc_hostile_k", "sm_90")
    path = _entry(cache)
    os.chmod(path, 0o666)
    CC.clear_memory_cache()
    assert not CC.compile_cuda(SRC % "3.0f", "fc_hostile_k", "sm_90").from_disk
    CC.clear_memory_cache()  # the rewritten entry is private again
    assert CC.compile_cuda(SRC % "3.0f", "fc_hostile_k", "sm_90").from_disk


@pytest.mark.parametrize("where", ["root", "kernels"])
def test_world_writable_cache_directory_is_refused(cache, where) -> None:
    CC.compile_cuda(SRC % "4.0f", "fc_hostile_k", "sm_90")
    d = cache if where == "root" else cache / "kernels"
    os.chmod(d, 0o777)
    CC.clear_memory_cache()
    with pytest.raises(CC.KernelCacheError) as ei:
        CC.compile_cuda(SRC % "4.0f", "fc_hostile_k", "sm_90")
    assert str(d) in str(ei.value) and "writable by others" in str(ei.value) and "FUSEC_CACHE_DIR" in str(ei.value)


def test_cli_refuses_a_world_writable_cache_in_one_line(capsys, cache, tmp_path) -> None:
    os.chmod(cache, 0o777)
    fails(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan")], needles=[str(cache), "writable by others"])
    assert not (tmp_path / "g.fplan").exists()


def test_cache_key_file_readable_by_others_is_refused(cache) -> None:
    CC.compile_cuda(SRC % "5.0f", "fc_hostile_k", "sm_90")
    os.chmod(cache / "key", 0o644)
    CC.clear_memory_cache()
    with pytest.raises(CC.KernelCacheError, match="key"):
        CC.compile_cuda(SRC % "5.0f", "fc_hostile_k", "sm_90")


def test_cache_directory_that_is_a_file_is_refused(tmp_path, monkeypatch) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(f))
    CC.clear_memory_cache()
    with pytest.raises(CC.KernelCacheError, match="not a directory"):
        CC.compile_cuda(SRC % "6.0f", "fc_hostile_k", "sm_90")


def test_new_cache_directories_are_private(cache) -> None:
    CC.compile_cuda(SRC % "7.0f", "fc_hostile_k", "sm_90")
    path = _entry(cache)
    for d in (path.parent, path.parent.parent):
        assert os.stat(d).st_mode & 0o077 == 0, oct(os.stat(d).st_mode)
    assert os.stat(path).st_mode & 0o077 == 0 and os.stat(cache / "key").st_mode & 0o077 == 0
