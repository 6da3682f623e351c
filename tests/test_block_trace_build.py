"""FUSEC_TRACE (benchmarks/block_trace.py's per-block timestamps) on the CPU: a traced kernel is another
binary under another cache key, with the module global the benchmark reads; untraced kernels carry no
trace code."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.build_gemm import gemv_form
from fusec.codegen.kernels import build
from fusec.dtypes import DType


def test_the_trace_is_another_binary_with_its_global(monkeypatch) -> None:  # noqa: ANN001
    spec = S.GemvSpec(1, 4096, 1024, DType.BF16, norm=True, **gemv_form(4096, 1024, DType.BF16, False, 1, True))
    plain = build(spec, "sm_90")
    monkeypatch.setenv("FUSEC_TRACE", "1")
    traced = build(spec, "sm_90")
    assert traced.source == plain.source  # the same source: the trace is a compile option
    assert traced.binary.key != plain.binary.key and traced.binary.cubin != plain.binary.cubin
    assert b"fc_trace" in traced.binary.cubin and b"fc_trace" not in plain.binary.cubin


def test_the_table_from_block_stamps() -> None:
    """benchmarks/block_trace.py's summary of synthetic stamps: a module's last launch is the one read,
    times are from the step's first block, 'early' counts blocks started before the kernel before ended."""
    import os
    import sys
    import types

    import numpy as np

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import block_trace as B

    assert os.environ.get("FUSEC_TRACE") != "1"  # importing it sets nothing: only its main() traces
    launches = [{"kernel": 0, "grid": [2, 1, 1], "label": "#1 a"}, {"kernel": 1, "grid": [3, 1, 1], "label": "#2 b"},
                {"kernel": 0, "grid": [2, 1, 1], "label": "#3 a"}, {"type": "gemm", "label": "#4 cublas"}]
    plan = types.SimpleNamespace(manifest={"entries": {"decode": {"launches": launches}},
                                           "kernels": [{"module": "m0"}, {"module": "m1"}]})

    def stamps(rows: list[tuple[int, ...]]) -> np.ndarray:
        t = np.zeros((B.TRACE_BLOCKS, B.SLOTS), np.uint64)
        for i, r in enumerate(rows):
            t[i, :len(r)] = r
        return t

    # module m1 (#2 b) first: blocks start at 1000 and 1500 ns; m0's last launch (#3 a) starts at 2000 and 4000
    traces = {"m1": stamps([(1000, 1100, 1200, 3000, 5), (1500, 1600, 1700, 2500, 6), (1200, 1300, 1400, 2900, 5)]),
              "m0": stamps([(2000, 2100, 3100, 5000, 7, 3600), (4000, 4100, 4200, 6000, 7, 4400, 5000)])}
    rows = B.timeline(plan, traces)
    assert [r["label"] for r in rows] == ["#2 b", "#3 a"]
    b, a = B.summarize(rows)
    assert b["blocks"] == 3 and b["sms"] == 2 and b["max_blocks_per_sm"] == 2
    # b's blocks on SM 5 (two: ends 3000 and 2900 ns) and SM 6 (one: 2500), from the step's first start (1000)
    assert b["end_p50_by_sm_load"] == {1: 1.5, 2: 1.95}
    assert (b["start_min"], b["start_max"], b["end_max"]) == (0.0, 0.5, 2.0)
    assert a["started_before_prev_end"] == 1  # only the block at 2000 ns started before b's last end (3000)
    assert (a["waited_min"], a["after_wait_p50"], a["at_wait_max"]) == (2.1, 1.85, 3.1)
    assert a["max_blocks_per_sm"] == 2 and a["sms"] == 1
    # phase marks, after each block's own wait: phase 1 of both (0.5, 0.2), phase 2 of one, phase 3 of none
    assert (a["phase1_p50"], a["phase2_p50"], a["phase3_p50"]) == (0.35, 0.8, None)
    assert b["phase1_p50"] is None


def test_the_wait_pinned_on_the_values_is_another_binary(monkeypatch) -> None:  # noqa: ANN001
    """FUSEC_PDL_PIN=value (common.cuh fc_pdl_wait_after branches on the first loads' values, not a clock read): the
    same source compiled to another binary under another key; the default reads the clock before the wait."""
    from fusec.codegen.specs_quant import QGemvSpec
    from fusec.lower.qgemv_form import gemv_form as qform

    spec = QGemvSpec(1, 2048, 8192, "q8_0", 32, DType.BF16, DType.F16, **qform(1, 2048, 8192, "q8_0", 32, DType.BF16))
    issue = build(spec, "sm_90")
    monkeypatch.setenv("FUSEC_PDL_PIN", "value")
    value = build(spec, "sm_90")
    assert value.source == issue.source and "dep = (fc_u32)clock();" in issue.source
    assert value.binary.key != issue.binary.key and value.binary.cubin != issue.binary.cubin
