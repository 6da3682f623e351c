"""Documented contracts of a plan (issue 11, item 7 and 8): one call at a time (a clear error from a
second thread), runs on different streams ordered, outputs are views overwritten by the next run,
out of memory at load is a MemoryError naming the bytes asked for and free, torch streams and
``__cuda_stream__`` objects accepted, ``plan.inputs``/``outputs`` and ``repr``.

The CPU tests drive the guard, the allocator and the stream conversion with real threads and
stand-in CUDA objects; the GPU tests (``-m gpu``) run the same contracts on a real plan."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import fusec
from fusec.errors import FusecError
from fusec.plan import TensorInfo, stream_handle
from fusec.runtime.guard import ConcurrentRunError, DeviceMemoryError, RunGuard, allocate, fmt_bytes, guarded


# ---- one call at a time ----------------------------------------------------------------------------

def test_a_second_thread_gets_a_clear_error_while_a_run_is_in_progress() -> None:
    guard = RunGuard()
    inside, release = threading.Event(), threading.Event()
    seen: list[object] = []

    def first() -> None:
        with guard.running():
            inside.set()
            release.wait(10)

    def second() -> None:
        try:
            with guard.running():
                seen.append("ran")
        except ConcurrentRunError as e:
            seen.append(e)

    t1 = threading.Thread(target=first, name="runner-1")
    t1.start()
    assert inside.wait(10)
    t2 = threading.Thread(target=second, name="runner-2")
    t2.start()
    t2.join(10)
    release.set()
    t1.join(10)
    (err,) = seen
    assert isinstance(err, ConcurrentRunError) and isinstance(err, FusecError)
    msg = str(err)
    assert "\n" not in msg and "'runner-2'" in msg and "'runner-1'" in msg and "one call at a time" in msg
    with guard.running():  # free again once the first run is over
        pass


def test_guarded_run_methods_share_the_device_guard_across_threads() -> None:
    """``Executor.run`` is decorated with ``guarded``: every executor of one device (entries,
    with_cuda_graph copies) shares its guard; calls from many threads either run alone or fail."""

    class Device:
        guard = RunGuard()

    class FakeExecutor:
        def __init__(self, device):
            self.device = device
            self.active = 0
            self.max_active = 0

        @guarded
        def run(self, value):
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            threading.Event().wait(0.002)  # long enough for the others to try
            self.active -= 1
            return value

    dev = Device()
    a, b = FakeExecutor(dev), FakeExecutor(dev)
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(ex, i):
        for _ in range(30):
            try:
                assert ex.run(i) == i
                tag = "ran"
            except ConcurrentRunError:
                tag = "refused"
            with lock:
                outcomes.append(tag)

    threads = [threading.Thread(target=worker, args=((a, b)[i % 2], i)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(outcomes) == 120 and "ran" in outcomes and "refused" in outcomes
    assert a.max_active + b.max_active <= 2 and max(a.max_active, b.max_active) == 1


def test_a_run_on_another_stream_waits_for_the_previous_one() -> None:
    log: list[tuple] = []

    class Event:
        def record(self, stream):
            log.append(("record", stream.ptr))

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def wait_event(self, ev):
            log.append(("wait", self.ptr))

    g = RunGuard()
    s1, s2 = Stream(1), Stream(2)
    assert g.follow(s1, Event) is False  # first run: nothing to wait for
    assert g.follow(s1, Event) is False  # same stream: already ordered
    assert g.follow(Stream(1), Event) is False  # another object for the same stream
    assert g.follow(s2, Event) is True
    assert log == [("record", 1), ("wait", 2)]


# ---- out of memory -----------------------------------------------------------------------------------

class _FakeCupy:
    """Just enough of CuPy for ``allocate``: ``fail`` allocations raise OutOfMemoryError."""

    uint8 = np.uint8

    def __init__(self, fail: int, free: int = 5 * 2**30, total: int = 80 * 2**30):
        self.fail, self.freed = fail, 0
        oom = type("OutOfMemoryError", (Exception,), {})
        outer = self

        class Pool:
            def free_all_blocks(self):
                outer.freed += 1

        self.cuda = type("cuda", (), {"memory": type("m", (), {"OutOfMemoryError": oom}),
                                      "runtime": type("r", (), {"memGetInfo": staticmethod(lambda: (free, total))})})
        self._pool = Pool()

    def get_default_memory_pool(self):
        return self._pool

    def empty(self, n, dtype):
        if self.fail:
            self.fail -= 1
            raise self.cuda.memory.OutOfMemoryError("out of memory")
        return np.empty(n, dtype)

    zeros = empty


def test_out_of_memory_names_what_was_asked_and_what_is_free() -> None:
    cp = _FakeCupy(fail=2)
    asked = 2**40 + 12345
    with pytest.raises(MemoryError) as ei:
        allocate(cp, "arena", asked)
    err = ei.value
    assert isinstance(err, DeviceMemoryError) and isinstance(err, FusecError)
    msg = str(err)
    assert "arena" in msg and f"{asked:,} bytes" in msg and f"{5 * 2**30:,} bytes" in msg and "\n" not in msg
    assert "1.00 TiB" in msg and "5.00 GiB" in msg and "80.0 GiB" in msg
    assert cp.freed == 1  # CuPy's cached blocks were returned before giving up


def test_out_of_memory_retries_after_freeing_cached_blocks() -> None:
    cp = _FakeCupy(fail=1)
    assert allocate(cp, "weights", 1000).nbytes == 1000 and cp.freed == 1
    assert allocate(_FakeCupy(fail=0), "state", 0).nbytes == 1  # an empty region is one byte, never zero


def test_byte_counts_read_as_people_write_them() -> None:
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 45312, 41_814_016, 1_192_198_144, 3 * 2**40)] == \
        ["0 B", "1023 B", "1.00 KiB", "44.2 KiB", "39.9 MiB", "1.11 GiB", "3.00 TiB"]


# ---- streams from other libraries ----------------------------------------------------------------------

def test_streams_are_taken_from_torch_cupy_and_the_stream_protocol() -> None:
    class TorchLike:  # torch.cuda.Stream: the handle in .cuda_stream
        cuda_stream = 0x1234

    class Protocol:  # the CUDA stream protocol: (version, handle)
        def __cuda_stream__(self):
            return (0, 0x5678)

    class CupyLike:
        ptr = 0x9ABC

    assert stream_handle(None) is None
    assert stream_handle(TorchLike()) == 0x1234
    assert stream_handle(Protocol()) == 0x5678
    assert stream_handle(CupyLike()) == 0x9ABC
    assert stream_handle(7) == 7
    for bad in ("stream", True, object()):
        with pytest.raises(FusecError, match="stream"):
            stream_handle(bad)

    class BadProtocol:
        def __cuda_stream__(self):
            return "not a tuple"

    with pytest.raises(FusecError, match="__cuda_stream__"):
        stream_handle(BadProtocol())


# ---- what a plan says about itself ------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan():
    return fusec.compile("gpt2-tiny", dtype="fp16", shapes={"input_ids": (2, 8), "attention_mask": (2, 8)})


def test_inputs_and_outputs_are_records_like_onnxruntime(plan) -> None:
    assert plan.inputs == [TensorInfo("input_ids", (2, 8), "i64"), TensorInfo("attention_mask", (2, 8), "i64")]
    assert plan.outputs == [TensorInfo("logits", (2, 8, 1000), "f16")]
    assert plan.outputs[0].np_dtype == np.float16
    assert plan.get_inputs("main") == plan.inputs
    with pytest.raises(FusecError, match="no entry point 'decode'"):
        plan.get_outputs("decode")


def test_generation_plans_list_inputs_per_entry() -> None:
    from fusec.compiler import compile_generation

    gen = compile_generation("llama-tiny", batch=2, max_seq_len=16)
    assert gen.get_inputs("prefill")[0].name == "input_ids" and gen.get_inputs("prefill")[0].shape[0] == 2
    assert gen.inputs == gen.get_inputs("prefill")
    assert "prefill:" in repr(gen) and "decode:" in repr(gen)


def test_repr_says_what_the_plan_is(plan) -> None:
    text = repr(plan)
    m = plan.manifest
    assert text.startswith(f"<fusec.Plan 'gpt2-tiny' {plan.arch} fp16 ") and text.endswith(">") and "\n" not in text
    assert "input_ids i64[2, 8]" in text and "-> logits f16[2, 8, 1000]" in text
    assert f"{len(m['kernels'])} kernels, {len(m['launches'])} launches" in text
    assert f"weights {fmt_bytes(m['memory']['weights_bytes'])}" in text


def test_the_contracts_are_written_where_users_look() -> None:
    """README and the Plan docstring say a plan is executable code, one call at a time, outputs are
    views, out of memory is a MemoryError (the words users search for, not internals)."""
    from pathlib import Path

    import fusec.plan

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for text in (readme, fusec.plan.__doc__):
        flat = " ".join(text.split())
        for needle in ("executable", "one call at a time", "views", "MemoryError"):
            assert needle in flat, needle


# ---- on a GPU -------------------------------------------------------------------------------------------

def _inputs(seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, 1000, (2, 8)).astype(np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((2, 8), np.int64)}


@pytest.mark.gpu
def test_gpu_out_of_memory_at_load_is_a_memory_error(monkeypatch, plan) -> None:
    import cupy

    from fusec.plan import Plan

    monkeypatch.setenv("FUSEC_MAX_BYTES", str(2**46))
    free, _ = cupy.cuda.runtime.memGetInfo()
    m = dict(plan.manifest)
    m["memory"] = dict(m["memory"], arena_bytes=int(free) * 4)  # more than the GPU has
    huge = Plan(m, plan.blobs())
    with pytest.raises(MemoryError) as ei:
        huge.run(_inputs(0))
    msg = str(ei.value)
    assert isinstance(ei.value, FusecError) and "arena" in msg and f"{int(free) * 4:,} bytes" in msg and "free" in msg
    out = plan.run(_inputs(0))["logits"]  # the GPU is usable afterwards
    assert out.shape == (2, 8, 1000)


@pytest.mark.gpu
def test_gpu_concurrent_runs_from_two_threads_are_refused_or_serialized(plan) -> None:
    import cupy

    plan.run(_inputs(0))
    cupy.cuda.Device().synchronize()
    results: list[str] = []
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        stream = cupy.cuda.Stream(non_blocking=True)
        for i in range(50):
            try:
                plan.run(_inputs(seed + i), stream=stream)
                results.append("ran")
            except ConcurrentRunError:
                results.append("refused")
            except BaseException as e:  # anything else is a bug
                errors.append(e)
        stream.synchronize()

    threads = [threading.Thread(target=worker, args=(100 * k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 100 and "ran" in results
    # held from another thread: refused at once, nothing enqueued
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with plan.device().guard.running():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(10)
    try:
        with pytest.raises(ConcurrentRunError, match="one call at a time"):
            plan.run(_inputs(0))
    finally:
        release.set()
        t.join(10)
    # and the plan still computes the right thing
    from fusec import reference
    from fusec.loader import load_graph

    graph = load_graph("gpt2-tiny", {"input_ids": (2, 8), "attention_mask": (2, 8)})
    want = reference.run(graph, _inputs(7))["logits"]
    got = cupy.asnumpy(plan.run(_inputs(7))["logits"]).astype(np.float32)
    np.testing.assert_allclose(got, want, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_outputs_are_views_overwritten_by_the_next_run(plan) -> None:
    import cupy

    first = plan.run(_inputs(1))["logits"]
    kept = first.copy()
    second = plan.run(_inputs(2))["logits"]
    cupy.cuda.get_current_stream().synchronize()
    assert first.data.ptr == second.data.ptr  # the same arena slot
    assert not cupy.array_equal(kept, second)  # different inputs, different logits
    assert cupy.array_equal(first, second)  # the first result was overwritten
    again = plan.run(_inputs(1))["logits"]
    assert cupy.array_equal(again, kept)


@pytest.mark.gpu
def test_gpu_torch_streams_and_the_stream_protocol_are_accepted(plan) -> None:
    import cupy
    import torch

    want = cupy.asnumpy(plan.run(_inputs(3))["logits"])
    ts = torch.cuda.Stream()
    out = plan.run(_inputs(3), stream=ts)["logits"]
    ts.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), want)

    class Protocol:
        def __init__(self, s):
            self.s = s

        def __cuda_stream__(self):
            return (0, self.s.cuda_stream)

    ts2 = torch.cuda.Stream()
    out = plan.run(_inputs(3), stream=Protocol(ts2))["logits"]
    ts2.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(out), want)
