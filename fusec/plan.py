"""The user-facing ``Plan``: a compiled model (manifest + weights + kernel sources and binaries).

A ``Plan`` needs no GPU to exist, be saved, loaded or inspected (``fusec compile`` cross-compiles
on machines without one). The device state (arena, uploaded weights, loaded modules, CUDA graph)
is created by ``fusec.runtime.Executor`` on the first ``run``.

``Plan.load(path)`` maps the file (``fusec.planfile``) and checks its manifest and kernels before
any code is loaded; the weights' checksum is checked when they are first used (uploaded, saved),
so loading or inspecting a plan never reads its weights. A plan compiled for another GPU
architecture is refused with an error naming the ``arch`` field, or recompiled from its bundled
sources with ``recompile=True``; the CUDA toolchain it was compiled with is checked against this
machine's driver (``fusec.planenv``).

Contracts:

- **A plan is an executable artifact.** Its cubins run on the GPU with the rights of the process
  that loads it (as a TensorRT engine does); ``recompile=True`` compiles its bundled sources. The
  checks prove the file is whole and well-formed, not who wrote it: load plans only from trusted
  sources.
- **Threads and streams.** One plan (with every ``with_cuda_graph`` copy and entry point: they
  share one arena) runs one call at a time: a ``run`` from a second thread while one is in
  progress raises ``ConcurrentRunError`` (a ``FusecError``); serialize the calls, or load the plan
  once per thread. Consecutive runs on different streams are ordered on the GPU (the new stream
  waits for the previous one), never overlapped. (``Executor.replay``, a benchmark's bare graph
  replay, bypasses both: its caller orders it.)
- **Outputs are views** of the plan's arena: valid until the next run of the plan, which
  overwrites them. Copy what you keep (``arr.copy()``), or pass ``outputs=`` arrays to fill.
- **Out of memory** while the plan's device memory is made (first run) raises ``MemoryError``
  (``DeviceMemoryError``, also a ``FusecError``) naming the bytes asked for and free.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from fusec import __version__
from fusec.errors import FusecError
from fusec.planenv import PlanArchError
from fusec.planfile import PlanBlobs, PlanFileError, read_plan, write_plan
from fusec.runtime.guard import ConcurrentRunError, DeviceMemoryError, RunGuard, fmt_bytes

__all__ = ["ConcurrentRunError", "DeviceMemoryError", "Plan", "PlanArchError", "PlanFileError", "TensorInfo",
           "entry_points", "stream_handle"]

_REQUIRED = ("fusec_version", "arch", "dtype", "memory", "modules", "kernels")
_ENTRY = ("inputs", "outputs", "launches")  # per entry point: at the top level, or under "entries"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One input or output of a plan (like onnxruntime's ``get_inputs()`` records): ``name``,
    ``shape`` (static), ``dtype`` (fusec's name: f32, f16, bf16, i64, i32, bool) and ``np_dtype``
    (what to feed: bf16 is fed as ml_dtypes.bfloat16 or its uint16 bits)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def np_dtype(self) -> Any:
        from fusec.dtypes import DType

        return DType(self.dtype).np


class Plan:
    """A compiled model: ``run`` it, ``save`` it, ``inspect`` it (``info``); see the module
    docstring for the contracts (executable artifact, threads, outputs, out of memory)."""

    def __init__(self, manifest: Mapping[str, Any], blobs: Mapping[str, bytes | memoryview], cuda_graph: bool = False,
                 _device: Any = None, _guard: RunGuard | None = None, _where: str = "<in memory>"):
        self.manifest = dict(manifest)
        # a mapped file's parts stay lazy (each checked on first use); in-memory parts are copied by name
        self._blobs = blobs if isinstance(blobs, PlanBlobs) else dict(blobs)
        self.cuda_graph = bool(cuda_graph or self.manifest.get("cuda_graph", False))
        self._executors: dict[str, Any] = {}
        self._device = _device  # fusec.runtime.plan_device.Device: weights, state, kernels; shared by copies
        self._guard = _guard if _guard is not None else RunGuard()  # one call at a time, shared by copies
        self._last: Any = None
        self._where = _where
        _validate_manifest(self.manifest, self._blobs, _where)

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to one ``.fplan`` file, atomically (parts of a loaded plan are checked
        as they are written, then streamed from the mapping: nothing is copied in memory)."""
        parts = {k: self._blobs[k] for k in self._blobs}  # each checked on first use
        known = self._blobs.checked_digests() if isinstance(self._blobs, PlanBlobs) else None
        write_plan(path, self.manifest, parts, digests=known)  # a checked part is not hashed twice

    @classmethod
    def load(cls, path: str | os.PathLike, recompile: bool = False, cuda_graph: bool | None = None,
             verify: str = "lazy") -> Plan:
        """Map and check ``path``. ``recompile``: rebuild the kernels for this GPU's arch from the
        bundled sources. ``verify``: "lazy" checks the weights' checksum when they are first used
        (uploaded, saved), "all" checks every part now. On a GPU, the arch and the recorded
        toolchain are checked (``fusec.planenv.check``: refused or warned, naming the field)."""
        plan = cls.open(path, cuda_graph=cuda_graph, verify=verify)
        gpu_arch = _current_arch()
        if gpu_arch is not None:
            from fusec.planenv import check

            check(plan.manifest, str(path), gpu_arch, arch_ok=recompile)
            if gpu_arch != plan.arch:
                plan._recompile(gpu_arch)
        return plan

    @classmethod
    def open(cls, path: str | os.PathLike, cuda_graph: bool | None = None, verify: str = "lazy") -> Plan:
        """Map and check ``path`` without looking at the GPU (``inspect``, re-targeting)."""
        pf = read_plan(path, verify=verify)
        graph = bool(pf.manifest.get("cuda_graph")) if cuda_graph is None else cuda_graph
        return cls(pf.manifest, PlanBlobs(pf), cuda_graph=graph, _where=os.fspath(path))

    def _recompile(self, arch: str) -> None:
        """Rebuild every module's cubin for ``arch`` from its bundled source (the launch list, the
        memory plan and the weights do not depend on the arch); records this machine's toolchain."""
        from fusec.codegen.compile import abandon, compile_cuda_async
        from fusec.planenv import toolchain

        def failed(m: dict[str, Any], e: FusecError) -> FusecError:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return FusecError(f"{self._where}: module {m['id']!r} ({m['entry']}) does not compile for {arch}: {first}")

        pending = []  # every module starts compiling at once (NVRTC runs on a thread pool)
        cubins = {}
        try:
            for m in self.manifest["modules"]:
                src = bytes(self._blobs[m["source"]]).decode("utf-8")
                try:
                    pending.append((m, compile_cuda_async(src, m["entry"], arch)))
                except FusecError as e:
                    raise failed(m, e) from None
            for m, fut in pending:
                try:
                    cubins[m["cubin"]] = fut.result().cubin
                except FusecError as e:
                    raise failed(m, e) from None
        except BaseException:  # the first failure (or Ctrl-C): the modules still queued are not compiled
            abandon([fut for _, fut in pending])
            raise
        self._blobs.update(cubins)
        self.manifest["arch"] = arch
        self.manifest.update(toolchain())
        _validate_manifest(self.manifest, self._blobs, self._where)

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return str(self.manifest["arch"])

    @property
    def dtype(self) -> str:
        return str(self.manifest["dtype"])

    def blob(self, name: str) -> bytes | memoryview:
        from fusec.planfile import Chunks

        data = self._blobs[name]
        if isinstance(data, Chunks):  # a compiled plan's weights, joined on first use (saving needs no join)
            data = self._blobs[name] = bytes(data)
        return data

    def blobs(self) -> dict[str, bytes | memoryview]:
        """Every part of the plan by name (weights, kernel sources, cubins)."""
        return {name: self.blob(name) for name in self._blobs}

    def with_cuda_graph(self, cuda_graph: bool) -> Plan:
        """The same compiled plan, run with or without CUDA-graph replay; it shares this plan's
        device memory (weights uploaded once, the same state and arena) and its one-call-at-a-time
        guard."""
        return Plan(self.manifest, self._blobs, cuda_graph=cuda_graph, _device=self._device, _guard=self._guard,
                    _where=self._where)

    @property
    def entries(self) -> list[str]:
        """The plan's entry points ("main" for a one-entry plan; "prefill", "decode" for generation)."""
        return list(entry_points(self.manifest))

    def get_inputs(self, entry: str | None = None) -> list[TensorInfo]:
        """The inputs of ``entry`` (default: the first) as (name, shape, dtype) records."""
        return [_info(d) for d in self._entry(entry)["inputs"]]

    def get_outputs(self, entry: str | None = None) -> list[TensorInfo]:
        """The outputs of ``entry`` (default: the first) as (name, shape, dtype) records."""
        return [_info(d) for d in self._entry(entry)["outputs"]]

    @property
    def inputs(self) -> list[TensorInfo]:
        """The first entry point's inputs (``get_inputs(entry)`` for another)."""
        return self.get_inputs()

    @property
    def outputs(self) -> list[TensorInfo]:
        """The first entry point's outputs (``get_outputs(entry)`` for another)."""
        return self.get_outputs()

    def _entry(self, entry: str | None) -> dict[str, Any]:
        ents = entry_points(self.manifest)
        name = entry or next(iter(ents))
        if name not in ents:
            raise FusecError(f"the plan has no entry point {name!r} (entries: {', '.join(map(repr, ents))})")
        return ents[name]

    def __repr__(self) -> str:
        m = self.manifest
        src = m.get("source", {}).get("model") or m.get("model")
        sig = "; ".join(f"{e}: " + ", ".join(f"{d['name']} {d['dtype']}{list(d['shape'])}" for d in ent["inputs"])
                        + " -> " + ", ".join(f"{d['name']} {d['dtype']}{list(d['shape'])}" for d in ent["outputs"])
                        for e, ent in entry_points(m).items())
        launches = sum(len(e["launches"]) for e in entry_points(m).values())
        return (f"<fusec.Plan {src!r} {m['arch']} {m['dtype']} {sig}; {len(m['kernels'])} kernels, "
                f"{launches} launches, weights {fmt_bytes(m['memory'].get('weights_bytes', 0))}, "
                f"arena {fmt_bytes(m['memory']['arena_bytes'])}{', cuda-graph' if self.cuda_graph else ''}>")

    def info(self) -> dict[str, Any]:
        """JSON-able description for ``fusec inspect PLAN --json``."""
        m = self.manifest
        ents = entry_points(m)
        if "entries" in m:  # named entry points (a generation plan's prefill and decode; any one entry too)
            out = {k: m[k] for k in ("fusec_version", "arch", "dtype", "nvrtc_version", "cupy_version",
                                    "driver_version", "cuda_graph", "source", "generation", "state") if k in m}
            out["entries"] = {name: self._entry_info(e) for name, e in ents.items()}
            out["memory"] = dict(m["memory"])
            return out
        return self._entry_info(ents["main"], top=True)

    def _entry_info(self, e: Mapping[str, Any], top: bool = False) -> dict[str, Any]:
        m = self.manifest
        kernels = []
        for L in e["launches"]:
            if L["type"] == "kernel":
                k = m["kernels"][L["kernel"]]
                kernels.append({"name": k["entry"], "label": L.get("label", ""), "grid": L["grid"], "block": L["block"],
                                "smem": L.get("smem", 0)})
            else:
                kernels.append({"name": f"cublas_gemm_{L['dtype']}", "label": L.get("label", ""),
                                "m": L["m"], "n": L["n"], "k": L["k"], "batch": L["batch"]})
        out: dict[str, Any] = {}
        if top:
            out = {k: m[k] for k in ("fusec_version", "arch", "dtype") if k in m}
        out.update({"inputs": e["inputs"], "outputs": e["outputs"]})
        if top:
            out.update({k: m[k] for k in ("report", "nvrtc_version", "cupy_version", "driver_version", "cuda_graph",
                                          "source", "ab") if k in m})
        out["kernels"] = kernels
        out["launches"] = len(kernels)
        if top:
            out["memory"] = dict(m["memory"])
        return out

    # ---- running -------------------------------------------------------------------------------
    def _exec(self, entry: str | None = None) -> Any:
        entry = entry or self.entries[0]
        ex = self._executors.get(entry)
        if ex is None:
            from fusec.runtime.executor import Executor
            from fusec.runtime.plan_device import Device

            gpu_arch = _current_arch()
            if gpu_arch is None:
                raise FusecError("no GPU found (CuPy sees no CUDA device): a plan runs only on a GPU; "
                                 "use the reference backend (fusec run MODEL --backend reference)")
            if gpu_arch != self.arch:
                raise PlanArchError(f"{self._where}: plan compiled for {self.arch} but this GPU is {gpu_arch} "
                                    "(field 'arch'); load it with recompile=True")
            if self._device is None:
                self._device = Device(self.manifest, self.blob)
                self._device.guard = self._guard
            ex = self._executors[entry] = Executor(self.manifest, self.blob, cuda_graph=self.cuda_graph, entry=entry,
                                                   device=self._device)
        return ex

    def device(self) -> Any:
        """The plan's device state (weights, state region, arena), made on first use."""
        return self._exec().device

    def run(self, inputs: Mapping[str, Any], stream: Any = None, outputs: Mapping[str, Any] | None = None,
            entry: str | None = None, measure: bool = False, nvtx: bool | None = None) -> dict[str, Any]:
        """Run entry point ``entry`` (default: the first) once on the GPU; returns {output name:
        CuPy array} (see fusec.runtime.executor). ``measure``: count driver activity for stats()
        (CUPTI: attached on the first measured run, after which every graph launch of the process
        pays for its records, 8-16% of a small plan's replay; so only when asked).
        ``nvtx``: an NVTX range around each launch (default: on when FUSEC_NVTX=1; fusec.report.nvtx).

        ``stream``: a CuPy stream, or any object that names a CUDA stream: a PyTorch stream
        (``torch.cuda.Stream``: its ``cuda_stream``), an object with ``__cuda_stream__`` (the
        CUDA stream protocol) or a raw handle (int); default: CuPy's current stream. The returned
        arrays are views of the plan's arena, overwritten by the next run (copy what you keep, or
        pass ``outputs``). One call at a time per plan: a concurrent call from another thread
        raises ConcurrentRunError."""
        self._last = self._exec(entry)
        return self._last.run(inputs, stream=as_cupy_stream(stream), outputs=outputs, measure=measure, nvtx=nvtx)

    def profile(self, inputs: Mapping[str, Any], repeats: int = 5, entry: str | None = None) -> list[dict[str, Any]]:
        """Per-launch GPU times (a diagnostic that synchronizes; see Executor.profile)."""
        return self._exec(entry).profile(inputs, repeats)

    def launch_each(self, inputs: Mapping[str, Any], before: Any, entry: str | None = None) -> None:
        """Run launch by launch with ``before(i)`` ahead of each (a diagnostic; see Executor.launch_each)."""
        self._exec(entry).launch_each(inputs, before)

    def bind(self, inputs: Mapping[str, Any] | None = None, outputs: Mapping[str, Any] | None = None,
             entry: str | None = None) -> Any:
        """Bind caller device arrays once; the returned object's ``run()`` is one CUDA-graph launch
        (no checks, no staging: see fusec.runtime.bound)."""
        from fusec.runtime.bound import bind

        return bind(self, inputs, outputs, entry)

    def stats(self) -> dict[str, Any]:
        """Counters of the last run (see Executor.stats): launches, and what the driver did."""
        return self._last.stats() if self._last is not None else {}


def _info(d: Mapping[str, Any]) -> TensorInfo:
    return TensorInfo(str(d["name"]), tuple(int(x) for x in d["shape"]), str(d["dtype"]))


def stream_handle(stream: Any) -> int | None:
    """The raw CUDA stream handle an object names, or None for "the default": a CuPy stream
    (``.ptr``), a PyTorch stream (``.cuda_stream``), an object with ``__cuda_stream__``
    (returns ``(version, handle)``), or an int. FusecError for anything else."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise FusecError(f"stream must be a CUDA stream, got {stream!r}")
    if isinstance(stream, int):
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        got = proto() if callable(proto) else proto
        if isinstance(got, tuple) and len(got) == 2 and all(isinstance(x, int) for x in got):
            return int(got[1])
        raise FusecError(f"stream: {type(stream).__name__}.__cuda_stream__ gave {got!r}, expected (version, handle)")
    for attr in ("ptr", "cuda_stream"):
        v = getattr(stream, attr, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    raise FusecError(f"stream: a {type(stream).__name__} is not a CUDA stream (expected a CuPy or PyTorch stream, "
                     "an object with __cuda_stream__, or a handle)")


def as_cupy_stream(stream: Any) -> Any:
    """``stream`` as a CuPy stream (CuPy streams as they are; others wrapped, not owned)."""
    if stream is None:
        return None
    import cupy

    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    handle = stream_handle(stream)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:  # CuPy 14: keeps a reference to the foreign stream object
        return from_external(stream if hasattr(stream, "__cuda_stream__") else _Handle(handle))
    return cupy.cuda.ExternalStream(handle)


class _Handle:
    """A raw stream handle, presented through the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def entry_points(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Every entry point of a plan: {name: {"inputs", "outputs", "launches", "arena_bytes"}}.
    A one-entry plan keeps these fields at the top level of its manifest (entry "main")."""
    if "entries" in manifest:
        return {k: dict(v) for k, v in manifest["entries"].items()}
    return {"main": {"inputs": manifest["inputs"], "outputs": manifest["outputs"], "launches": manifest["launches"],
                     "arena_bytes": manifest["memory"]["arena_bytes"]}}


def _current_arch() -> str | None:
    from fusec.device import gpu_arch

    return gpu_arch()


def _validate_manifest(m: Mapping[str, Any], blobs: Mapping[str, Any], where: str) -> None:
    """Check the manifest strictly before anything is loaded: types, ranges, no unknown keys,
    every pointer range inside its region, launch limits, cubin headers and arch, self-contained
    sources (see ``fusec.plancheck``). Raises PlanFileError naming the field."""
    from fusec.plancheck import validate

    validate(m, blobs, where, __version__)
