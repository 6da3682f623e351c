"""The parallel NVRTC compile (fusec.codegen.compile): a lowering that fails, or is interrupted,
while kernels are still queued must not leave them to compile (the interpreter joins the pool's
threads at exit, so Ctrl-C or an error would wait for every queued NVRTC run); a compile shared
in flight with another caller is not cancelled under it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from fusec.codegen import compile as CC
from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value
from fusec.ops import NoAttrs, Op

SRC = 'extern "C" __global__ void fc_rr_k(float* x) { x[threadIdx.x] = %s; }'


@pytest.fixture()
def slow_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """One NVRTC thread whose compiles wait for ``release``; records the sources it compiled."""
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSEC_COMPILE_THREADS", "1")
    monkeypatch.setattr(CC, "_POOL", None)
    CC.clear_memory_cache()
    release, started, ran = threading.Event(), threading.Event(), []
    real = CC._nvrtc

    def waiting(source: str, kernel: str, options: tuple[str, ...]) -> tuple[bytes, str]:
        started.set()
        assert release.wait(60)
        ran.append(source)
        return real(source, kernel, options)

    monkeypatch.setattr(CC, "_nvrtc", waiting)
    yield release, started, ran
    release.set()


def _graph() -> Graph:
    x = Value("x", (4,), DType.F32)
    y = Value("y", (4,), DType.F32)
    return Graph([x], [y], [Node(Op.RELU, [x], [y], NoAttrs())], [])


@pytest.mark.parametrize("interrupt", [False, True])
def test_a_failed_lowering_cancels_its_queued_compiles(interrupt: bool, slow_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec.codegen.copyspecs import CopySpec
    from fusec.lower import LoweringError, Raw, lower

    release, started, ran = slow_pool
    futures = []
    import fusec.codegen.kernels as K

    real_build = K.build_async

    def spy(spec, arch=None):
        pk = real_build(spec, arch)
        futures.append(pk.future)
        return pk

    monkeypatch.setattr(K, "build_async", spy)

    def failing(ctx, node, label):
        for n in (100, 101, 101, 102, 103):  # 101 twice: one compile, shared
            ctx.kernel(CopySpec(DType.F32, (n,), (1,), (1,)), [Raw("arena", 0), Raw("arena", 4096)], f"{label} {n}")
        raise KeyboardInterrupt if interrupt else LoweringError(f"{label}: boom")

    monkeypatch.setattr("fusec.lower.nodes.lower_node", failing)
    with pytest.raises(KeyboardInterrupt if interrupt else LoweringError):  # Ctrl-C while lowering, or an error
        lower(_graph(), {"x": 0, "y": 256}, "sm_90")
    assert started.wait(60)
    release.set()
    for f in futures:
        try:
            f.result(timeout=120)
        except Exception:  # noqa: BLE001 -- CancelledError for the queued ones
            pass
    # the one already running finishes; the three queued behind it never start
    assert len(ran) == 1 and len({id(f) for f in futures if f.cancelled()}) == 3


def test_cancelling_spares_a_compile_another_caller_waits_for(slow_pool) -> None:
    release, started, ran = slow_pool
    first = CC.compile_cuda_async(SRC % "1.0f", "fc_rr_k", "sm_90")  # runs (and blocks the one thread)
    mine = CC.compile_cuda_async(SRC % "2.0f", "fc_rr_k", "sm_90")  # queued
    theirs = CC.compile_cuda_async(SRC % "2.0f", "fc_rr_k", "sm_90")  # the same, shared in flight
    alone = CC.compile_cuda_async(SRC % "3.0f", "fc_rr_k", "sm_90")  # queued, nobody else waits
    assert mine is theirs
    CC.abandon([mine, alone])
    release.set()
    assert first.result(timeout=120).cubin[:4] == b"\x7fELF"
    assert theirs.result(timeout=120).cubin[:4] == b"\x7fELF" and alone.cancelled()
    # an abandoned compile is not remembered: asking again compiles it
    again = CC.compile_cuda_async(SRC % "3.0f", "fc_rr_k", "sm_90")
    assert again is not alone and again.result(timeout=120).cubin[:4] == b"\x7fELF"


def test_ctrl_c_at_the_command_line_cancels_every_queued_compile(slow_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiles nobody abandoned (a caller that was not unwinding when Ctrl-C came) are cancelled by
    the command line's handler too: only the one already running completes."""
    import fusec.cli as cli

    release, started, ran = slow_pool
    futures = []

    def command(argv):
        futures.extend(CC.compile_cuda_async(SRC % f"{v}.0f", "fc_rr_k", "sm_90") for v in (4, 5, 6))
        assert started.wait(60)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", command)
    assert cli.main(["compile", "x"]) == cli.EXIT_INTERRUPTED
    release.set()
    assert futures[0].result(timeout=120).cubin[:4] == b"\x7fELF"
    assert [f.cancelled() for f in futures] == [False, True, True] and len(ran) == 1
    assert CC.cancel_queued() == 0  # nothing left in flight


def test_a_plan_recompile_stops_at_the_first_module_that_fails(slow_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from fusec.errors import FusecError
    from fusec.plan import Plan

    release, started, ran = slow_pool
    waiting = CC._nvrtc

    def bad_first(source: str, kernel: str, options: tuple[str, ...]) -> tuple[bytes, str]:
        if "bad" in source:
            assert release.wait(60)
            raise CC.KernelCompileError(kernel, "error: bad", source)
        return waiting(source, kernel, options)

    monkeypatch.setattr(CC, "_nvrtc", bad_first)
    srcs = ["/* bad */" + SRC % "0.0f"] + [SRC % f"{v}.5f" for v in range(3)]
    fake = SimpleNamespace(_where="p.fplan", manifest={"modules": [
        {"id": f"m{i}", "entry": "fc_rr_k", "source": f"source/m{i}", "cubin": f"cubin/m{i}"} for i in range(4)]},
        _blobs={f"source/m{i}": s.encode() for i, s in enumerate(srcs)})
    threading.Timer(0.5, release.set).start()
    with pytest.raises(FusecError, match="module 'm0' .*does not compile for sm_90: NVRTC failed"):
        Plan._recompile(fake, "sm_90")
    last = SRC % "9.5f"  # queued behind whatever is left: when it is done, the pool is drained
    assert CC.compile_cuda_async(last, "fc_rr_k", "sm_90").result(timeout=120).cubin[:4] == b"\x7fELF"
    # the pool's thread may take the next module as m0 fails; the rest are never compiled
    assert len(ran) <= 2 and ran[-1] == last and fake.manifest.get("arch") is None


def _child_compile(src: str, q, release: threading.Event | None = None) -> None:  # runs in a forked process
    if release is not None:
        release.set()  # the child's copy: its own compile need not wait
    try:
        b = CC.compile_cuda_async(src, "fc_rr_k", "sm_90").result(timeout=120)
        q.put(("ok", CC._mac_key().hex(), b.cubin[:4].hex(), b.from_disk))
    except BaseException as e:  # noqa: BLE001
        q.put(("error", repr(e), "", False))


def test_processes_sharing_a_fresh_cache_agree_on_one_key_and_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing as mp

    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    CC.clear_memory_cache()
    src = SRC % "4.25f"
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child_compile, args=(src, q)) for _ in range(4)]
    for p in procs:
        p.start()
    got = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
    assert [g[0] for g in got] == ["ok"] * 4, got
    assert len({g[1] for g in got}) == 1 and {g[2] for g in got} == {"7f454c46"}
    # the entry they left is whole and signed with that key: this process loads it from disk
    b = CC.compile_cuda(src, "fc_rr_k", "sm_90")
    assert b.from_disk and CC._mac_key().hex() == got[0][1]
    names = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    assert names == sorted(["key", f"{b.key}.bin"])  # no temporary left behind


def test_a_child_forked_while_a_compile_is_in_flight_compiles_it_itself(slow_pool, tmp_path: Path) -> None:
    import multiprocessing as mp

    release, started, ran = slow_pool
    src = SRC % "5.25f"
    fut = CC.compile_cuda_async(src, "fc_rr_k", "sm_90")  # in flight in the parent (blocked)
    assert started.wait(60)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_compile, args=(src, q, release))
    p.start()
    try:
        got = q.get(timeout=180)  # the child's own pool (the parent's threads do not exist there)
    finally:
        release.set()
        p.join(60)
    assert got[0] == "ok" and got[2] == "7f454c46", got
    assert fut.result(timeout=120).cubin[:4] == b"\x7fELF"


def test_an_interrupted_compile_cuda_is_not_left_queued(slow_pool, monkeypatch: pytest.MonkeyPatch) -> None:
    release, started, ran = slow_pool
    first = CC.compile_cuda_async(SRC % "6.5f", "fc_rr_k", "sm_90")  # occupies the one thread
    assert started.wait(60)
    waited = []

    def interrupted(self, timeout=None):  # noqa: ANN001 -- Ctrl-C arrives while the caller waits
        waited.append(self)
        raise KeyboardInterrupt

    real_result = CC.Future.result
    monkeypatch.setattr(CC.Future, "result", interrupted)
    with pytest.raises(KeyboardInterrupt):
        CC.compile_cuda(SRC % "7.5f", "fc_rr_k", "sm_90")
    monkeypatch.setattr(CC.Future, "result", real_result)
    release.set()
    assert first.result(timeout=120).cubin[:4] == b"\x7fELF"
    assert len(waited) == 1 and waited[0].cancelled() and len(ran) == 1


@pytest.mark.parametrize("damage", ["short", "long", "symlink"])
def test_a_damaged_cache_key_is_one_error_naming_it(damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    root = tmp_path / "cache"
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(root))
    CC.clear_memory_cache()
    root.mkdir(mode=0o700)
    key = root / "key"
    if damage == "symlink":
        (tmp_path / "elsewhere").write_bytes(b"k" * 32)
        key.symlink_to(tmp_path / "elsewhere")
    else:
        fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"k" * (16 if damage == "short" else 40))
        os.close(fd)
    with pytest.raises(CC.KernelCacheError, match=f"kernel cache key '{key}'"):
        CC.compile_cuda(SRC % "8.25f", "fc_rr_k", "sm_90")
    assert not (root / "kernels").exists() or not any((root / "kernels").rglob("*.bin"))
