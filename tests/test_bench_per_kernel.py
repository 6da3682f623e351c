"""``fusec bench --per-kernel`` (fusec.bench_kernels) and the bench command's options.

CPU: a GEMM record's FLOPs and minimum bytes, the lowering's per-launch bytes (each distinct value
once), the roofline rows built from given times and ceilings, and the command's refusals. GPU: the
command end to end (JSON, the three modes, --cuda-graph, the per-kernel profile)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import fusec
from fusec.bench_kernels import by_kind, entry_launches, format_table, gemm_work, rows
from fusec.cli import main

MODEL = "gpt2-tiny"


@pytest.fixture(scope="module")
def plan():  # noqa: ANN201
    # 32 tokens: products of M = 32 rows are cuBLAS launches on sm_80 (M <= 16 would be GEMV kernels; sm_90 runs them
    # on fusec's wgmma GEMM)
    return fusec.compile(MODEL, shapes={"input_ids": (1, 32), "attention_mask": (1, 32)}, dtype="fp16", arch="sm_80")


def test_gemm_work_counts_flops_and_each_operand_once() -> None:
    L = {"m": 8, "n": 16, "k": 32, "batch": 1, "stride_a": 0, "stride_b": 0, "dtype": "f16"}
    flops, moved = gemm_work(L)
    assert flops == 2 * 8 * 16 * 32 and moved == (8 * 32 + 32 * 16 + 8 * 16) * 2
    lt = dict(L, bias=["weights", 0], c_in=["arena", 0], epilogue="bias")
    assert gemm_work(lt)[1] == moved + (16 + 8 * 16) * 2  # + the bias row and the residual
    batched = dict(L, batch=4, stride_a=256, stride_b=0, dtype="f32")
    assert gemm_work(batched) == (4 * flops, float((4 * 256 + 512 + 4 * 128) * 4))


def test_lowering_records_minimum_bytes_per_launch(plan) -> None:  # noqa: ANN001
    name, launches, nbytes = entry_launches(plan.manifest)
    assert name == "main" and nbytes is not None and len(nbytes) == len(launches)
    ins = {d["name"]: d for d in plan.manifest["inputs"]}
    ids = ins["input_ids"]
    emb = launches[0]  # the token embedding reads the ids and the table, writes the activations
    assert plan.manifest["kernels"][emb["kernel"]]["entry"].startswith("fc_emb")
    assert nbytes[0] > int(np.prod(ids["shape"])) * 8  # ids + table rows + output, each once
    gemms = [(L, n) for L, n in zip(launches, nbytes) if L["type"] == "gemm" and L["batch"] == 1]
    assert gemms and all(n > 0 for n in nbytes)
    for L, n in gemms:  # A, B and C of the record, once each (the tied lm_head's padded table included)
        assert n == (L["m"] * L["k"] + L["k"] * L["n"] + L["m"] * L["n"]) * 2


def test_rows_give_share_rate_and_roofline(plan) -> None:  # noqa: ANN001
    _, launches, nbytes = entry_launches(plan.manifest)
    times = [0.01 * (i + 1) for i in range(len(launches))]
    peaks = {"gbps": 1000.0, "tflops": 100.0}
    recs = rows(plan.manifest, times, peaks)
    assert len(recs) == len(launches)
    assert abs(sum(r["share"] for r in recs) - 1.0) < 1e-9
    for r, L, ms in zip(recs, launches, times):
        if L["type"] == "gemm":
            flops, moved = gemm_work(L)
            assert r["tflops"] == pytest.approx(flops / (ms * 1e-3) / 1e12)
            floor = max(flops / 1e14, moved / 1e12)
        else:
            assert r["tflops"] is None and r["gbps"] == pytest.approx(r["bytes"] / (ms * 1e-3) / 1e9)
            floor = r["bytes"] / 1e12
        assert r["roofline"] == pytest.approx(floor / (ms * 1e-3))
    text = format_table({"peaks": peaks, "launches": recs, "sum_ms": sum(times), "floor_ms": 1.0, "roofline": 0.5}, 5)
    assert len(text.splitlines()) == 3 + 5 and ("cublas" in text or "fc_" in text)
    kinds = by_kind(recs)
    assert sum(g["count"] for g in kinds) == len(recs) and sum(g["ms"] for g in kinds) == pytest.approx(sum(times))
    assert [g["ms"] for g in kinds] == sorted((g["ms"] for g in kinds), reverse=True)
    for g in kinds:  # each group: the launches of one kind, its mean their mean
        mine = [r for r in recs if r["kind"].split(" algo ")[0] == g["kind"]]
        assert g["count"] == len(mine) and g["mean_ms"] == pytest.approx(sum(r["ms"] for r in mine) / len(mine))
    assert len(kinds) < len(recs)  # gpt2-tiny runs its layer's kernels once per layer
    text = format_table({"peaks": peaks, "launches": recs, "kinds": kinds, "sum_ms": sum(times), "floor_ms": 1.0,
                         "roofline": 0.5}, 5)
    lines = text.splitlines()
    assert lines[3 + 5].startswith("  by kind:") and len(lines) == 3 + 5 + 1 + min(5, len(kinds))
    assert text.splitlines()[1] == "  times: cuda events around each launch of an eager run"
    replay = {"wall_ms": 0.5, "busy_ms": 0.45, "gaps_ms": 0.05, "other_ms": 0.002, "overlap_ms": 0.01, "replays": 20}
    text = format_table({"peaks": peaks, "launches": recs, "sum_ms": sum(times), "floor_ms": 1.0, "roofline": 0.5,
                         "source": "CUPTI kernel records of 20 CUDA-graph replays", "replay": replay}, 5)
    assert text.splitlines()[1] == "  times: CUPTI kernel records of 20 CUDA-graph replays"
    assert text.splitlines()[2].startswith("  replay: wall 0.5000 ms = kernels 0.4500 ms + gaps 0.0500 ms")


def test_busy_time_counts_overlapping_kernels_once() -> None:
    """Kernels launched with PDL start before the one before them ends: busy time is the union of
    the kernels' intervals, not the sum of their durations."""
    from fusec.runtime.kernel_trace import covered

    assert covered([(0, 10, "a"), (5, 12, "b"), (20, 30, "c")]) == 22
    assert covered([(0, 10, "a"), (2, 4, "b")]) == 10
    assert covered([(5, 6, "b"), (0, 2, "a")]) == 3


def test_bench_refusals_are_one_line(capsys) -> None:  # noqa: ANN001
    assert main(["bench", MODEL, "--peak-gbps", "3000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--peak-gbps and --peak-tflops" in err[0]
    assert main(["bench", MODEL, "--iters", "0"]) == 1
    assert "--iters" in capsys.readouterr().err


def test_bench_without_gpu_says_so(capsys) -> None:  # noqa: ANN001
    from fusec.device import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", MODEL]) == 1
    assert "no GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_bench_json_modes_and_per_kernel(capsys) -> None:  # noqa: ANN001
    assert main(["bench", MODEL, "--dtype", "fp16", "--iters", "5", "--warmup", "2", "--per-kernel", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in out["results"]] == ["eager", "cuda_graph", "bound"]
    for r in out["results"]:
        assert r["median_ms"] > 0 and r["host_enqueue_ms"] > 0
    pk = out["per_kernel"]
    assert len(pk["launches"]) == out["launches"] and pk["peaks"]["measured"]
    assert abs(sum(r["share"] for r in pk["launches"]) - 1) < 1e-6
    # a fraction, except that data resident in the 50 MB L2 may beat the DRAM copy ceiling
    assert all(r["roofline"] is None or 0 < r["roofline"] < 10 for r in pk["launches"])
    assert pk["floor_ms"] < pk["sum_ms"]
    assert main(["bench", MODEL, "--dtype", "fp16", "--iters", "3", "--warmup", "1", "--cuda-graph", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["mode"] for r in out["results"]] == ["cuda_graph", "bound"]


@pytest.mark.gpu
def test_gpu_per_kernel_from_graph_replays(capsys) -> None:  # noqa: ANN001
    """--cuda-graph --per-kernel: each launch's kernel time inside bound graph replays (CUPTI)."""
    pytest.importorskip("cupti", reason="cupti-python is not installed")
    assert main(["bench", MODEL, "--dtype", "fp16", "--iters", "3", "--warmup", "1", "--cuda-graph", "--per-kernel",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pk = out["per_kernel"]
    assert pk["source"].startswith("CUPTI kernel records of"), pk["source"]
    rp = pk["replay"]
    assert len(pk["launches"]) == out["launches"] and all(r["ms"] > 0 for r in pk["launches"])
    # the launches' kernels and the unattributed ones (input copies) make up the replay's busy time
    # plus the time kernels overlap (PDL) (medians over replays of each part vs the median of the
    # whole: equal up to their spread)
    assert pk["sum_ms"] + rp["other_ms"] == pytest.approx(rp["busy_ms"] + rp["overlap_ms"], rel=0.1)
    assert rp["overlap_ms"] >= 0
    assert 0 < rp["busy_ms"] <= rp["wall_ms"] and rp["gaps_ms"] == pytest.approx(rp["wall_ms"] - rp["busy_ms"])


def test_event_median_ms_times_each_call_between_two_events(monkeypatch) -> None:  # noqa: ANN001
    """One untimed call first, then ``iters`` calls each bracketed by its own pair of events; the
    median of their elapsed times (fake events: the clock is the number of calls made so far)."""
    import cupy

    from fusec.bench_kernels import event_median_ms

    calls = []

    class Ev:
        def record(self, stream) -> None:  # noqa: ANN001
            self.at = len(calls)

        def synchronize(self) -> None:
            pass

    class Stream:
        def synchronize(self) -> None:
            pass

    monkeypatch.setattr(cupy.cuda, "Event", Ev)
    monkeypatch.setattr(cupy.cuda, "get_elapsed_time", lambda a, b: float((b.at - a.at) * len(calls)))
    ms = event_median_ms(lambda: calls.append(1), Stream(), 3)
    assert len(calls) == 4  # the warm-up call is not timed
    assert ms == 3.0  # elapsed (1 call) x calls so far: 2, 3, 4 -> median 3


def test_bench_turns_the_counters_off_only_when_nobody_asked(monkeypatch) -> None:  # noqa: ANN001
    """Attached CUPTI copy tracing slows every graph launch: bench times without it unless FUSEC_CUPTI
    is set, --per-kernel needs CUPTI, or the process already has its counters; and a counters
    object made while it was off is forgotten afterwards, so the process's later plans count."""
    from fusec.runtime import counters
    from fusec.runtime.counters import DriverCounters, off_while_timing

    counters._reset_for_tests()
    monkeypatch.delenv("FUSEC_CUPTI", raising=False)
    with off_while_timing():
        assert os.environ.get("FUSEC_CUPTI") == "0"
        inst = DriverCounters.create()
        assert not inst.available and "FUSEC_CUPTI=0" in inst.reason
        assert DriverCounters.peek() is inst
    assert "FUSEC_CUPTI" not in os.environ
    assert DriverCounters.peek() is None  # it never attached CUPTI: forgotten
    with off_while_timing(keep=True):
        assert "FUSEC_CUPTI" not in os.environ
    monkeypatch.setenv("FUSEC_CUPTI", "1")
    with off_while_timing():
        assert os.environ["FUSEC_CUPTI"] == "1"
    monkeypatch.delenv("FUSEC_CUPTI")
    made = DriverCounters.create()  # no GPU here (or CUPTI state): whatever it is, it exists already
    with off_while_timing():
        assert "FUSEC_CUPTI" not in os.environ and DriverCounters.peek() is made
    counters._reset_for_tests()


def test_counters_describe_what_they_cost_timings() -> None:
    from fusec.bench import counters_state
    from fusec.knobs import KNOBS
    from fusec.runtime import counters
    from fusec.runtime.counters import DriverCounters

    counters._reset_for_tests()
    assert counters_state() == "not created"
    off = DriverCounters()
    off.reason = "disabled by FUSEC_CUPTI=0"
    assert off.describe() == "off (disabled by FUSEC_CUPTI=0)"
    on = DriverCounters()
    assert on.mode == KNOBS["FUSEC_CUPTI_MODE"].default == "lazy"
    on.available, on.reason = True, "CUPTI via cupti-python, mode lazy"
    assert "copy tracing only inside measured runs" in on.describe() and "FUSEC_CUPTI=0" in on.describe()
    assert "per node" not in on.describe()
    on.mode, on.reason = "always", "CUPTI via cupti-python, mode always"
    assert "~1 us of GPU time per node" in on.describe() and "FUSEC_CUPTI=0" in on.describe()


@pytest.mark.gpu
def test_gpu_bench_times_without_the_counters_and_says_so(tmp_path) -> None:  # noqa: ANN001
    """In its own process (the counters are one per process), with cupti-python importable or not."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FUSEC_CUPTI"}
    r = subprocess.run([sys.executable, "-m", "fusec", "bench", MODEL, "--dtype", "fp16", "--iters", "3",
                        "--warmup", "1", "--cuda-graph", "--json"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["driver_counters"] == "off (disabled by FUSEC_CUPTI=0)"
    assert all(res["driver_counters"] == out["driver_counters"] for res in out["results"])
