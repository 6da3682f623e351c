"""The per-shape cuBLASLt algorithm pick (fusec.runtime.lt_pick).

CPU: the selection (fastest wins, ties keep the heuristic's rank, failed candidates skipped), the
per-process cache (a signature is timed once), the off switch (the heuristic's first, nothing
timed), LtMatmul's candidates and ``use`` / ``enqueue`` against a fake libcublasLt, and
``prepare`` end to end with a fake timer. GPU (``-m gpu``): a tiny GPT-2 fp16 plan with cuBLASLt
epilogues matches the reference with the pick on and off, in a captured CUDA graph too, and the
pick is visible in the profile.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from test_epilogue_lt import _FakeLt

from fusec.runtime import cublaslt, lt_pick
from fusec.runtime.cublas import GemmCall


def test_fastest_wins_ties_keep_rank_failures_skipped() -> None:
    assert lt_pick.fastest([3.0, 1.0, 2.0]) == 1
    assert lt_pick.fastest([2.0, 1.0, 1.0, 1.5]) == 1  # tie: the heuristic's earlier candidate
    assert lt_pick.fastest([math.inf, 5.0, math.inf, 4.0]) == 3
    assert lt_pick.fastest([math.inf, math.inf]) == 0
    assert lt_pick.fastest([1.0]) == 0


def test_choose_times_each_candidate_once_per_signature() -> None:
    calls: list[int] = []
    times = [0.9, 0.5, 0.7, 0.5]

    def timer(i: int) -> float:
        calls.append(i)
        return times[i]

    cache: dict = {}
    p = lt_pick.choose(("sig",), 4, timer, cache=cache, passes=1)
    assert p["index"] == 1 and p["times_ms"] == times and calls == [0, 1, 2, 3]
    again = lt_pick.choose(("sig",), 4, timer, cache=cache)
    assert again["index"] == 1 and calls == [0, 1, 2, 3]  # cached: no second timing
    assert lt_pick.choose(("other",), 4, lambda i: [1, 2, 0.1, 3][i], cache=cache)["index"] == 2
    off = lt_pick.choose(("third",), 4, timer, on=False, cache=cache)
    assert off["index"] == 0 and not off["timed"] and ("third",) not in cache and len(calls) == 4
    assert lt_pick.choose(("one",), 1, timer, cache=cache)["index"] == 0 and len(calls) == 4


def test_each_candidate_keeps_its_best_round() -> None:
    """Round 1 at a low clock (everything slow, the later candidates less so), round 2 warm: the
    warm round decides, not the order the candidates were timed in."""
    rounds = iter([[9.0, 8.0, 7.0], [1.0, 1.2, 1.1]])
    ts: list[float] = []

    def timer(i: int) -> float:
        if i == 0:
            ts[:] = next(rounds)
        return ts[i]

    p = lt_pick.choose(("clock",), 3, timer, cache={}, passes=2)
    assert p["index"] == 0 and p["times_ms"] == [1.0, 1.2, 1.1]


def test_enabled_env() -> None:
    assert not lt_pick.enabled({}) and lt_pick.enabled({"FUSEC_LT_PICK": "1"})  # opt-in (RESULTS: slower in plans)
    for v in ("0", "off", "False", " no "):
        assert not lt_pick.enabled({"FUSEC_LT_PICK": v})


def _call(**kw) -> GemmCall:  # noqa: ANN003
    base = dict(m=4096, n=2304, k=768, batch=1, a=0x100000, b=0x200000, c=0x300010, lda=768, ldb=768, ldc=2304,
                stride_a=0, stride_b=0, stride_c=4096 * 2304, trans_a=False, trans_b=True, dtype="f16",
                compute="f32", epilogue="bias", bias=0x400000)
    base.update(kw)
    return GemmCall(**base)


class _Handle:
    class workspace:  # noqa: N801
        class data:  # noqa: N801
            ptr = 0x900000

    def lt(self) -> int:
        return 7


def test_lt_matmul_keeps_the_candidates_and_switches_in_place(monkeypatch) -> None:  # noqa: ANN001
    fake = _FakeLt(algos=5)
    monkeypatch.setattr(cublaslt, "_lib", lambda: fake)
    lt = cublaslt.LtMatmul(_call(), 7, 0x900000, 1 << 20)
    assert fake.asked == cublaslt.MAX_ALGOS and len(lt.candidates) == 5
    assert lt.algo_index == 0 and lt.algo.data[0] == 42
    lt.use(3)
    assert lt.algo_index == 3 and lt.algo.data[0] == 45
    lt(0xABC)  # the prepared arguments point at the struct use() rewrote
    assert fake.calls[-1][12]._obj.data[0] == 45 and fake.calls[-1][10].value == 0x300010
    assert lt.enqueue(0xABC, 1, 0x777010) == 0
    args = fake.calls[-1]
    assert args[10].value == 0x777010 and args[12]._obj.data[0] == 43 and args[8].value == 0x300010
    assert lt.algo.data[0] == 45  # timing another candidate leaves the chosen one
    assert lt_pick.d_extent_bytes(lt.call) == 4096 * 2304 * 2


def test_prepare_picks_caches_and_switches_off(monkeypatch) -> None:  # noqa: ANN001
    fake = _FakeLt(algos=4)
    monkeypatch.setattr(cublaslt, "_lib", lambda: fake)
    monkeypatch.setattr(lt_pick, "_CACHE", {})
    monkeypatch.setattr(lt_pick, "_device_id", lambda: 0)
    timed: list[int] = []

    def fake_gpu_timer(lt):  # noqa: ANN001, ANN202
        def timer(i: int) -> float:
            timed.append(i)
            return [0.055, 0.049, 0.047, 0.047][i]
        return timer, lambda: None

    monkeypatch.setattr(lt_pick, "gpu_timer", fake_gpu_timer)
    monkeypatch.setenv("FUSEC_LT_PICK", "1")
    call = _call()
    lt = lt_pick.prepare(call, _Handle())
    assert call._lt is lt and lt.algo_index == 2 and lt.algo.data[0] == 44 and timed == [0, 1, 2, 3] * 2
    twin = _call()  # another plan, the same signature: the cached pick, nothing timed
    assert lt_pick.prepare(twin, _Handle()).algo_index == 2 and len(timed) == 8
    moved = _call(c=0x300008)  # D only 8-byte aligned: another signature, timed again
    assert lt_pick.prepare(moved, _Handle()).algo_index == 2 and len(timed) == 16
    (p,) = [x for x in lt_pick.picks() if x["index"] == 2][:1]
    assert (p["m"], p["n"], p["k"], p["epilogue"], p["count"]) == (4096, 2304, 768, "bias", 4)
    monkeypatch.setenv("FUSEC_LT_PICK", "0")
    off = lt_pick.prepare(_call(m=128), _Handle())
    assert off.algo_index == 0 and off.algo.data[0] == 42 and len(timed) == 16 and not off.pick["timed"]


def test_signature_depends_on_shape_epilogue_and_alignment(monkeypatch) -> None:  # noqa: ANN001
    fake = _FakeLt(algos=3)
    monkeypatch.setattr(cublaslt, "_lib", lambda: fake)

    def sig(**kw) -> tuple:  # noqa: ANN003
        return lt_pick.signature(cublaslt.LtMatmul(_call(**kw), 7, 0, 1 << 20), 0)

    base = sig()
    assert sig() == base
    assert sig(k=3072) != base and sig(epilogue="gelu_bias") != base and sig(b=0x200002) != base
    assert sig(compute="tf32", dtype="f32") != base and sig(c=0x300110) == base  # 16-byte aligned either way


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_tiny_gpt2_fp16_lt_plan_matches_reference_with_pick_on_and_off(monkeypatch) -> None:  # noqa: ANN001
    pytest.importorskip("cupy")
    import fusec
    from fusec import reference
    from fusec.ab.decide import TOLERANCE, rel_error
    from fusec.ab.runner import GpuRunner
    from fusec.inputs import random_inputs_for
    from fusec.loader import load_graph

    model, shapes = "gpt2-tiny", {"input_ids": (2, 16), "attention_mask": (2, 16)}
    runner = GpuRunner()
    outs = {}
    monkeypatch.setenv("FUSEC_GEMM_STREAM", "0")  # 32 rows: sm_90 would put every product on the stream form
    for flag in ("1", "0"):
        monkeypatch.setenv("FUSEC_LT_PICK", flag)
        plan = fusec.compile(model, shapes=shapes, dtype="fp16", cuda_graph=True)  # picked at load, then captured
        lts = [L for L in plan.manifest["launches"] if L["type"] == "gemm" and "epilogue" in L]
        assert lts, "the tiny GPT-2 plan has no cuBLASLt GEMM: nothing to test"
        inputs = random_inputs_for(plan.manifest["inputs"], 3)
        outs[flag] = runner.outputs(plan, inputs)  # the graph replay
        algos = [p["algo"] for p in plan.profile(inputs, repeats=1) if "algo" in p]
        assert len(algos) == len(lts), algos
        if flag == "0":
            assert all(a.startswith("algo 0/") for a in algos), algos
        want = {k: np.asarray(v, dtype=np.float32) for k, v in reference.run(load_graph(model, shapes), inputs).items()}
        err = rel_error(outs[flag], want)
        assert err <= TOLERANCE["fp16"] * 5, f"FUSEC_LT_PICK={flag}: rel error {err} against the fp32 reference"
    assert rel_error(outs["1"], outs["0"]) <= TOLERANCE["fp16"] * 5
    assert any(p["times_ms"] for p in lt_pick.picks())  # the pick-on plan timed its signatures


@pytest.mark.gpu
def test_pick_writes_no_plan_buffer_and_the_pick_computes_the_product(monkeypatch) -> None:  # noqa: ANN001
    """Timing writes a scratch D: the real D, the residual and the operands keep their bytes; the
    chosen algorithm then computes what the heuristic's first computes."""
    cp = pytest.importorskip("cupy")
    from fusec.runtime.cublas import Handle

    monkeypatch.setattr(lt_pick, "_CACHE", {})
    monkeypatch.setenv("FUSEC_LT_PICK", "1")
    m, n, k = 512, 768, 256
    rng = cp.random.default_rng(0)
    a, b = (rng.standard_normal(s, dtype=cp.float32).astype(cp.float16) for s in (m * k, n * k))
    bias, res = (rng.standard_normal(s, dtype=cp.float32).astype(cp.float16) for s in (n, m * n))
    d = cp.full(m * n, 7.0, dtype=cp.float16)
    before = [x.copy() for x in (a, b, bias, res, d)]
    handle = Handle()
    kw = dict(m=m, n=n, k=k, batch=1, a=a.data.ptr, b=b.data.ptr, c=d.data.ptr, lda=k, ldb=k, ldc=n, stride_a=0,
              stride_b=0, stride_c=m * n, trans_a=False, trans_b=True, dtype="f16", compute="f32", beta=1.0,
              epilogue="bias", bias=bias.data.ptr, c_in=res.data.ptr)
    call = GemmCall(**kw)
    lt = lt_pick.prepare(call, handle)
    cp.cuda.Device().synchronize()
    for x, y in zip((a, b, bias, res, d), before):
        assert bool((x == y).all()), "the pick wrote a plan buffer"
    assert lt.pick["timed"] == (len(lt.candidates) > 1)
    stream = cp.cuda.Stream(non_blocking=True)
    call(handle, stream.ptr)
    stream.synchronize()
    want = (a.reshape(m, k).astype(cp.float32) @ b.reshape(n, k).astype(cp.float32).T
            + bias.astype(cp.float32) + res.reshape(m, n).astype(cp.float32))
    got = d.reshape(m, n).astype(cp.float32)
    assert float(cp.linalg.norm(got - want) / cp.linalg.norm(want)) < 2e-3
    handle.close()
