"""NVRTC compilation to CUBIN (no GPU needed), an in-process cache and an atomic on-disk cache.

The route is CuPy's thin NVRTC binding (``cupy_backends.cuda.libs.nvrtc``): NVRTC runs on any
machine with libnvrtc, and with a real ``sm_XX`` target it emits a CUBIN that a GPU machine later
loads with ``cupy.cuda.function.Module().load(cubin)``. Sources are self-contained (templates
inline their ``.cuh`` helpers and include no CUDA headers), so the cache key
sha256(source, options, arch, NVRTC version) determines the binary.

Disk entries live under ``$FUSEC_CACHE_DIR`` (default ``~/.cache/fusec``) as
``kernels/<key[:2]>/<key>.bin``: magic, HMAC-SHA256 of the body under the cache's own secret
``key`` file (0600, made on first use), body (log length, log, cubin). They are written to a temp
file in the same directory and ``os.replace``d, so a reader never sees half an entry; an entry
whose MAC does not match (corrupt, planted by someone without the key, or of an older format),
that is not a CUDA ELF cubin for the arch asked for, or that is not a private file of this user
is recompiled and rewritten, never loaded.

Cache entries become code in every plan compiled here, so the cache is trusted only when it is
private: a cache directory owned by another user or writable by others is refused
(``KernelCacheError``: fix its permissions or point ``FUSEC_CACHE_DIR`` elsewhere). A cache
directory that cannot be made or written (read-only, a missing parent that cannot be made, under
/proc) does not stop a compile: it goes on without the cache (or without writing to it) and says
so once per process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from fusec.codegen.kernel_cache import (  # noqa: F401 -- the cache's storage, re-exported
    _MAGIC, KernelCacheError, _decode, _encode, _entry_path, _mac_key, _read_private, _write_atomic, cache_dir,
    check_cache_dirs)
from fusec.errors import FusecError, InputError

_ARCH_RE = re.compile(r"^sm_[0-9]{2,3}[a-z]?$")
# The oldest arch fusec's kernels compile for: the templates use sm_80 instructions (cp.async in
# attention and GEMM tiles, fp16/bf16 tensor-core mma) whatever the dtype.
MIN_ARCH = 80


class KernelCompileError(FusecError):
    """NVRTC rejected a generated kernel; carries the kernel name and the NVRTC log."""

    def __init__(self, kernel: str, log: str, source: str):
        self.kernel = kernel
        self.log = log
        self.source = source
        super().__init__(f"NVRTC failed to compile kernel {kernel!r}:\n{log.strip()}")


@dataclass(frozen=True)
class Binary:
    cubin: bytes
    log: str  # ptxas -v output: registers, shared memory, spills
    key: str
    from_disk: bool = False

    @property
    def registers(self) -> int | None:
        m = re.search(r"Used (\d+) registers", self.log)
        return int(m.group(1)) if m else None

    @property
    def spill_bytes(self) -> int:
        return sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", self.log))

    @property
    def static_smem(self) -> int:
        m = re.search(r"(\d+) bytes smem", self.log)
        return int(m.group(1)) if m else 0


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc

    major, minor = nvrtc.getVersion()
    return int(major), int(minor)


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    """The ``sm_XX`` numbers this NVRTC compiles for (``nvrtcGetSupportedArchs``); () when unknown."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        return tuple(sorted(int(a) for a in nvrtc.getSupportedArchs()))
    except Exception:  # noqa: BLE001 -- no CuPy/NVRTC (compiling reports that) or an old binding
        return ()


def check_arch(arch: str, dtype: str | None = None) -> str:
    """``arch`` if fusec can compile for it with this NVRTC; else an InputError in one line saying
    which archs work (sm_80 and newer that NVRTC lists). Checked before any compiling starts;
    ``dtype`` only words the message (every dtype needs sm_80 today).

    ``sm_90a``-style targets are refused: fusec's kernels use no arch-specific instructions, and
    an ``a`` cubin runs only on that exact arch, so plain ``sm_90`` is the same code and more
    portable."""
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise InputError(f"--arch must look like sm_80 or sm_90, got {arch!r}")
    num = int(re.sub(r"[a-z]$", "", arch[3:]))
    if arch[-1].isalpha():
        raise InputError(f"--arch {arch}: arch-specific targets are not supported; fusec's kernels use no "
                         f"{arch}-only instructions, so use --arch sm_{num} (the same code, runs on every sm_{num} GPU)")
    if num < MIN_ARCH:
        raise InputError(f"--arch {arch} is too old: fusec's kernels need sm_{MIN_ARCH} or newer (fp16/bf16 "
                         f"tensor-core mma and cp.async, used for every --dtype{f', {dtype} included' if dtype else ''})")
    archs = supported_archs()
    if archs and num not in archs:
        try:
            ver = ".".join(map(str, nvrtc_version()))
        except Exception:  # noqa: BLE001
            ver = "?"
        raise InputError(f"--arch {arch}: this NVRTC ({ver}) compiles for "
                         f"{', '.join(f'sm_{a}' for a in archs if a >= MIN_ARCH)}")
    return arch


def default_arch() -> str:
    """The current GPU's ``sm_XX``, or ``sm_90`` on a machine without one."""
    from fusec.device import gpu_arch

    return gpu_arch() or "sm_90"


def cache_key(source: str, options: tuple[str, ...], arch: str) -> str:
    blob = json.dumps([source, list(options), arch, list(nvrtc_version())], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


_MEM: dict[str, Binary] = {}
_LOCK = threading.RLock()  # re-entrant for abandon()
# compiled: NVRTC runs; disk_hits/memory_hits: cache hits; inflight_hits: a compile of the same
# source already under way was shared; corrupt: disk entries refused and rewritten.
STATS = {"compiled": 0, "disk_hits": 0, "memory_hits": 0, "inflight_hits": 0, "corrupt": 0}


def _numbered(source: str) -> str:
    return "\n".join(f"{i:5d}  {line}" for i, line in enumerate(source.splitlines(), 1))


def _nvrtc(source: str, kernel: str, options: tuple[str, ...]) -> tuple[bytes, str]:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, f"{kernel}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            from fusec import knobs

            if knobs.get("FUSEC_DUMP_SOURCE_ON_ERROR"):
                dump = cache_dir() / "errors" / f"{kernel}.cu"
                dump.parent.mkdir(parents=True, exist_ok=True)
                dump.write_text(source)
                print(f"--- fusec: source of kernel {kernel} (also in {dump}) ---\n{_numbered(source)}\n"
                      f"--- NVRTC log ---\n{log}", file=sys.stderr)
            raise KernelCompileError(kernel, log, source) from None
        from fusec.plancheck import complete_cubin

        return complete_cubin(bytes(nvrtc.getCUBIN(prog))), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


def compile_cuda(source: str, kernel: str, arch: str | None = None, options: tuple[str, ...] = (),
                 use_disk: bool = True) -> Binary:
    """Compile ``source`` (defining ``extern "C"`` kernel ``kernel``) to a CUBIN for ``arch``.

    Identical (source, options, arch) compile once per process; the disk cache is consulted
    unless ``use_disk`` is false. Raises KernelCompileError with the NVRTC log on failure.
    """
    fut = compile_cuda_async(source, kernel, arch, options, use_disk)
    try:
        return fut.result()
    except BaseException:  # Ctrl-C while it waits: not compiled if it has not started (abandon)
        abandon([fut])
        raise


_SM90A = re.compile(r"\bwgmma\.mma_async\b")
WGMMA_ARCH = "sm_90"  # the only arch whose GPUs run sm_90a's wgmma (sm_100 and later do not have it)


def uses_sm90a(source: str) -> bool:
    """The source issues sm_90a-only instructions (wgmma: gemm_wgmma.jinja): the one test, for kernels built from
    specs and for a plan's bundled sources recompiled alike."""
    return _SM90A.search(source) is not None


def compile_cuda_async(source: str, kernel: str, arch: str | None = None, options: tuple[str, ...] = (),
                       use_disk: bool = True) -> Future[Binary]:
    """``compile_cuda`` on a thread pool: returns at once with a future of the Binary.

    NVRTC releases the GIL while it compiles, so distinct sources compile in parallel (up to
    ``compile_threads()`` at once). A source already compiled, or being compiled, in this process
    is not compiled again: its future is shared (``STATS["inflight_hits"]`` counts those). A caller
    with ``use_disk`` false never receives a Binary read from the disk cache, from memory or from a
    compile it shares: it shares only compiles that do not read the disk either. A source with sm_90a-only
    instructions (``uses_sm90a``: wgmma) compiles for sm_90a, and for no other arch (an InputError)."""
    from fusec import knobs

    arch = check_arch(arch or default_arch())
    target = arch
    if uses_sm90a(source):
        if arch != WGMMA_ARCH:
            raise InputError(f"kernel {kernel} uses sm_90a instructions (wgmma), which only sm_90 GPUs run, not {arch}")
        target = "sm_90a"  # the cubin runs on sm_90 GPUs only, which is what the kernel selection chose it for
    opts = (f"--gpu-architecture={target}", "-std=c++17", "-Xptxas=-v") + tuple(options)
    if knobs.get("FUSEC_LINEINFO"):  # source lines for Nsight Compute's stall sampling (another binary: another key)
        opts += ("-lineinfo",)
    if knobs.get("FUSEC_TRACE"):  # per-block timestamps (common.cuh FC_TRACE; benchmarks/block_trace.py)
        opts += ("-DFC_TRACE=1",)
    if knobs.get("FUSEC_PDL_PIN") == "value":  # common.cuh fc_pdl_wait_after (another binary: another key)
        opts += ("-DFC_PDL_PIN_VALUE=1",)
    key = cache_key(source, opts, arch)
    with _LOCK:
        hit = _MEM.get(key)
        if hit is not None and (use_disk or not hit.from_disk):
            STATS["memory_hits"] += 1
            done: Future[Binary] = Future()
            done.set_result(hit)
            return done
        flight = (key, use_disk)
        fut = _INFLIGHT.get(flight)
        if fut is not None:
            STATS["inflight_hits"] += 1
            _USERS[fut] = _USERS.get(fut, 0) + 1
            return fut
        fut = _executor().submit(_compile_uncached, source, kernel, arch, opts, key, use_disk)
        _INFLIGHT[flight] = fut
        _USERS[fut] = 1
    fut.add_done_callback(lambda f: _forget_inflight(flight, f))
    return fut


def abandon(futures: list[Future[Binary]]) -> None:
    """The caller no longer wants these compiles (its lowering failed or was interrupted): each one
    that has not started and that no other caller shares is cancelled, so that it does not run
    (the interpreter waits at exit for every queued task of the pool)."""
    with _LOCK:  # re-entrant: a cancel runs the done callback (_forget_inflight) at once, in this thread
        for fut in futures:
            n = _USERS.get(fut, 0) - 1
            if n > 0:
                _USERS[fut] = n
            else:
                _USERS.pop(fut, None)
                fut.cancel()  # False for one already running or done: it completes (and is cached)


def cancel_queued() -> int:
    """Cancel every compile of this process's pool that has not started (Ctrl-C at the command line:
    nobody will collect them). Returns how many were cancelled; running ones complete and are cached."""
    with _LOCK:
        cancelled = [fut for fut in list(_INFLIGHT.values()) if fut.cancel()]  # runs _forget_inflight (re-entrant)
        for fut in cancelled:
            _USERS.pop(fut, None)
    return len(cancelled)


def compile_threads() -> int:
    """NVRTC compiles run at once: ``$FUSEC_COMPILE_THREADS``, else the CPU count (at most 16)."""
    from fusec import knobs

    n = knobs.get("FUSEC_COMPILE_THREADS")
    return n if n > 0 else max(1, min(16, os.cpu_count() or 1))


_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_INFLIGHT: dict[tuple[str, bool], Future[Binary]] = {}  # (cache key, use_disk) -> the compile under way
_USERS: dict[Future[Binary], int] = {}  # callers given each in-flight future (abandon() cancels at 0)


def _executor() -> ThreadPoolExecutor:
    """The compile pool, sized by ``compile_threads()`` as it is now: a changed
    ``FUSEC_COMPILE_THREADS`` gets a new pool (the old one finishes what it was given)."""
    global _POOL, _POOL_SIZE
    n = compile_threads()
    if _POOL is None or n != _POOL_SIZE:  # called under _LOCK
        if _POOL is not None:
            _POOL.shutdown(wait=False)
        _POOL, _POOL_SIZE = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fusec-nvrtc"), n
    return _POOL


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's pool threads: it starts its own pool."""
    global _POOL, _LOCK
    _POOL, _LOCK = None, threading.RLock()
    _INFLIGHT.clear()
    _USERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _forget_inflight(flight: tuple[str, bool], fut: Future[Binary]) -> None:
    with _LOCK:  # the Binary is in _MEM by now (a failed or cancelled compile is retried by the next caller)
        if _INFLIGHT.get(flight) is fut:
            del _INFLIGHT[flight]
        _USERS.pop(fut, None)


# What this process found a cache directory unable to do: (directory, "read") (no key: nothing is
# read or written), (directory, "write") (entries are read, not written); each said once.
_DISK_OFF: set[tuple[str, str]] = set()


def _disk_off(what: str) -> bool:
    return (os.fspath(cache_dir()), what) in _DISK_OFF


def _cache_unusable(what: str, e: OSError) -> None:
    where = os.fspath(cache_dir())
    with _LOCK:
        if (where, what) in _DISK_OFF:
            return
        _DISK_OFF.add((where, what))
    how = "compiling without it" if what == "read" else "compiled kernels are not saved in it"
    print(f"fusec: warning: kernel cache {where!r} cannot be {'used' if what == 'read' else 'written'} "
          f"({e.strerror or e}): {how} (set FUSEC_CACHE_DIR to a writable directory)", file=sys.stderr)


def _compile_uncached(source: str, kernel: str, arch: str, opts: tuple[str, ...], key: str, use_disk: bool) -> Binary:
    """The disk cache's entry for ``key``, else NVRTC (then written to the disk cache)."""
    path = _entry_path(key)
    from fusec.plancheck import complete_cubin, cubin_arch

    want_arch = int(re.sub(r"[a-z]$", "", arch[3:]))
    mac_key = b""
    use_disk = use_disk and not _disk_off("read")
    if use_disk:
        check_cache_dirs(key)  # a cache others can write to stays an error (KernelCacheError)
        try:
            mac_key = _mac_key()  # made on first use: the directory is created then
        except OSError as e:
            _cache_unusable("read", e)
            use_disk = False
    if use_disk and path.exists():
        raw = _read_private(path)
        decoded = _decode(raw, mac_key, key) if raw is not None else None
        if decoded is not None and cubin_arch(decoded[0]) != want_arch:
            decoded = None  # a valid MAC over a cubin for another arch: never load it
        if decoded is not None:
            b = Binary(complete_cubin(decoded[0]), decoded[1], key, from_disk=True)  # entries written short before
            with _LOCK:
                STATS["disk_hits"] += 1
                _MEM[key] = b
            return b
        with _LOCK:
            STATS["corrupt"] += 1  # recompile below and overwrite the bad entry
    cubin, log = _nvrtc(source, kernel, opts)
    if cubin[:4] != b"\x7fELF" or cubin_arch(cubin) != want_arch:
        raise KernelCompileError(kernel, "NVRTC returned no ELF cubin\n" + log, source)
    b = Binary(cubin, log, key)
    if use_disk and not _disk_off("write"):
        try:
            _write_atomic(path, _encode(cubin, log, mac_key, key))
        except OSError as e:  # a read-only cache must not stop compilation
            _cache_unusable("write", e)
    with _LOCK:
        STATS["compiled"] += 1
        _MEM[key] = b
    return b


def clear_memory_cache() -> None:
    with _LOCK:
        _MEM.clear()
