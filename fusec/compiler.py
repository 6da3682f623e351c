"""``fusec.compile``: model -> graph -> passes -> legalize -> memory plan -> lowering -> Plan.

Works without a GPU: kernels are compiled for ``arch`` (default: the current GPU's, else sm_90)
by NVRTC, which needs no device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusec import __version__
from fusec.errors import InputError
from fusec.plan import Plan

DTYPES = {"fp32": ("f32", "f32"), "tf32": ("f32", "tf32"), "fp16": ("f16", "f32"), "bf16": ("bf16", "f32")}


def compile(model: Any, shapes: Mapping[str, Sequence[int]] | None = None, dtype: str = "fp16",
            cuda_graph: bool = False, arch: str | None = None, *, disabled_fusions: Sequence[str] = (),
            enabled_fusions: Sequence[str] = (), dump_dir: str | os.PathLike | None = None,
            progress: Callable[[str, str], None] | None = None, fusion_overrides: Mapping[str, bool] | None = None,
            choices: Mapping[str, str] | None = None) -> Plan:
    """Compile ``model`` (an ONNX path, an ``onnx.ModelProto``, a built-in model name or a ``Graph``).

    ``dtype``: storage/math of floating-point tensors: fp32, tf32 (fp32 storage, tf32 matrix
    products), fp16 or bf16 (fp32 accumulation everywhere). ``progress(stage, item)`` is called
    before each pass and each kernel compile. ``fusion_overrides`` {candidate key: fuse?} and
    ``choices`` {choice key: kernel variant} carry A/B decisions (``fusec.ab``); without them the
    rule-based defaults apply.
    """
    from fusec.codegen.compile import default_arch, nvrtc_version
    from fusec.inputs import input_signature
    from fusec.loader import load_graph
    from fusec.lower import lower
    from fusec.lower.legalize import legalize
    from fusec.passes.base import PassOptions
    from fusec.passes.memory_plan import plan_memory
    from fusec.passes.pipeline import optimize, report

    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    storage, compute = DTYPES[dtype]
    arch = arch or default_arch()
    _check_arch(arch)
    graph = load_graph(model, shapes)
    opts = PassOptions(storage_dtype=storage, disabled_fusions=frozenset(disabled_fusions),
                       enabled_fusions=frozenset(enabled_fusions), fusion_overrides=dict(fusion_overrides or {}))
    step = (lambda name, i, n: progress("pass", name)) if progress else None
    g, opts = optimize(graph, opts, dump_dir=dump_dir, progress=step)
    g = legalize(g)
    mplan = plan_memory(g)
    low = lower(g, mplan.offsets, arch, compute=compute, progress=(lambda k: progress("kernel", k)) if progress else None,
                arena_base=mplan.arena_bytes, choices=dict(choices or {}))
    rep = report(g, opts, mplan)
    rep["lowering"] = low.report
    if "fused_split" in g.meta:
        rep["fused_split"] = g.meta["fused_split"]

    def sig(values: Any) -> list[dict[str, Any]]:
        out = []
        for v in values:
            if v.is_const:
                raise InputError(f"graph output {v.name!r} is a constant; nothing to compute")
            out.append({"name": v.name, "shape": list(v.shape), "dtype": v.dtype.value, "offset": mplan.offsets[v.name]})
        return out

    inputs = sig(g.inputs)
    for rec, full in zip(inputs, input_signature(graph)):
        rec["bound"] = full["bound"]  # lets `fusec run PLAN` draw valid random token ids

    manifest = {
        "fusec_version": __version__,
        "nvrtc_version": ".".join(map(str, nvrtc_version())),
        "cupy_version": _cupy_version(),
        "arch": arch,
        "dtype": dtype,
        "cuda_graph": bool(cuda_graph),
        "model": g.name,
        "source": _source(model, shapes),
        "inputs": inputs,
        "outputs": sig(g.outputs),
        "memory": {"arena_bytes": _round_up(mplan.arena_bytes) + low.scratch_bytes, "weights_bytes": low.weights_bytes,
                   "scratch_bytes": low.scratch_bytes,
                   **{k: v for k, v in mplan.summary().items() if k != "weights_bytes"}},
        "modules": low.modules,
        "kernels": low.kernels,
        "launches": low.launches,
        "report": rep,
    }
    return Plan(manifest, low.blobs, cuda_graph=cuda_graph)


def _source(model: Any, shapes: Mapping[str, Sequence[int]] | None) -> dict[str, Any]:
    """Where the plan came from, so `fusec run PLAN --check` can rebuild the reference graph."""
    if isinstance(model, (str, os.PathLike)):
        from fusec.loader import builtin_names

        name = os.fspath(model)
        ref = name if name in builtin_names() else os.path.abspath(name)
    else:
        ref = None  # an in-memory ModelProto: nothing to point back to
    return {"model": ref, "shapes": {k: list(v) for k, v in (shapes or {}).items()}}


def _round_up(n: int, a: int = 256) -> int:
    return -(-n // a) * a


def _check_arch(arch: str) -> None:
    if not (arch.startswith("sm_") and arch[3:].isdigit() and int(arch[3:]) >= 70):
        raise InputError(f"--arch must look like sm_80 or sm_90 (sm_70 or newer), got {arch!r}")


def _cupy_version() -> str:
    try:
        import cupy

        return str(cupy.__version__)
    except Exception:
        return "unavailable"
