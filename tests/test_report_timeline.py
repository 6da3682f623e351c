"""fusec.report.timeline: live arena bytes over the launch order, as HTML (inline SVG) and PNG."""

from __future__ import annotations

import sys

import pytest

from fusec.errors import FusecError
from fusec.report.subject import load_subject
from fusec.report.timeline import timeline, to_html, to_png


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "qwen3-tiny"])
def test_peaks_are_the_memory_plans_numbers(name):
    sub = load_subject(name, arch="sm_90")
    tl = timeline(sub.mplan, sub.graph, sub.describe())
    summary = sub.graph.meta["memory"]  # what the memory_plan pass reported for this graph
    assert tl["steps"] == len(sub.graph.nodes)
    assert max(tl["live"]) == summary["lower_bound_bytes"]
    assert max(tl["extent"]) == summary["planned_bytes"] == tl["arena_bytes"]
    assert all(p <= lv <= e for p, lv, e in zip(tl["pinned"], tl["live"], tl["extent"]))
    assert sum(tl["launches"]) == len(sub.launches)


def test_steps_follow_the_buffers_lifetimes():
    sub = load_subject("gpt2-tiny", arch="sm_90")
    tl = timeline(sub.mplan, sub.graph)
    for rec in sub.mplan.records:
        for t in range(rec.first, rec.last + 1):
            assert tl["live"][t] >= rec.size
            assert tl["extent"][t] >= rec.offset + rec.size
    # the first step: inputs and outputs (pinned) are live from the start
    pinned = sum(r.size for r in sub.mplan.records if r.pinned)
    assert tl["pinned"][0] == pinned


def test_html_is_self_contained_and_escapes_names():
    sub = load_subject("gpt2-tiny", arch="sm_90")
    tl = timeline(sub.mplan, sub.graph, title='<script>alert("x")</script>')
    page = to_html(tl)
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and "</svg>" in page
    assert "<script" not in page  # the title is escaped, and the page has no script of its own
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in page
    assert page.count("<title>") == tl["steps"] + 1  # a tooltip per step, and the page title
    assert f"{tl['arena_bytes']:,} B" in page


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    sub = load_subject("gpt2-tiny", arch="sm_90")
    path = tmp_path / "t.png"
    to_png(timeline(sub.mplan, sub.graph), path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150_000


def test_png_without_matplotlib_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    sub = load_subject("gpt2-tiny", arch="sm_90")
    with pytest.raises(FusecError, match=r"fusec\[plot\]"):
        to_png(timeline(sub.mplan, sub.graph), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()
