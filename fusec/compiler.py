"""``fusec.compile``: model -> graph -> passes -> memory plan -> lowering -> Plan.

Works without a GPU: kernels are compiled for ``arch`` (default: the current GPU's, else sm_90)
by NVRTC, which needs no device.
"""

from __future__ import annotations

import dataclasses
import math
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
            choices: Mapping[str, str] | None = None, fp32_gemm: str = "3xtf32", quantize: str | None = None,
            quantize_group: int = 128, quantize_head: bool = False) -> Plan:
    """Compile ``model`` (an ONNX path, an ``onnx.ModelProto``, a built-in model name or a ``Graph``).

    ``dtype``: storage/math of floating-point tensors: fp32, tf32 (fp32 storage, tf32 matrix
    products), fp16 or bf16 (fp32 accumulation everywhere). ``progress(stage, item)`` is called
    before each pass and each kernel compile. ``fusion_overrides`` {candidate key: fuse?} and
    ``choices`` {choice key: kernel variant} carry A/B decisions (``fusec.ab``); without them the
    rule-based defaults apply. ``fp32_gemm``: how an fp32 plan (sm_80+) runs its products with
    constant weights: "3xtf32" (passes/split_tf32.py, fp32-accurate on tf32 tensor cores) or
    "sgemm" (cuBLAS's exact-fp32 path); other dtypes and older GPUs always take the plain product.
    ``quantize``: None, "int8" or "int4" (``quantize_group`` 32 or 128): weight-only quantization of
    the products with constant weights (passes/quantize.py; ``quantize_head``: the LM head too).
    """
    from fusec.loader import load_graph, source_record

    if progress is not None and isinstance(model, (str, os.PathLike)):  # building a large model takes a while
        progress("build", os.fspath(model))
    storage = DTYPES[dtype][0] if dtype in DTYPES else None  # half-precision weights are held so from the start
    graph = load_graph(model, shapes, storage=storage) if not isinstance(model, Mapping) else None
    entries = {"main": graph} if graph is not None else dict(model)
    options = {"disabled_fusions": disabled_fusions, "enabled_fusions": enabled_fusions,
               "fusion_overrides": fusion_overrides, "choices": choices,
               "fp32_gemm": fp32_gemm if fp32_gemm != "3xtf32" else None,  # recorded when not the default
               **quantize_options(quantize, quantize_group, quantize_head)}
    return compile_entries(entries, dtype=dtype, cuda_graph=cuda_graph, arch=arch,
                           disabled_fusions=disabled_fusions, enabled_fusions=enabled_fusions, dump_dir=dump_dir,
                           progress=progress, fusion_overrides=fusion_overrides, choices=choices, fp32_gemm=fp32_gemm,
                           source=source_record(model if graph is not None else None, shapes, options),
                           **quantize_options(quantize, quantize_group, quantize_head))


@dataclasses.dataclass
class Staged:
    """One graph taken through every stage: passes, memory plan, lowering."""

    graph: Any  # the optimized (fused) graph
    memory: Any  # its MemoryPlan
    lowered: Any  # fusec.lower.Lowered
    report: dict[str, Any]
    options: Any = None  # the PassOptions after the passes (declines, stats)


def stage(graph: Any, dtype: str, arch: str, *, disabled_fusions: Sequence[str] = (), enabled_fusions: Sequence[str] = (),
          dump_dir: str | os.PathLike | None = None, progress: Callable[[str, str], None] | None = None,
          fusion_overrides: Mapping[str, bool] | None = None, choices: Mapping[str, str] | None = None,
          state_layout: Mapping[str, int] | None = None, shared: Any = None, dry_run: bool = False,
          weights_nk: bool = False, fp32_gemm: str = "3xtf32", sync_base: int = 0, quantize: str | None = None,
          quantize_group: int = 128, quantize_head: bool = False) -> Staged:
    """The one path from a graph to its lowered launch list (every entry point of every plan)."""
    from fusec.codegen.compile import WGMMA_ARCH
    from fusec.ir import verify
    from fusec.lower import lower, sm90_or_later
    from fusec.passes.base import PassOptions
    from fusec.passes.memory_plan import plan_memory
    from fusec.passes.pipeline import optimize, report

    storage, compute = DTYPES[dtype]
    opts = PassOptions(storage_dtype=storage, disabled_fusions=frozenset(disabled_fusions),
                       enabled_fusions=frozenset(enabled_fusions), fusion_overrides=dict(fusion_overrides or {}),
                       choices=dict(choices or {}), weights_nk=weights_nk,
                       fp32_gemm=fp32_gemm_mode(dtype, fp32_gemm), quantize=quantize,
                       quantize_group=quantize_group, quantize_head=quantize_head, clusters=sm90_or_later(arch),
                       wgmma=arch == WGMMA_ARCH)
    step = (lambda name, i, n: progress("pass", name)) if progress else None
    g, opts = optimize(graph, opts, dump_dir=dump_dir, progress=step)
    verify(g)  # the optimized graph is well formed (no read of a value after it is overwritten in place)
    mplan = plan_memory(g)
    state = {v: int(state_layout[s]) + off for v, (s, off) in mplan.state.items()} if state_layout else {}
    low = lower(g, mplan.offsets, arch, compute=compute, progress=(lambda k: progress("kernel", k)) if progress else None,
                arena_base=mplan.arena_bytes, choices=dict(choices or {}), state=state, shared=shared, dry_run=dry_run,
                sync_base=sync_base)
    rep = report(g, opts, mplan)
    rep["lowering"] = low.report
    return Staged(g, mplan, low, rep, opts)


def quantize_options(method: str | None, group: int = 128, head: bool = False) -> dict[str, Any]:
    """The quantize keywords of ``compile``/``stage`` (and a plan's recorded options), checked:
    {} without ``method``. InputError for an unknown method or int4 group."""
    from fusec.quantize import INT4_GROUPS, METHODS

    if not method:
        return {}
    if method not in METHODS:
        raise InputError(f"unknown --quantize {method!r} (expected one of {', '.join(METHODS)})")
    if method == "int4" and group not in INT4_GROUPS:
        raise InputError(f"--quantize-group must be one of {', '.join(map(str, INT4_GROUPS))}, got {group}")
    return {"quantize": method, "quantize_group": int(group), "quantize_head": bool(head)}


def fp32_gemm_mode(dtype: str, requested: str) -> str:
    """The ``PassOptions.fp32_gemm`` a plan gets: ``requested`` for fp32 plans (tf32 tensor
    cores), else "sgemm" (the option names how exact fp32 is computed; tf32/fp16/bf16 plans
    already run their products on tensor cores)."""
    from fusec.passes.split_tf32 import MODES

    if requested not in MODES:
        raise InputError(f"unknown fp32 GEMM mode {requested!r} (expected one of {', '.join(MODES)})")
    return requested if dtype == "fp32" else "sgemm"  # every arch fusec compiles for has tf32 (codegen.compile.MIN_ARCH)


def state_layout(graph: Any, storage: str) -> tuple[list[dict[str, Any]], int]:
    """Byte offsets of a graph's states in the plan's state region (declaration order, aligned).
    Float state is stored in the ``storage`` dtype, as the precision pass retypes it (parameters it
    keeps fp32, ``fp32_inputs``, stay fp32)."""
    from fusec.dtypes import DType
    from fusec.passes.precision import fp32_inputs

    recs, top = [], 0
    params = fp32_inputs(graph)
    for src, _ in graph.state_pairs():
        dt = DType(storage) if src.dtype == DType.F32 and src.name not in params else src.dtype
        recs.append({"name": src.name, "shape": list(src.shape), "dtype": dt.value, "offset": top})
        top += _round_up(math.prod(src.shape) * dt.itemsize)
    return recs, top


def compile_entries(graphs: Mapping[str, Any], dtype: str = "fp16", cuda_graph: bool = False, arch: str | None = None,
                    *, source: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                    extra_blobs: Mapping[str, bytes] | None = None, **options: Any) -> Plan:
    """Compile one or more entry points into one plan: shared weights, kernels and state.

    A plan with one entry named "main" keeps the flat manifest (inputs/outputs/launches at the top
    level); several entries go under ``manifest["entries"]``, each with its own inputs, outputs,
    launch list and arena size; the arena is sized for the largest (entries never run at once)."""
    from fusec.codegen.compile import check_arch, default_arch
    from fusec.inputs import input_signature
    from fusec.planenv import toolchain

    if dtype not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    arch = check_arch(arch or default_arch(), dtype)
    _check_plan_names(graphs)
    staged: dict[str, Staged] = {}
    first_graph = next(iter(graphs.values()))
    state_recs, state_bytes = state_layout(first_graph, DTYPES[dtype][0])
    layout = {r["name"]: r["offset"] for r in state_recs}
    shared = None
    dump_dir = options.pop("dump_dir", None)
    from fusec.bulk import sharing_derived

    with sharing_derived():  # entries holding the same weights share what passes derive from them
        for name, graph in graphs.items():
            where = dump_dir if dump_dir is None or len(graphs) == 1 else os.path.join(os.fspath(dump_dir), name)
            st = stage(graph, dtype, arch, state_layout=layout, shared=shared, dump_dir=where,
                       sync_base=state_bytes, **options)
            got, _ = state_layout(st.graph, DTYPES[dtype][0])
            if got != state_recs:
                raise InputError(f"entry {name!r}: its state differs from the other entries' ({got} vs {state_recs})")
            staged[name] = st
            shared = st.lowered
    last = list(staged.values())[-1].lowered

    def sig(st: Staged, values: Any) -> list[dict[str, Any]]:
        out = []
        for v in values:
            if v.is_const:
                raise InputError(f"graph output {v.name!r} is a constant; nothing to compute")
            out.append({"name": v.name, "shape": list(v.shape), "dtype": v.dtype.value,
                        "offset": st.memory.offsets[v.name]})
        return out

    entries: dict[str, Any] = {}
    for name, st in staged.items():
        inputs = sig(st, st.graph.user_inputs())
        bounds = {full["name"]: full["bound"] for full in input_signature(graphs[name])}
        for rec in inputs:
            rec["bound"] = bounds.get(rec["name"])  # lets `fusec run PLAN` draw valid random token ids
        entries[name] = {"inputs": inputs, "outputs": sig(st, st.graph.user_outputs()),
                         "launches": st.lowered.launches,
                         "arena_bytes": _round_up(st.memory.arena_bytes) + st.lowered.scratch_bytes}
    first = next(iter(staged.values()))
    manifest: dict[str, Any] = {
        "fusec_version": __version__,
        **toolchain(),  # nvrtc_version, cupy_version, driver_version: checked at load (fusec.planenv)
        "arch": arch,
        "dtype": dtype,
        "cuda_graph": bool(cuda_graph),
        "model": _display_name(first.graph.name),
        "source": {"model": None, "kind": "other", "sha256": None, "shapes": {}, **(source or {})},
        "memory": {"arena_bytes": max(e["arena_bytes"] for e in entries.values()), "weights_bytes": last.weights_bytes,
                   "scratch_bytes": max(st.lowered.scratch_bytes for st in staged.values()),
                   # the states, then the kernels' counters (zeroed once with them)
                   "state_bytes": state_bytes + max(st.lowered.sync_bytes for st in staged.values()),
                   **{k: v for k, v in first.memory.summary().items() if k != "weights_bytes"}},
        "modules": last.modules,
        "kernels": last.kernels,
        "report": first.report,
    }
    if list(entries) == ["main"]:
        manifest.update({k: v for k, v in entries["main"].items() if k != "arena_bytes"})
    else:
        manifest["entries"] = entries
        manifest["reports"] = {n: st.report for n, st in staged.items()}
    if state_recs:
        manifest["state"] = state_recs
    manifest.update(extra or {})
    blobs = dict(last.blobs)
    blobs.update(extra_blobs or {})
    return Plan(manifest, blobs, cuda_graph=cuda_graph)


def _check_plan_names(graphs: Mapping[str, Any]) -> None:
    """The input and output names a plan stores fit its manifest (checked before any work)."""
    from fusec.plancheck_fields import MAX_NAME

    for g in graphs.values():
        for what, values in (("input", g.user_inputs()), ("output", g.user_outputs())):
            for v in values:
                if len(v.name) > MAX_NAME:
                    raise InputError(f"graph {what} {v.name[:40]!r}... has a name of {len(v.name)} characters; a plan "
                                     f"stores {what} names of at most {MAX_NAME}: rename it in the model")


def _display_name(name: str) -> str:
    """The model's name as the manifest shows it: a name past the manifest's limit is cut short."""
    from fusec.plancheck_fields import MAX_NAME

    return name if len(name) <= MAX_NAME else name[:MAX_NAME - 3] + "..."


def _round_up(n: int, a: int = 256) -> int:
    return -(-n // a) * a


def compile_generation(model: Any, *, batch: int = 1, max_seq_len: int = 256, prefill_len: int | None = None,
                       dtype: str = "bf16", arch: str | None = None, weights_dir: str | os.PathLike | None = None,
                       eos_ids: Sequence[int] | None = None, cuda_graph: bool = True,
                       progress: Callable[[str, str], None] | None = None, quantize: str | None = None,
                       quantize_group: int = 128, quantize_head: bool = False, admit_batch: int = 0,
                       join: int = 0, disabled_fusions: Sequence[str] = (),
                       enabled_fusions: Sequence[str] = ()) -> Any:
    """A generation plan (entries "prefill" and "decode", ``fusec.genmodel``'s graphs) of ``model``
    (a ``fusec.genmodel.GenModel``, or what ``load_generation_model`` takes). Sampling settings are
    not compiled in: each generation (each row) gives its own. ``quantize`` (int8/int4,
    ``quantize_options``): fusec's own weight quantization of the products whose weights are not
    packed already (a GGUF file's stay as the file has them). ``admit_batch`` (A < batch): also an
    "admit" entry that prefills A prompts into chosen rows, so a server admitting k requests
    computes about k rows instead of the whole batch (models/generate.py). ``join`` (J): also a
    "join" entry, a decode step that prefills up to J new prompts into free rows in the same
    products (models/join.py). ``disabled_fusions``/``enabled_fusions``: fusion rules turned off/on in
    every entry (``fusec.compile``'s; recorded in the plan's source)."""
    from fusec import _check_fusion_names
    from fusec.genmodel import GenModel, build_graphs, load_generation_model

    _check_fusion_names(disabled_fusions, "disabled_fusions")
    _check_fusion_names(enabled_fusions, "enabled_fusions")
    gm = model if isinstance(model, GenModel) else load_generation_model(model, weights_dir)
    storage = DTYPES[dtype][0] if dtype in DTYPES else None
    graphs = build_graphs(gm, batch, max_seq_len, prefill_len, eos_ids, storage=storage, admit_batch=admit_batch,
                          join=join)
    meta = dict(graphs["decode"].meta["generation"])
    meta.update({"vocab_size": gm.config.vocab_size, "num_layers": gm.config.num_layers, "source": gm.source})
    blobs = {}
    if gm.tokenizer is not None:
        t = gm.tokenizer
        blobs["tokenizer"] = t.backend.to_str().encode("utf-8")
        meta["tokenizer"] = {"bos_id": t.bos_id, "eos_ids": list(t.eos_ids), "add_bos": t.add_bos,
                             "chat_template": t.chat_template}
    source: dict[str, Any] = {"model": gm.source, "shapes": {}}
    fusion = {k: sorted(v) for k, v in (("disabled_fusions", disabled_fusions), ("enabled_fusions", enabled_fusions))
              if v}
    if fusion:
        source["options"] = fusion
    # weights_nk: the prefill's cuBLAS reads each weight [N, K] through its transpose flag, the
    # layout the decode step's GEMV reads, so the two entries share one copy of every weight
    return compile_entries(graphs, dtype=dtype, cuda_graph=cuda_graph, arch=arch, progress=progress,
                           source=source, extra={"generation": meta}, extra_blobs=blobs,
                           weights_nk=True, disabled_fusions=tuple(disabled_fusions),
                           enabled_fusions=tuple(enabled_fusions),
                           **quantize_options(quantize, quantize_group, quantize_head))
