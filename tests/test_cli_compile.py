"""CLI: fusec compile -> plan file -> fusec inspect PLAN; bench and run of a plan refuse without a GPU."""

from __future__ import annotations

import json

import pytest

from fusec import device
from fusec.cli import main


@pytest.fixture()
def no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_available", lambda: False)


def call(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_compile_writes_a_plan_that_inspect_describes(capsys, tmp_path, no_gpu) -> None:
    plan = tmp_path / "g.fplan"
    dumps = tmp_path / "dumps"
    code, out, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(plan), "--dtype", "bf16", "--arch", "sm_80",
                                   "--cuda-graph", "--dump-dir", str(dumps)])
    assert code == 0, err
    assert plan.is_file() and "compiled gpt2-tiny" in out and "no GPU found" in err
    assert (dumps / "00-input.txt").is_file() and len(list(dumps.iterdir())) > 5
    code, out, err = call(capsys, ["inspect", str(plan), "--json"])
    assert code == 0, err
    info = json.loads(out)
    assert info["arch"] == "sm_80" and info["dtype"] == "bf16" and info["cuda_graph"] is True
    assert info["launches"] == len(info["kernels"]) > 0
    assert all(("grid" in k and "block" in k) or "m" in k for k in info["kernels"])
    code, out, _ = call(capsys, ["inspect", str(plan)])
    assert code == 0 and f"kernels     {info['launches']} launches per run" in out and "arch        sm_80" in out


def test_compile_refuses_bad_options_with_one_line(capsys, tmp_path) -> None:
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "missing" / "g.fplan")])
    assert code == 1 and err.count("\n") == 1 and "does not exist" in err
    code, _, err = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan"), "--arch", "volta"])
    assert code == 1 and "--arch" in err
    code, _, _ = call(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan"), "--dtype", "fp8"])
    assert code == 2
    assert list(tmp_path.iterdir()) == []


def test_bench_and_plan_run_need_a_gpu(capsys, tmp_path, no_gpu) -> None:
    plan = tmp_path / "g.fplan"
    assert call(capsys, ["compile", "bert-tiny", "-o", str(plan)])[0] == 0
    code, _, err = call(capsys, ["bench", str(plan)])
    assert code == 1 and err.startswith("fusec: error: fusec bench") and "no GPU found" in err
    code, _, err = call(capsys, ["run", str(plan), "--stats"])
    assert code == 1 and "no GPU found" in err


def test_disabling_a_fusion_rule_changes_the_plan(capsys, tmp_path) -> None:
    a, b = tmp_path / "a.fplan", tmp_path / "b.fplan"
    assert call(capsys, ["compile", "gpt2-tiny", "-o", str(a)])[0] == 0
    assert call(capsys, ["compile", "gpt2-tiny", "-o", str(b), "--disable-fusion", "gemm_epilogue"])[0] == 0
    na = json.loads(call(capsys, ["inspect", str(a), "--json"])[1])["launches"]
    nb = json.loads(call(capsys, ["inspect", str(b), "--json"])[1])["launches"]
    assert nb > na
