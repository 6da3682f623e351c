"""A memory timeline: live arena bytes at each step of the launch order, from the memory plan.

A step is one node of the fused graph, i.e. one kernel (with its launches: a fused GEMM is a
cuBLAS call and an epilogue kernel). At step t a buffer is live when its first use <= t <= its
last use (``passes.memory_plan.UsageRecord``); inputs and outputs are pinned for the whole run.

- ``live``: the sum of the live buffers' sizes. Its maximum is the memory plan's lower bound:
  no offset assignment can use less arena.
- ``extent``: the top of the highest live buffer as the plan placed it (offset + size). Its
  maximum is the planned arena size; where it rises above ``live``, the greedy placement left a gap.

``timeline(...)`` gives the numbers; ``to_html`` a self-contained page (inline SVG, no script, no
network); ``to_png`` a picture through matplotlib (the ``[plot]`` extra).
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from typing import Any

from fusec.errors import FusecError


def timeline(mplan: Any, graph: Any = None, launches: Sequence[Mapping[str, Any]] = (), title: str = "") -> dict[str, Any]:
    """The per-step series of a ``MemoryPlan`` (``graph``: names each step after its kernel's ops;
    ``launches``: the described launches, counted per step)."""
    from fusec.report.subject import node_ops, short_name

    steps = max(int(mplan.num_steps), 1)
    live, pinned, extent = [0] * steps, [0] * steps, [0] * steps
    for r in mplan.records:
        for t in range(max(r.first, 0), min(r.last, steps - 1) + 1):
            live[t] += r.size
            if r.pinned:
                pinned[t] += r.size
            extent[t] = max(extent[t], r.offset + r.size)
    if graph is not None:
        names = [short_name(node_ops(n)) for n in graph.nodes][:steps]
    else:
        names = [f"step {t}" for t in range(steps)]
    per_step = [0] * steps
    for L in launches:
        node = L.get("node")
        if node is not None and 0 <= node < steps:
            per_step[node] += 1
    return {"title": title or (graph.name if graph is not None else ""), "steps": steps, "names": names,
            "live": live, "pinned": pinned, "extent": extent, "launches": per_step,
            "arena_bytes": int(mplan.arena_bytes), "lower_bound_bytes": int(mplan.lower_bound_bytes),
            "naive_bytes": int(mplan.naive_bytes), "alignment": int(mplan.alignment)}


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes below 1 KiB as they are)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


# ---- HTML (inline SVG) -------------------------------------------------------------------------

_W, _H, _L, _R, _T, _B = 960, 360, 80, 20, 20, 40  # canvas and margins (px)
_COLORS = {"live": "#4c78a8", "pinned": "#9ecae9", "extent": "#e45756", "bound": "#54a24b", "arena": "#222222"}


def to_svg(tl: Mapping[str, Any]) -> str:
    """The timeline as one ``<svg>`` element (a step area per series, dashed limits, tooltips)."""
    n = tl["steps"]
    top = max(tl["arena_bytes"], max(tl["live"], default=0), 1) * 1.18  # room for the legend
    pw, ph = _W - _L - _R, _H - _T - _B
    x = lambda t: _L + pw * t / n
    y = lambda b: _T + ph * (1 - b / top)

    def steps_path(vals: Sequence[int], close: bool) -> str:
        pts = []
        for t, v in enumerate(vals):
            pts += [f"{x(t):.1f},{y(v):.1f}", f"{x(t + 1):.1f},{y(v):.1f}"]
        if close:
            pts = [f"{x(0):.1f},{y(0):.1f}", *pts, f"{x(n):.1f},{y(0):.1f}"]
        return " ".join(pts)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
           f'font-family="sans-serif" font-size="11" role="img" aria-label="memory timeline">',
           f'<rect x="{_L}" y="{_T}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for k in range(5):  # y grid and labels
        b = top * k / 4
        out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{y(b):.1f}" y2="{y(b):.1f}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{_L - 6}" y="{y(b) + 4:.1f}" text-anchor="end">{html.escape(fmt_bytes(b))}</text>')
    tick = max(1, n // 12)
    for t in range(0, n, tick):
        out.append(f'<text x="{x(t + 0.5):.1f}" y="{_T + ph + 14}" text-anchor="middle">{t}</text>')
    out.append(f'<text x="{_L + pw / 2}" y="{_H - 6}" text-anchor="middle">step (kernel, in launch order)</text>')
    out.append(f'<polygon points="{steps_path(tl["live"], True)}" fill="{_COLORS["live"]}" fill-opacity="0.55"/>')
    out.append(f'<polygon points="{steps_path(tl["pinned"], True)}" fill="{_COLORS["pinned"]}" fill-opacity="0.8"/>')
    out.append(f'<polyline points="{steps_path(tl["extent"], False)}" fill="none" stroke="{_COLORS["extent"]}" '
               f'stroke-width="1.5"/>')
    for key, color in (("lower_bound_bytes", _COLORS["bound"]), ("arena_bytes", _COLORS["arena"])):
        yy = y(tl[key])
        out.append(f'<line x1="{_L}" x2="{_L + pw}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="{color}" stroke-dasharray="6 4"/>')
    for t in range(n):  # one invisible column per step, with a tooltip
        tip = (f"step {t}: {tl['names'][t]}\nlive {fmt_bytes(tl['live'][t])} ({tl['live'][t]:,} B), "
               f"pinned {fmt_bytes(tl['pinned'][t])}, placed up to {fmt_bytes(tl['extent'][t])}, "
               f"{tl['launches'][t]} launch(es)")
        out.append(f'<rect x="{x(t):.1f}" y="{_T}" width="{max(pw / n, 0.5):.2f}" height="{ph}" fill="transparent">'
                   f'<title>{html.escape(tip)}</title></rect>')
    legend = [("live bytes", _COLORS["live"]), ("pinned (inputs, outputs)", _COLORS["pinned"]),
              ("placed extent", _COLORS["extent"]), (f"lower bound {fmt_bytes(tl['lower_bound_bytes'])}", _COLORS["bound"]),
              (f"planned arena {fmt_bytes(tl['arena_bytes'])}", _COLORS["arena"])]
    lx = _L + 8
    for text, color in legend:
        out.append(f'<rect x="{lx}" y="{_T + 6}" width="10" height="10" fill="{color}"/>')
        out.append(f'<text x="{lx + 14}" y="{_T + 15}">{html.escape(text)}</text>')
        lx += 24 + 6.2 * len(text)
    out.append("</svg>")
    return "\n".join(out)


def to_html(tl: Mapping[str, Any]) -> str:
    """A self-contained HTML page: the SVG and a table of the numbers."""
    title = html.escape(f"fusec memory timeline: {tl['title']}" if tl["title"] else "fusec memory timeline")
    rows = "".join(f"<tr><td>{t}</td><td>{html.escape(tl['names'][t])}</td><td>{tl['launches'][t]}</td>"
                   f"<td>{tl['live'][t]:,}</td><td>{tl['pinned'][t]:,}</td><td>{tl['extent'][t]:,}</td></tr>"
                   for t in range(tl["steps"]))
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{title}</title>"
            "<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:12px}"
            "td,th{border:1px solid #ddd;padding:2px 6px;text-align:right}td:nth-child(2){text-align:left}</style>"
            f"</head><body><h2>{title}</h2>"
            f"<p>planned arena {tl['arena_bytes']:,} B &middot; lower bound {tl['lower_bound_bytes']:,} B &middot; "
            f"naive (no reuse) {tl['naive_bytes']:,} B &middot; {tl['steps']} steps</p>\n{to_svg(tl)}\n"
            "<table><tr><th>step</th><th>kernel</th><th>launches</th><th>live B</th><th>pinned B</th>"
            f"<th>placed extent B</th></tr>{rows}</table></body></html>\n")


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend, or a FusecError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        raise FusecError("a PNG needs matplotlib: pip install \"fusec[plot]\" (or write .html, which needs nothing)") from None
    return plt


def to_png(tl: Mapping[str, Any], path: str | os.PathLike[str], dpi: int = 100) -> None:
    """Draw the timeline with matplotlib (``pip install "fusec[plot]"``) into a PNG, atomically."""
    from fusec.fsutil import atomic_write

    plt = require_matplotlib()

    n = tl["steps"]
    xs = list(range(n + 1))
    mib = 2**20 if tl["arena_bytes"] >= 2**20 else 2**10
    unit = "MiB" if mib == 2**20 else "KiB"
    s = lambda vals: [v / mib for v in vals] + [vals[-1] / mib]
    fig, ax = plt.subplots(figsize=(9, 3.4))
    try:
        ax.fill_between(xs, s(tl["live"]), step="post", color=_COLORS["live"], alpha=0.55, label="live bytes")
        ax.fill_between(xs, s(tl["pinned"]), step="post", color=_COLORS["pinned"], label="pinned (inputs, outputs)")
        ax.step(xs, s(tl["extent"]), where="post", color=_COLORS["extent"], lw=1.2, label="placed extent")
        ax.axhline(tl["lower_bound_bytes"] / mib, color=_COLORS["bound"], ls="--", lw=1,
                   label=f"lower bound {fmt_bytes(tl['lower_bound_bytes'])}")
        ax.axhline(tl["arena_bytes"] / mib, color=_COLORS["arena"], ls=":", lw=1.2,
                   label=f"planned arena {fmt_bytes(tl['arena_bytes'])}")
        ax.set_xlim(0, n)
        ax.set_ylim(0, max(tl["arena_bytes"], max(tl["live"])) / mib * 1.25)
        ax.set_xlabel("step (kernel, in launch order)")
        ax.set_ylabel(unit)
        ax.set_title(f"arena timeline: {tl['title']}" if tl["title"] else "arena timeline", fontsize=10)
        ax.legend(loc="upper right", fontsize=7, ncol=3, frameon=False)
        fig.tight_layout()
        with atomic_write(path, what="PNG file") as f:
            fig.savefig(f, format="png", dpi=dpi)
    finally:
        plt.close(fig)
