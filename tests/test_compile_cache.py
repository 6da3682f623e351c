"""NVRTC compile cache: in-process reuse, disk hit/miss, corrupted entries recompiled, atomic
writes, and compile errors that name the kernel and carry the NVRTC log."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusec.codegen import compile as CC
from fusec.errors import FusecError

SRC = """
extern "C" __global__ void fc_test_k(float* x) { x[threadIdx.x] = %s * (float)threadIdx.x; }
"""


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path))
    CC.clear_memory_cache()
    return tmp_path


def _entries(root: Path) -> list[Path]:
    return sorted((root / "kernels").rglob("*.bin"))


def test_compiles_to_cubin_without_gpu(cache: Path) -> None:
    b = CC.compile_cuda(SRC % "2.0f", "fc_test_k", "sm_90")
    assert b.cubin[:4] == b"\x7fELF"
    assert b.registers is not None and b.registers > 0


def test_the_cubin_is_the_whole_elf_file(cache: Path) -> None:
    """CuPy's getCUBIN drops the ELF's last byte (as a string terminator): the compiler restores it,
    so that the headers' extent is the bytes held, for every arch; a short one read back is repaired
    and anything else is left as it is."""
    from fusec.plancheck import complete_cubin, elf_size

    for arch in ("sm_80", "sm_90"):
        b = CC.compile_cuda(SRC % "5.0f", "fc_test_k", arch)
        assert elf_size(b.cubin) == len(b.cubin), arch
        assert complete_cubin(b.cubin[:-1]) == b.cubin and complete_cubin(b.cubin) == b.cubin
        assert complete_cubin(b.cubin[:-2]) == b.cubin[:-2]  # two bytes short: not what CuPy does, left alone
    assert complete_cubin(b"not an elf") == b"not an elf"


def test_memory_then_disk_hit(cache: Path) -> None:
    before = dict(CC.STATS)
    b1 = CC.compile_cuda(SRC % "3.0f", "fc_test_k", "sm_90")
    b2 = CC.compile_cuda(SRC % "3.0f", "fc_test_k", "sm_90")
    assert b2 is b1 and CC.STATS["memory_hits"] == before["memory_hits"] + 1
    assert CC.STATS["compiled"] == before["compiled"] + 1
    assert len(_entries(cache)) == 1
    CC.clear_memory_cache()
    b3 = CC.compile_cuda(SRC % "3.0f", "fc_test_k", "sm_90")
    assert b3.from_disk and b3.cubin == b1.cubin and b3.log == b1.log
    assert CC.STATS["disk_hits"] == before["disk_hits"] + 1


def test_key_covers_source_options_and_arch(cache: Path) -> None:
    k = CC.cache_key("a", ("-x",), "sm_90")
    assert k != CC.cache_key("b", ("-x",), "sm_90")
    assert k != CC.cache_key("a", ("-y",), "sm_90")
    assert k != CC.cache_key("a", ("-x",), "sm_80")
    a = CC.compile_cuda(SRC % "4.0f", "fc_test_k", "sm_80")
    b = CC.compile_cuda(SRC % "4.0f", "fc_test_k", "sm_90")
    assert a.key != b.key and a.cubin != b.cubin
    assert len(_entries(cache)) == 2


def test_line_info_only_when_asked(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSEC_LINEINFO compiles another binary (another key) that carries the source lines."""
    plain = CC.compile_cuda(SRC % "5.0f", "fc_test_k", "sm_90")
    monkeypatch.setenv("FUSEC_LINEINFO", "1")
    lined = CC.compile_cuda(SRC % "5.0f", "fc_test_k", "sm_90")
    assert lined.key != plain.key
    assert b".nv_debug_line_sass" in lined.cubin and b".nv_debug_line_sass" not in plain.cubin


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupted_entry_is_recompiled_not_loaded(cache: Path, damage: str) -> None:
    good = CC.compile_cuda(SRC % "5.0f", "fc_test_k", "sm_90")
    (path,) = _entries(cache)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob = bytearray()
    path.write_bytes(bytes(blob))
    CC.clear_memory_cache()
    corrupt = CC.STATS["corrupt"]
    again = CC.compile_cuda(SRC % "5.0f", "fc_test_k", "sm_90")
    assert not again.from_disk and again.cubin == good.cubin
    assert CC.STATS["corrupt"] == corrupt + 1
    # the entry was rewritten: the next process-level miss reads it from disk
    CC.clear_memory_cache()
    assert CC.compile_cuda(SRC % "5.0f", "fc_test_k", "sm_90").from_disk


def test_writes_are_atomic(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    CC.compile_cuda(SRC % "6.0f", "fc_test_k", "sm_90")
    (path,) = _entries(cache)
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]
    # a writer that dies before the rename leaves no entry behind, only nothing or the old one
    CC.clear_memory_cache()

    def boom(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(CC.os, "replace", boom)
    b = CC.compile_cuda(SRC % "7.0f", "fc_test_k", "sm_90")  # warns, still returns the binary
    assert b.cubin[:4] == b"\x7fELF"
    assert len(_entries(cache)) == 1
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_compile_error_names_kernel_and_carries_log(cache: Path) -> None:
    with pytest.raises(FusecError) as ei:
        CC.compile_cuda(SRC % "undefined_thing", "fc_test_k", "sm_90")
    err = ei.value
    assert isinstance(err, CC.KernelCompileError)
    assert "fc_test_k" in str(err) and "undefined_thing" in err.log
    assert "undefined_thing" in str(err)


def test_dump_source_on_error(cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("FUSEC_DUMP_SOURCE_ON_ERROR", "1")
    with pytest.raises(CC.KernelCompileError):
        CC.compile_cuda(SRC % "oops_value", "fc_bad_kernel", "sm_90")
    err = capsys.readouterr().err
    assert "fc_bad_kernel" in err and "    2  extern" in err
    assert (cache / "errors" / "fc_bad_kernel.cu").read_text().count("oops_value") == 1


def test_bad_arch_rejected(cache: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        CC.compile_cuda(SRC % "1.0f", "fc_test_k", "sm_90; rm -rf")
