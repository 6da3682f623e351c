"""Progress for long stages: model build, plan write, reference run (a line on a terminal only)."""

from __future__ import annotations

import sys

import pytest

from fusec import reference
from fusec.cli import main
from fusec.inputs import random_inputs
from fusec.loader import load_graph


def test_reference_run_reports_each_node():
    graph = load_graph("gpt2-tiny")
    steps = []
    out = reference.run(graph, random_inputs(graph), progress=lambda stage, item: steps.append((stage, item)))
    n = len(graph.nodes)
    assert len(steps) == n and {s for s, _ in steps} == {"reference"}
    assert steps[0][1] == f"{graph.nodes[0].op.value} (1/{n})" and steps[-1][1].endswith(f"({n}/{n})")
    assert out.keys() == reference.run(graph, random_inputs(graph)).keys()


def test_planned_reference_run_reports_the_nodes_it_computes():
    from fusec.compiler import stage

    st = stage(load_graph("qwen3-tiny"), "fp32", "sm_90", dry_run=True)
    steps = []
    reference.run_planned(st.graph, random_inputs(st.graph), st.memory, progress=lambda s, i: steps.append(i))
    views = sum(1 for n in st.graph.nodes
                if all(st.memory.alias.get(o.name, {}).get("kind") == "view" for o in n.outputs))
    assert views and len(steps) == len(st.graph.nodes) - views


def _on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


def test_compile_shows_build_and_write_on_a_terminal(capsys, monkeypatch, tmp_path):
    _on_a_terminal(monkeypatch)
    assert main(["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan")]) == 0
    out, err = capsys.readouterr()
    assert "build 1: gpt2-tiny" in err and "write 1: " in err
    summary = out.splitlines()[0].rsplit("(", 1)[1]  # "19 passes, 5 kernels in 0.6s)"
    assert " passes, " in summary and "build" not in summary and "write" not in summary
    assert main(["-q", "compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan")]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("terminal", [True, False])
def test_reference_run_shows_progress_only_on_a_terminal(capsys, monkeypatch, terminal):
    if terminal:
        _on_a_terminal(monkeypatch)
    assert main(["run", "gpt2-tiny", "--backend", "reference"]) == 0
    err = capsys.readouterr().err
    assert ("build 1: gpt2-tiny" in err and "reference 1: " in err) is terminal
    if not terminal:
        assert "reference 1" not in err and "build" not in err
