"""fusec.report.trace (the trace JSON from synthetic timings), launch naming and NVTX ranges."""

from __future__ import annotations

import json

import pytest

from fusec.report import nvtx as fnvtx
from fusec.report.subject import describe_launches, load_subject, node_ops, parse_label, short_name
from fusec.report.trace import trace_document, write_trace


def _described():
    sub = load_subject("gpt2-tiny", arch="sm_90")
    return sub, sub.describe()


def test_trace_schema_from_synthetic_timings(tmp_path):
    sub, launches = _described()
    n = len(launches)
    gpu = [(10.0 * i, 4.0 + i) for i in range(n)]
    host = [(3.0 * i, 1.5) for i in range(n)]
    doc = trace_document(launches, gpu, host, {"source": "gpt2-tiny"})
    path = tmp_path / "t.json"
    write_trace(path, doc)
    back = json.loads(path.read_text())
    assert back == json.loads(json.dumps(doc))
    events = back["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    for e in slices:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and isinstance(e["name"], str)
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    gpu_slices = [e for e in slices if e["pid"] == 1]
    host_slices = [e for e in slices if e["pid"] == 2]
    assert len(gpu_slices) == len(host_slices) == n
    assert [e["name"] for e in gpu_slices] == [L["name"] for L in launches]
    assert [(e["ts"], e["dur"]) for e in gpu_slices] == [pytest.approx(t) for t in gpu]
    assert [e["args"]["launch"] for e in gpu_slices] == list(range(n))
    names = {(e["pid"], e["name"]): e["args"] for e in events if e["ph"] == "M"}
    assert names[(1, "process_name")] == {"name": "GPU"} and names[(2, "process_name")] == {"name": "host"}
    other = back["otherData"]
    assert other["gpu_timing"] == "cuda-events" and other["launches"] == n and other["source"] == "gpt2-tiny"
    assert other["gpu_busy_us"] == pytest.approx(sum(d for _, d in gpu))
    assert other["gpu_span_us"] == pytest.approx(gpu[-1][0] + gpu[-1][1])


def test_trace_refuses_mismatched_timings():
    _, launches = _described()
    with pytest.raises(ValueError, match="launches"):
        trace_document(launches, [(0.0, 1.0)])


def test_slice_names_are_the_fused_ops():
    sub, launches = _described()
    for L in launches:
        node = sub.graph.nodes[L["node"]]
        terms = L["name"].split(" (")[0].split("+")
        ops = node_ops(node)
        for t in terms:
            base = t.split("x")[0] if t[-1].isdigit() else t
            assert base.startswith("...") or base in ops, (L["name"], ops)
    fused = [L for L in launches if L["rule"]]
    assert fused and all(L["ops"] == node_ops(sub.graph.nodes[L["node"]]) for L in fused)
    assert any("gelu" in L["name"] for L in launches)  # gpt2's MLP activation sits in a fused kernel


def test_names_without_a_graph_come_from_labels():
    launches = [{"type": "kernel", "kernel": 0, "label": "#3 fused fused[gemm_epilogue] epilogue"},
                {"type": "kernel", "kernel": 1, "label": "state 'pos' <- update"},
                {"type": "gemm", "dtype": "f16", "m": 1, "n": 2, "k": 3, "batch": 1, "label": "#4 matmul"}]
    out = describe_launches(launches, None, [{"entry": "fc_a"}, {"entry": "fc_b"}])
    assert [d["name"] for d in out] == ["fused[gemm_epilogue] (epilogue)", "state 'pos' <- update", "matmul"]
    assert [d["kernel"] for d in out] == ["fc_a", "fc_b", "cublas_gemm_f16 m=1 n=2 k=3 batch=1"]
    assert parse_label("#12 layernorm") == {"node": 12, "op": "layernorm", "rule": None, "part": None}


def test_short_name():
    assert short_name(["matmul", "add", "gelu"]) == "matmul+add+gelu"
    assert short_name(["reshape", "transpose", "attention", "transpose"]) == "attention"
    assert short_name(["reshape", "transpose"]) == "reshape+transpose"
    assert short_name(["add", "add", "mul"]) == "addx2+mul"
    long = short_name([f"op{i}" for i in range(9)])
    assert long.endswith("...(9 ops)") and long.count("+") == 4


class _Recorder:
    def __init__(self):
        self.log = []

    def RangePush(self, name):  # noqa: N802 (cupy.cuda.nvtx's names)
        self.log.append(("push", name))

    def RangePop(self):  # noqa: N802
        self.log.append(("pop",))


class _FakeExecutor:
    def __init__(self, log, graph=None):
        self.entry = {"launches": [{"label": "#0 gather"}, {"label": "#1 fused fused[elementwise]"}]}
        self._launches = [lambda s, i=i: log.append(("launch", i, s)) for i in range(2)]
        self._graph = graph


def test_nvtx_ranges_wrap_each_launch(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(fnvtx, "_nvtx", lambda: rec)
    fnvtx.run_with_ranges(_FakeExecutor(rec.log), "S")
    assert rec.log == [("push", "fusec run"), ("push", "#0 gather"), ("launch", 0, "S"), ("pop",),
                       ("push", "#1 fused fused[elementwise]"), ("launch", 1, "S"), ("pop",), ("pop",)]


def test_nvtx_graph_replay_is_one_range_and_missing_nvtx_still_launches(monkeypatch):
    rec = _Recorder()

    class Graph:
        def launch(self, stream):
            rec.log.append(("graph", stream))

    monkeypatch.setattr(fnvtx, "_nvtx", lambda: rec)
    fnvtx.run_with_ranges(_FakeExecutor(rec.log, Graph()), "S")
    assert rec.log == [("push", "fusec run (graph)"), ("graph", "S"), ("pop",)]
    log = []
    monkeypatch.setattr(fnvtx, "_nvtx", lambda: None)  # CuPy without NVTX: plain launches
    fnvtx.run_with_ranges(_FakeExecutor(log), "S")
    assert log == [("launch", 0, "S"), ("launch", 1, "S")]


def test_nvtx_is_off_by_default_and_the_executor_asks_for_it():
    import os

    import fusec.report.nvtx as n

    saved = os.environ.pop("FUSEC_NVTX", None)
    try:  # read when a plan runs, not at import: setting it later takes effect
        assert n.enabled() is False
        os.environ["FUSEC_NVTX"] = "1"
        assert n.enabled() is True
    finally:
        os.environ.pop("FUSEC_NVTX", None)
        if saved is not None:
            os.environ["FUSEC_NVTX"] = saved
    import inspect

    from fusec.plan import Plan
    from fusec.runtime.executor import Executor

    assert "nvtx" in inspect.signature(Executor.run).parameters
    assert "nvtx" in inspect.signature(Plan.run).parameters
