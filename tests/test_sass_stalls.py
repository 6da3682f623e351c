"""benchmarks/sass_stalls.py reads Nsight Compute's source page (CSV, one section a kernel) into the
instructions with the most stall samples: sections split at each kernel's header row, rows of another width
are not instructions, and the printout names the top instruction and its nonzero stall reasons."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from sass_stalls import sections  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"stall_long_sb","stall_math","stall_long_sb (Not Issued)"')
PAGE = "\n".join([
    "==PROF== a line the profiler printed",
    "fc_qgemv_aaaa",
    HEADER,
    '"0x10","LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]","30","20","25","0","20"',
    '"0x20","@P0 I2F.S8 R5, R19","80","90","78","2","77"',
    '"0x30","a row of another width"',
    "fc_qgemv_bbbb",
    HEADER,
    '"0x40","HMMA.16816.F32.BF16 R4, R8, R12, R4","7","1","0","7","0"',
])


def test_sections_split_per_kernel_and_keep_only_instruction_rows() -> None:
    secs = sections(PAGE)
    assert [t for t, _, _ in secs] == ["fc_qgemv_aaaa", "fc_qgemv_bbbb"]
    assert [len(rows) for _, _, rows in secs] == [2, 1]
    assert secs[0][2][1][1] == "@P0 I2F.S8 R5, R19"


def test_the_printout_ranks_by_samples_and_names_the_reasons(tmp_path: Path) -> None:
    page = tmp_path / "sass.csv"
    page.write_text(PAGE)
    out = subprocess.run([sys.executable, str(BENCH / "sass_stalls.py"), str(page), "--top", "1"],
                         capture_output=True, text=True, check=True).stdout
    first = out.splitlines()[1]  # the top instruction of the first kernel, ranked by all samples (not the not-issued)
    assert "I2F.S8" in first and "72.7%" in first and "stall_long_sb=78" in first and "stall_math=2" in first
    assert "Not Issued" not in first
    assert "by opcode: I2F 72.7%, LDGSTS 27.3%" in out


def test_a_page_without_samples_says_so(tmp_path: Path) -> None:
    page = tmp_path / "empty.csv"
    page.write_text('"Address","Source"\n"0x10","NOP"\n')
    out = subprocess.run([sys.executable, str(BENCH / "sass_stalls.py"), str(page)], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("no source section with warp stall samples")
