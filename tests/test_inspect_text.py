"""The text of ``fusec inspect`` shows what the README promises (issue 11, item 8): for a model and
for a plan, the op histogram, recognized patterns, fusion decisions, kernel count and memory plan,
with readable byte counts and aligned tables; every number checked against the ``--json`` report."""

from __future__ import annotations

import json
import re

import pytest

import fusec
from fusec.cli import main
from fusec.runtime.guard import fmt_bytes


def _call(capsys, argv) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def _section(lines: list[str], header_start: str) -> list[str]:
    """The indented lines under the line starting with ``header_start``."""
    i = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    out = []
    for ln in lines[i + 1:]:
        if not ln.startswith("  "):
            break
        out.append(ln)
    return out


def _aligned(rows: list[str], cells: int, right: tuple[int, ...] = ()) -> None:
    """Every row of a table puts its first ``cells`` columns at the same offsets: the same start,
    or the same end for the ``right``-aligned ones (cells are separated by two or more spaces)."""
    spans = [[(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", r)][:cells] for r in rows]
    for col in range(cells):
        edge = 1 if col in right else 0
        got = {s[col][edge] for s in spans if len(s) > col}
        assert len(got) == 1, (col, rows[:3])


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "g.fplan"
    fusec.compile("gpt2-tiny").save(path)
    return path


def test_plan_text_shows_the_report_with_readable_bytes(capsys, plan_path) -> None:
    info = json.loads(_call(capsys, ["inspect", str(plan_path), "--json"]))
    lines = _call(capsys, ["inspect", str(plan_path)]).splitlines()
    mem, rep = info["memory"], info["report"]
    text = "\n".join(lines)
    assert f"source      gpt2-tiny (built-in, sha256 {info['source']['sha256'][:16]}...)" in lines
    assert f"toolchain   NVRTC {info['nvrtc_version']}, CuPy {info['cupy_version']}, driver {info['driver_version']}" in text
    assert f"memory      arena {fmt_bytes(mem['arena_bytes'])}, weights {fmt_bytes(mem['weights_bytes'])}" in lines
    assert (f"memory plan naive {fmt_bytes(mem['naive_bytes'])} -> planned {fmt_bytes(mem['planned_bytes'])} "
            f"(lower bound {fmt_bytes(mem['lower_bound_bytes'])})") in lines
    assert re.search(r"\d+(\.\d+)? (KiB|MiB)", text) and "bytes" not in text.split("memory plan")[0].split("memory")[1]
    ops = _section(lines, "ops (")
    assert {tuple(r.split()) for r in ops} == {(k, str(v)) for k, v in rep["ops"].items()}
    _aligned(ops, 2, right=(1,))
    found = {k: v for k, v in rep["patterns"].items() if v}
    assert "patterns    " + ", ".join(f"{k} {v}" for k, v in found.items()) in lines
    applied = sum(f["decision"] == "applied" for f in rep["fusions"])
    assert f"fusion decisions ({applied} applied, {len(rep['fusions']) - applied} rejected):" in lines
    decisions = _section(lines, "fusion decisions")
    assert len(decisions) == len(rep["fusions"]) + 1  # a header row
    assert decisions[0].split()[:4] == ["rule", "decision", "layer", "ops"]
    _aligned(decisions, 4, right=(3,))
    kernels_line = f"kernels     {info['launches']} launches per run, {len(fusec.load(plan_path).manifest['kernels'])}"
    assert any(ln.startswith(kernels_line) for ln in lines)
    table = [ln for ln in _section(lines, "kernels ") if not ln.startswith("  by kind")]
    assert len(table) == info["launches"] + 1
    _aligned(table, 3, right=(0,))
    for k, row in zip(info["kernels"], table[1:]):
        assert k["name"] in row


def test_model_text_shows_imported_and_optimized_ops_and_the_decisions(capsys) -> None:
    rep = json.loads(_call(capsys, ["inspect", "gpt2-tiny", "--json"]))
    lines = _call(capsys, ["inspect", "gpt2-tiny"]).splitlines()
    assert f"ops (imported {sum(rep['imported_ops'].values())} nodes -> optimized {rep['nodes']}):" in lines
    rows = _section(lines, "ops (")
    assert rows[0].split() == ["op", "imported", "optimized"]
    _aligned(rows, 3, right=(1, 2))
    got = {r.split()[0]: r.split()[1:] for r in rows[1:]}
    for op in set(rep["imported_ops"]) | set(rep["ops"]):
        assert got[op] == [str(rep["imported_ops"].get(op) or "-"), str(rep["ops"].get(op) or "-")]
    assert len(_section(lines, "fusion decisions")) == len(rep["fusions"]) + 1
    assert any(ln.startswith(f"kernels     {rep['kernels']} launches per run") for ln in lines)
    mem = rep["memory"]
    assert (f"memory plan naive {fmt_bytes(mem['naive_bytes'])} -> planned {fmt_bytes(mem['planned_bytes'])} "
            f"(lower bound {fmt_bytes(mem['lower_bound_bytes'])})") in lines


def test_a_generation_plan_renders_every_entry(capsys, tmp_path) -> None:
    from fusec.compiler import compile_generation

    path = tmp_path / "gen.fplan"
    compile_generation("llama-tiny", batch=2, max_seq_len=16).save(path)
    info = json.loads(_call(capsys, ["inspect", str(path), "--json"]))
    lines = _call(capsys, ["inspect", str(path)]).splitlines()
    for name, e in info["entries"].items():
        assert f"entry {name}:" in lines
        assert f"  kernels     {e['launches']} launches per run" in lines
