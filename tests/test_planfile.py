"""The .fplan container: round trip, and every corruption refused with the broken part named."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fusec.planfile import FORMAT_VERSION, PlanFileError, read_plan, write_plan


@pytest.fixture()
def plan_path(tmp_path):
    rng = np.random.default_rng(0)
    blobs = {
        "weights/w0": rng.standard_normal(1000).astype(np.float32).tobytes(),
        "cubin/k0": os.urandom(777),
        "source/k0": b"extern \"C\" __global__ void k0() {}",
    }
    path = tmp_path / "m.fplan"
    write_plan(path, {"arch": "sm_90", "dtype": "fp16"}, blobs)
    return path, blobs


def test_round_trip(plan_path) -> None:
    path, blobs = plan_path
    pf = read_plan(path)
    assert pf.manifest["arch"] == "sm_90"
    assert sorted(pf.names()) == sorted(blobs)
    for name, data in blobs.items():
        assert bytes(pf.blob(name)) == data


def test_truncated_file_is_refused(plan_path) -> None:
    path, _ = plan_path
    raw = path.read_bytes()
    for cut in (10, len(raw) // 2, len(raw) - 1):
        path.write_bytes(raw[:cut])
        with pytest.raises(PlanFileError, match="truncated|trailer|header"):
            read_plan(path)


def test_flipped_byte_anywhere_is_refused(plan_path) -> None:
    path, _ = plan_path
    raw = bytearray(path.read_bytes())
    rng = np.random.default_rng(1)
    for pos in rng.integers(24, len(raw) - 32, size=5):
        bad = bytearray(raw)
        bad[pos] ^= 0xFF
        path.write_bytes(bytes(bad))
        with pytest.raises(PlanFileError):
            read_plan(path)


def test_tampered_blob_names_the_blob(plan_path) -> None:
    """The trailer covers the header and the manifest (which holds every blob's hash); a changed
    blob is named by its own checksum, at once (verify="all") or on first use (verify="lazy")."""
    path, blobs = plan_path
    raw = bytearray(path.read_bytes())
    needle = blobs["source/k0"]
    pos = bytes(raw).index(needle)
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(PlanFileError, match="blob 'source/k0': checksum mismatch"):
        read_plan(path)
    pf = read_plan(path, verify="lazy")
    assert bytes(pf.blob("cubin/k0")) == blobs["cubin/k0"]
    with pytest.raises(PlanFileError, match="blob 'source/k0': checksum mismatch"):
        pf.blob("source/k0")


def test_other_format_and_version_are_refused(tmp_path, plan_path) -> None:
    junk = tmp_path / "junk.fplan"
    junk.write_bytes(b"PK\x03\x04" + os.urandom(200))
    with pytest.raises(PlanFileError, match="not a fusec plan file"):
        read_plan(junk)
    path, _ = plan_path
    raw = bytearray(path.read_bytes())
    raw[8:12] = (FORMAT_VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(PlanFileError, match="format_version"):
        read_plan(path)


def test_failed_write_leaves_nothing_behind(tmp_path) -> None:
    class FailsMidWrite(dict):
        """Builds the blob table fine, then fails while the data section is being written."""

        def values(self):
            yield b"x" * 1000
            raise RuntimeError("disk on fire")

    target = tmp_path / "x.fplan"
    target.write_bytes(b"previous plan")
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_plan(target, {"a": 1}, FailsMidWrite({"b": b"x" * 1000, "c": b"y"}))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.fplan"]
    assert target.read_bytes() == b"previous plan"


def test_saved_plan_gets_the_usual_permissions(tmp_path) -> None:
    import stat

    old = os.umask(0o022)
    try:
        write_plan(tmp_path / "p.fplan", {"a": 1}, {"b": b"123"})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "p.fplan").stat().st_mode) == 0o644
