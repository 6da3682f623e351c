"""The user-facing ``Plan``: a compiled model (manifest + weights + kernel sources and binaries).

A ``Plan`` needs no GPU to exist, be saved, loaded or inspected (``fusec compile`` cross-compiles
on machines without one). The device state (arena, uploaded weights, loaded modules, CUDA graph)
is created by ``fusec.runtime.Executor`` on the first ``run``.

``Plan.load(path)`` validates the whole file (``fusec.planfile``) and the manifest before any
code is loaded. A plan compiled for another GPU architecture is refused with an error naming the
``arch`` field, or recompiled from its bundled sources with ``recompile=True``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fusec import __version__
from fusec.errors import FusecError
from fusec.planfile import PlanFileError, read_plan, write_plan

_REQUIRED = ("fusec_version", "arch", "dtype", "memory", "modules", "kernels")
_ENTRY = ("inputs", "outputs", "launches")  # per entry point: at the top level, or under "entries"


class PlanArchError(FusecError):
    """The plan's ``arch`` does not match the GPU it is asked to run on."""


class Plan:
    def __init__(self, manifest: Mapping[str, Any], blobs: Mapping[str, bytes | memoryview], cuda_graph: bool = False,
                 _device: Any = None):
        self.manifest = dict(manifest)
        self._blobs = dict(blobs)
        self.cuda_graph = bool(cuda_graph or self.manifest.get("cuda_graph", False))
        self._executors: dict[str, Any] = {}
        self._device = _device  # fusec.runtime.executor.Device: weights, state, kernels; shared by copies
        self._last: Any = None
        _validate_manifest(self.manifest, self._blobs, "<in memory>")

    # ---- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to one ``.fplan`` file, atomically."""
        write_plan(path, self.manifest, {k: bytes(v) for k, v in self._blobs.items()})

    @classmethod
    def load(cls, path: str | os.PathLike, recompile: bool = False, cuda_graph: bool | None = None) -> Plan:
        """Read and validate ``path``. ``recompile``: rebuild kernels for the current GPU's arch."""
        pf = read_plan(path)
        blobs = {name: pf.blob(name) for name in pf.names()}
        _validate_manifest(pf.manifest, blobs, str(path))
        plan = cls(pf.manifest, blobs, cuda_graph=bool(pf.manifest.get("cuda_graph")) if cuda_graph is None else cuda_graph)
        gpu_arch = _current_arch()
        if gpu_arch is not None and gpu_arch != plan.arch:
            if not recompile:
                raise PlanArchError(f"{path}: field 'arch' is {plan.arch}, but this GPU is {gpu_arch}; "
                                    f"use fusec.load(path, recompile=True) to rebuild its kernels from the bundled sources")
            plan._recompile(gpu_arch)
        return plan

    def _recompile(self, arch: str) -> None:
        from fusec.codegen.compile import compile_cuda

        for m in self.manifest["modules"]:
            src = bytes(self._blobs[m["source"]]).decode("utf-8")
            self._blobs[m["cubin"]] = compile_cuda(src, m["entry"], arch).cubin
        self.manifest["arch"] = arch

    # ---- facts ---------------------------------------------------------------------------------
    @property
    def arch(self) -> str:
        return str(self.manifest["arch"])

    @property
    def dtype(self) -> str:
        return str(self.manifest["dtype"])

    def blob(self, name: str) -> bytes | memoryview:
        return self._blobs[name]

    def blobs(self) -> dict[str, bytes | memoryview]:
        """Every part of the plan by name (weights, kernel sources, cubins)."""
        return dict(self._blobs)

    def with_cuda_graph(self, cuda_graph: bool) -> Plan:
        """The same compiled plan, run with or without CUDA-graph replay; it shares this plan's
        device memory (weights uploaded once, the same state and arena: run one at a time)."""
        return Plan(self.manifest, self._blobs, cuda_graph=cuda_graph, _device=self._device)

    @property
    def entries(self) -> list[str]:
        """The plan's entry points ("main" for a one-entry plan; "prefill", "decode" for generation)."""
        return list(entry_points(self.manifest))

    def info(self) -> dict[str, Any]:
        """JSON-able description for ``fusec inspect PLAN --json``."""
        m = self.manifest
        ents = entry_points(m)
        if len(ents) > 1:
            out = {k: m[k] for k in ("fusec_version", "arch", "dtype", "nvrtc_version", "cupy_version", "cuda_graph",
                                    "generation", "state") if k in m}
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
            out.update({k: m[k] for k in ("report", "nvrtc_version", "cupy_version", "cuda_graph", "ab") if k in m})
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
            from fusec.runtime.executor import Device, Executor

            gpu_arch = _current_arch()
            if gpu_arch is None:
                raise FusecError("no GPU found (CuPy sees no CUDA device): a plan runs only on a GPU; "
                                 "use the reference backend (fusec run MODEL --backend reference)")
            if gpu_arch != self.arch:
                raise PlanArchError(f"field 'arch' is {self.arch}, but this GPU is {gpu_arch}; "
                                    f"load with recompile=True")
            if self._device is None:
                self._device = Device(self.manifest, self.blob)
            ex = self._executors[entry] = Executor(self.manifest, self.blob, cuda_graph=self.cuda_graph, entry=entry,
                                                   device=self._device)
        return ex

    def device(self) -> Any:
        """The plan's device state (weights, state region, arena), made on first use."""
        return self._exec().device

    def run(self, inputs: Mapping[str, Any], stream: Any = None, outputs: Mapping[str, Any] | None = None,
            entry: str | None = None, measure: bool = True, nvtx: bool | None = None) -> dict[str, Any]:
        """Run entry point ``entry`` (default: the first) once on the GPU; returns {output name:
        CuPy array} (see fusec.runtime.executor). ``measure``: count driver activity for stats().
        ``nvtx``: an NVTX range around each launch (default: on when FUSEC_NVTX=1; fusec.report.nvtx)."""
        self._last = self._exec(entry)
        return self._last.run(inputs, stream=stream, outputs=outputs, measure=measure, nvtx=nvtx)

    def profile(self, inputs: Mapping[str, Any], repeats: int = 5, entry: str | None = None) -> list[dict[str, Any]]:
        """Per-launch GPU times (a diagnostic that synchronizes; see Executor.profile)."""
        return self._exec(entry).profile(inputs, repeats)

    def stats(self) -> dict[str, Any]:
        """Counters of the last run (see Executor.stats): launches, and what the driver did."""
        return self._last.stats() if self._last is not None else {}

    def generate(self, prompts: Any, max_new_tokens: int = 32, seed: int = 0, stream_every: int = 0,
                 on_tokens: Any = None) -> Any:
        """Generate from a generation plan (``fusec compile --generate``): ``prompts`` is a list of
        token-id lists, or of strings when the plan carries a tokenizer. Returns
        ``fusec.generation.Generated`` (prompt_ids, new_ids, text, timings, stats)."""
        from fusec.runtime.generation import generate_with_plan

        return generate_with_plan(self, prompts, max_new_tokens, seed, stream_every, on_tokens)


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


def _validate_entry(e: Mapping[str, Any], m: Mapping[str, Any], wbytes: int, arena: int, state: int, where: str) -> None:
    """One entry point's inputs, outputs and launches (kept for callers; see ``fusec.plancheck``)."""
    from fusec.plancheck import _Check, _entry

    kernels = m.get("kernels", [])
    _entry(_Check(where), e, kernels if isinstance(kernels, list) else [],
           {"arena": arena, "weights": wbytes, "state": state}, "")
