"""``fusec memory PLAN_OR_MODEL -o timeline.html|.png``: the arena's live bytes over the launch order."""

from __future__ import annotations

import argparse
import os
from typing import Any

from fusec.cli._common import add_command, fmt_name
from fusec.cli.profile import add_subject_arguments, subject_from_args
from fusec.errors import InputError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "memory", "plot the arena's live bytes over the launch order (HTML or PNG)",
        "Draw the memory plan of PLAN_OR_MODEL: at each step of the launch order (one kernel), the\n"
        "bytes of the arena buffers alive then (inputs and outputs, pinned for the whole run, shown\n"
        "apart), the top of the highest live buffer as the plan placed it, the lower bound (the most\n"
        "bytes alive at once: no placement can do with less) and the planned arena size.\n"
        "-o FILE.html writes a self-contained page (inline SVG with a tooltip per step, and the\n"
        "numbers as a table; needs nothing); -o FILE.png needs matplotlib (pip install \"fusec[plot]\").\n"
        "A plan stores no graph: it is rebuilt from the plan's source model (or --model). Needs no GPU.",
        ["fusec memory gpt2-small -o gpt2-memory.html",
         "fusec memory gpt2.fplan -o gpt2-memory.png"])
    add_subject_arguments(p)
    p.add_argument("-o", "--output", metavar="FILE.html|FILE.png", required=True, help="the page or picture to write")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec.fsutil import atomic_write, check_output_path

    kind = os.path.splitext(args.output)[1].lower()
    if kind not in (".html", ".png"):
        raise InputError(f"-o {args.output!r}: write an .html page or a .png picture")
    check_output_path(args.output, "timeline", not_same_as=[args.model] if os.path.isfile(args.model) else [])
    if kind == ".png":
        from fusec.report.timeline import require_matplotlib

        require_matplotlib()  # before the model is built
    sub = subject_from_args(args)
    sub.need_graph("the memory timeline")
    from fusec.report.timeline import fmt_bytes, timeline, to_html, to_png

    shapes = ", ".join(f"{v.name} {'x'.join(map(str, v.shape))}" for v in sub.graph.inputs)
    dtype = sub.plan.dtype if sub.is_plan else (args.dtype or "fp16")
    title = f"{os.path.basename(args.model) if sub.is_plan else args.model} ({shapes}, {dtype})"
    tl = timeline(sub.mplan, sub.graph, sub.describe(), title=title)
    if kind == ".png":
        to_png(tl, args.output)
    else:
        with atomic_write(args.output, what="timeline") as f:
            f.write(to_html(tl).encode("utf-8"))
    peak = max(tl["live"])
    print(f"wrote {fmt_name(args.output)}: {tl['steps']} steps, peak live {fmt_bytes(peak)} ({peak:,} B) = lower bound, "
          f"planned arena {fmt_bytes(tl['arena_bytes'])} ({tl['arena_bytes']:,} B), "
          f"naive {fmt_bytes(tl['naive_bytes'])}")
    if sub.is_plan:
        from fusec.plan import entry_points

        entry = int(entry_points(sub.plan.manifest)[sub.entry]["arena_bytes"])
        whole = int(sub.memory["arena_bytes"])
        if entry != tl["arena_bytes"] or whole != entry:
            print(f"  the plan allocates {whole:,} B" + (", sized for its largest entry point" if whole != entry else "")
                  + f"; {sub.entry} needs {entry:,} B (the planned arena rounded up, plus kernel scratch space)")
    return 0
