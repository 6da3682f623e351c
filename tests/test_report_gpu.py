"""fusec profile on a GPU: one trace slice per launch, named after the plan's kernels, positive
durations; NVTX ranges leave a run's results unchanged."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fusec.cli import main

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("target", ["gpt2-tiny", "plan"])
def test_profile_writes_one_slice_per_launch(tmp_path, capsys, target):
    import fusec
    from fusec.report.subject import load_subject

    if target == "plan":
        fusec.compile("gpt2-tiny", cuda_graph=True).save(tmp_path / "g.fplan")
        target = os.fspath(tmp_path / "g.fplan")
    out = tmp_path / "trace.json"
    assert main(["profile", target, "-o", os.fspath(out)]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    sub = load_subject(target)
    sub.compiled()
    launches = sub.describe()
    gpu = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    host = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 2]
    assert len(gpu) == len(host) == len(launches) == len(sub.plan.manifest["launches"])
    assert [e["name"] for e in gpu] == [L["name"] for L in launches]
    kernels = {k["entry"] for k in sub.plan.manifest["kernels"]}
    for e, L in zip(gpu, sub.plan.manifest["launches"]):
        assert e["dur"] > 0, e
        assert e["args"]["label"] == L["label"]
        if L["type"] == "kernel":
            assert e["args"]["kernel"] in kernels
        else:
            assert e["args"]["kernel"].startswith("cublas")
    starts = [e["ts"] for e in gpu]
    assert starts == sorted(starts)  # one stream: launch order is time order
    for a, b in zip(gpu, gpu[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + 1.0  # event resolution: about 0.5 us
    assert doc["otherData"]["gpu_timing"] == "cuda-events"
    assert doc["otherData"]["slice_names"].startswith("fused ops")
    assert doc["otherData"]["launch_mode"].startswith("eager")


def test_nvtx_ranges_leave_results_unchanged():
    import cupy as cp

    import fusec
    from fusec.inputs import random_inputs_for

    for cuda_graph in (False, True):
        plan = fusec.compile("gpt2-tiny", cuda_graph=cuda_graph)
        inputs = random_inputs_for(plan.manifest["inputs"], seed=0)
        plain = cp.asnumpy(plan.run(inputs, nvtx=False)["logits"])
        ranged = cp.asnumpy(plan.run(inputs, nvtx=True)["logits"])
        np.testing.assert_array_equal(plain, ranged)
        assert plan.stats()["launches"] == len(plan.manifest["launches"])


def test_profile_generation_decode_entry(tmp_path, capsys):
    import fusec
    from fusec.compiler import compile_generation
    from fusec.plan import entry_points

    path = tmp_path / "gen.fplan"
    compile_generation("llama-tiny", batch=1, max_seq_len=32, dtype="fp16").save(path)
    out = tmp_path / "decode.json"
    assert main(["profile", os.fspath(path), "--entry", "decode", "-o", os.fspath(out)]) == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    gpu = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    launches = entry_points(fusec.load(path).manifest)["decode"]["launches"]
    assert [e["args"]["label"] for e in gpu] == [L["label"] for L in launches]
    assert all(e["dur"] > 0 for e in gpu)
    assert any(e["args"]["ops"] == ["kv_attention"] for e in gpu)
    assert doc["otherData"]["entry"] == "decode"
