"""The SASS instructions with the most stall samples, per kernel, from Nsight Compute's source page
(a script, not a test):

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 benchmarks/sass_stalls.py sass.csv --top 25

Each kernel's section starts at a header row that names a "Source" column and a "Warp Stall Sampling" column; rows
are that section's instructions. Printed per kernel: the total samples, the top instructions (address, samples,
share, the SASS text, the nonzero stall-reason columns where the page has them, all samples not the not-issued
ones), and the samples summed by opcode.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import Counter


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return 0.0


def sections(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for each kernel: the title is the last non-CSV line before its header."""
    out: list[tuple[str, list[str], list[list[str]]]] = []
    title, header, rows = "", None, []
    for line in text.splitlines():
        if not line.startswith('"'):
            if line.strip():
                if header is not None:
                    out.append((title, header, rows))
                    header, rows = None, []
                title = line.strip()
            continue
        cells = next(csv.reader(io.StringIO(line)))
        if "Source" in cells and any("Warp Stall Sampling" in c for c in cells):
            if header is not None:
                out.append((title, header, rows))
            header, rows = cells, []
        elif header is not None and len(cells) == len(header):
            rows.append(cells)
    if header is not None:
        out.append((title, header, rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    text = open(args.csv, errors="replace").read()
    secs = sections(text)
    if not secs:
        print("no source section with warp stall samples; the file starts:\n" + text[:1500])
        return
    for title, header, rows in secs:
        src = header.index("Source")
        # the samples column: "(All Samples)" where the page splits them, else the one there is
        allc = min((i for i, c in enumerate(header) if "Warp Stall Sampling" in c), key=lambda i: "All" not in header[i])
        addr = next((i for i, c in enumerate(header) if "Address" in c), None)
        reasons = [i for i, c in enumerate(header) if c.lower().startswith("stall_") and "Not Issued" not in c]
        total = sum(_num(r[allc]) for r in rows) or 1.0
        print(f"== {title} ({len(rows)} instructions, {total:.0f} samples)")
        for r in sorted(rows, key=lambda r: -_num(r[allc]))[:args.top]:
            why = " ".join(f"{header[i]}={r[i]}" for i in reasons if _num(r[i]) > 0)
            print(f"  {r[addr] if addr is not None else '':>8} {_num(r[allc]):8.0f} {100 * _num(r[allc]) / total:5.1f}% "
                  f"{r[src].strip()[:70]:70s} {why}")
        ops: Counter[str] = Counter()
        for r in rows:
            tok = r[src].strip().split()
            op = next((t for t in tok if not t.startswith("@")), "?").split(".")[0]
            ops[op] += _num(r[allc])
        print("  by opcode: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in ops.most_common(14)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
