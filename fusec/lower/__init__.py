"""Lowering: an optimized, memory-planned graph -> the runtime's launch list + the plan's blobs.

Every node becomes one of: nothing (a zero-copy view, or a node whose output the memory plan
aliases to its input), one kernel launch (a spec built by ``fusec.lower.specs`` and compiled by
``fusec.codegen.kernels``), or one cuBLAS GEMM. A fused node is one kernel (a GEMM epilogue:
the product, then one epilogue kernel): the fusion pass forms only groups that
``fusec.lower.fused_plan.can_fuse`` accepts, and records every group it declines with the reason.

Addresses: values live in the arena at the memory plan's offsets (views and in-place values
included); constants, the fused bodies' constants too, are packed into one weights buffer with
256-byte alignment. Identical kernels (same spec, so same source) compile once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fusec.errors import FusecError
from fusec.ir import Graph, Node, Value
from fusec.program import Region, Task

Addr = tuple[str, int]  # ("arena" | "weights", byte offset)
_ALIGN = 256
_UNKNOWN_EXTENT = 1 << 40  # a raw address of unknown size: everything after it in its space


def sm90_or_later(arch: str) -> bool:
    """Whether ``arch`` has what sm_90 added and the lowering uses: programmatic dependent launch
    (griddepcontrol) and thread block clusters (distributed shared memory)."""
    return arch.startswith("sm_") and arch[3:5].isdigit() and int(arch[3:].rstrip("abcdefghijklmnopqrstuvwxyz")) >= 90


@dataclasses.dataclass(frozen=True)
class Raw:
    """A raw address (space, byte offset), e.g. in the scratch tail of the arena; ``nbytes`` its
    extent (0: unknown, taken as everything after it in its space by the program's dependencies)."""

    space: str
    offset: int
    nbytes: int = 0


class LoweringError(FusecError):
    """A node has no GPU implementation; the message names the node and op."""


@dataclasses.dataclass
class Lowered:
    launches: list[dict[str, Any]]  # the program's tasks as launch records (fusec.program.Task.to_json)
    kernels: list[dict[str, Any]]
    modules: list[dict[str, Any]]
    blobs: dict[str, bytes]
    weights_bytes: int
    scratch_bytes: int
    report: dict[str, Any]
    packer: WeightPacker | None = None  # to share the weights with another entry point (lower(shared=))
    sync_bytes: int = 0  # kernels' counters at the end of the state region (zero between launches)


class WeightPacker:
    """Packs constant tensors into one byte buffer (256-byte aligned).

    Deduplicated by identity, and by content among constants of the same name, type and shape:
    the entry points of one plan (prefill, decode) are optimized separately, so each has its own
    Value objects (and, after the precision pass, its own arrays) for the same weight; they share
    one copy in the plan."""

    def __init__(self) -> None:
        self.chunks: list[Any] = []  # bytes-like: uint8 views of the (contiguous) arrays, zero padding
        self.size = 0
        self.where: dict[int, int] = {}
        self._by_key: dict[tuple[str, str, tuple[int, ...]], list[tuple[int, np.ndarray]]] = {}

    def add(self, v: Value) -> int:
        key = id(v)
        if key not in self.where:
            assert v.data is not None
            # no copy of a contiguous array: its bytes are copied once, by blob()
            raw = np.ascontiguousarray(v.data).reshape(-1).view(np.uint8)
            same = self._by_key.setdefault((v.name, v.dtype.value, v.shape), [])
            for off, other in same:
                if _same_bytes(other, raw):
                    self.where[key] = off
                    return off
            self.where[key] = self.size
            same.append((self.size, raw))
            pad = (-raw.nbytes) % _ALIGN
            self.chunks.append(raw.data)
            if pad:
                self.chunks.append(b"\0" * pad)
            self.size += raw.nbytes + pad
        return self.where[key]

    def blob(self) -> Any:
        """The packed weights as ``fusec.planfile.Chunks``: views of the arrays, never joined here
        (a joined copy would double the weights' memory while a plan compiles)."""
        from fusec.planfile import Chunks

        return Chunks(self.chunks)


def _same_bytes(a: np.ndarray, b: np.ndarray, chunk: int = 16 << 20) -> bool:
    """Byte equality of two uint8 arrays, compared a chunk at a time (memcmp speed, no full copy)."""
    return a.nbytes == b.nbytes and all(a[i:i + chunk].tobytes() == b[i:i + chunk].tobytes()
                                        for i in range(0, a.nbytes, chunk))


class Context:
    """What a node lowering needs: addresses, kernel registration, launch emission."""

    def __init__(self, arch: str, offsets: dict[str, int], compute: str, progress: Callable[[str], None] | None,
                 dry_run: bool = False, arena_base: int = 0, state: dict[str, int] | None = None, sync_base: int = 0):
        # Scratch: a region appended to the arena (starting at arena_base), reused by every node
        # that needs temporary space inside its own lowering (launches run in order).
        self.arena_base = arena_base
        self.scratch_bytes = 0
        # Counters some kernels keep between their blocks (a split attention's "last block merges"),
        # in the state region after the states: zeroed once when the plan's device memory is made,
        # and back to zero when each such kernel ends, so every node can use them from offset 0.
        self.sync_base = sync_base
        self.sync_bytes = 0
        self.dry_run = dry_run  # count launches, compile nothing (for `fusec inspect MODEL`)
        self.arch = arch
        self.offsets = offsets
        self.state = dict(state or {})  # value name -> byte offset in the plan's state region
        self.compute = compute  # "f32" or "tf32": math mode of fp32 matrix products
        self.weights = WeightPacker()
        self.tasks: list[Task] = []
        self.kernels: list[dict[str, Any]] = []
        self.modules: list[dict[str, Any]] = []
        self.blobs: dict[str, bytes] = {}
        self._kernel_index: dict[str, int] = {}
        self._progress = progress
        self.pending: list[tuple[str, Any]] = []  # (blob name, PendingKernel) still compiling
        self.counts: dict[str, int] = {}
        self.launch_bytes: list[int] = []  # per launch: bytes of the distinct values it reads/writes
        self.node = ""  # the node being lowered (its tasks name it)
        # Tasks that write a [B, H, T, D] cache only at rows pos[b] + s, s >= 0: task index -> (the
        # cache's region and shape, the positions' address). See older_rows_stable.
        self._rows_from_pos: dict[int, list[tuple[Region, tuple[int, ...], Addr]]] = {}

    def finish_kernels(self) -> None:
        """Wait for the kernels still compiling and store their cubins (raises the first failure)."""
        for blob, pk in self.pending:
            self.blobs[blob] = pk.result().cubin
        self.pending.clear()

    def addr(self, v: Value) -> Addr:
        if v.is_const:
            return ("weights", self.weights.add(v))
        if v.name in self.state:
            return ("state", self.state[v.name])
        if v.name not in self.offsets:
            raise LoweringError(f"value {v.name!r} has no place in the memory plan")
        return ("arena", self.offsets[v.name])

    def same_storage(self, a: Value, b: Value) -> bool:
        return not a.is_const and not b.is_const and self.addr(a) == self.addr(b)

    def aligned(self, *vals: Value, to: int = 16) -> bool:
        return all(self.addr(v)[1] % to == 0 for v in vals)

    def scratch(self, nbytes: int) -> Raw:
        """Temporary space for the node being lowered (valid until the next node's launches)."""
        self.scratch_bytes = max(self.scratch_bytes, -(-nbytes // _ALIGN) * _ALIGN)
        return Raw("arena", self.arena_base, nbytes)

    def sync(self, nbytes: int) -> Raw:
        """Zeroed counters for the node being lowered (its kernel leaves them zero again)."""
        self.sync_bytes = max(self.sync_bytes, -(-nbytes // _ALIGN) * _ALIGN)
        return Raw("state", self.sync_base, nbytes)

    def wrote_rows_from_pos(self, cache: Value, pos: Value) -> None:
        """Record that the task just emitted writes ``cache`` [B, H, T, D] only at rows pos[b] + s
        (s >= 0) of each batch row b, with the positions read from ``pos``."""
        self._rows_from_pos.setdefault(len(self.tasks) - 1, []).append(
            (self.region(cache), tuple(cache.shape), self.addr(pos)))

    def older_rows_stable(self, caches: Sequence[Value], pos: Value) -> bool:
        """Whether a kernel launched next may read ``pos`` and the rows below pos[b] of each cache
        [B, H, T, D] before its PDL wait: the task it would overlap (the last one emitted; every
        kernel triggers its dependents only after its own wait, so no earlier task still runs)
        writes neither pos nor those rows. It may write a cache at rows pos[b] + s only, from the
        same positions (a cache write or head_rope's cache parts with run-time positions)."""
        if not self.tasks:
            return True
        last = len(self.tasks) - 1
        writes = self.tasks[last].writes
        if any(w.overlaps(self.region(pos)) for w in writes):
            return False
        marked = self._rows_from_pos.get(last, [])
        for c in caches:
            cr = self.region(c)
            for w in writes:
                if w.overlaps(cr) and not any(r == cr and shape == tuple(c.shape) and len(shape) == 4
                                              and paddr == self.addr(pos) and r.offset <= w.offset and w.end <= r.end
                                              for r, shape, paddr in marked):
                    return False
        return True

    @property
    def launches(self) -> list[dict[str, Any]]:
        return [t.record for t in self.tasks]

    def region(self, arg: Value | tuple[Value, int] | Raw) -> Region:
        """The bytes an argument may touch: a value's whole extent (from an element offset into it),
        or a raw address's (its known size, else everything after it in its space)."""
        if isinstance(arg, Raw):
            return Region(arg.space, arg.offset, arg.nbytes or _UNKNOWN_EXTENT)
        v, elems = arg if isinstance(arg, tuple) else (arg, 0)
        space, off = self.addr(v)
        start = elems * v.dtype.itemsize
        return Region(space, off + start, max(int(v.nbytes) - start, 1))

    def emit(self, record: dict[str, Any], reads: list[Any], writes: list[Any], pdl: bool = False) -> None:
        """Append one task (a launch record and the arguments it reads and writes)."""
        # PDL only where the task before is a fusec kernel too (a cuBLAS call or nothing: plain order)
        pdl = pdl and sm90_or_later(self.arch) and bool(self.tasks) and self.tasks[-1].record.get("type") == "kernel"
        self.tasks.append(Task(record, tuple(self.region(a) for a in reads), tuple(self.region(a) for a in writes),
                               self.node, pdl))

    def ptr(self, arg: Value | tuple[Value, int] | Raw) -> list[Any]:
        """A launch argument: a value's address, (value, element offset) into it, or a raw address."""
        if isinstance(arg, Raw):
            return ["ptr", arg.space, arg.offset]
        v, elems = arg if isinstance(arg, tuple) else (arg, 0)
        space, off = self.addr(v)
        return ["ptr", space, off + elems * v.dtype.itemsize]

    def kernel(self, spec: Any, args: list[Value | tuple[Value, int] | Raw], label: str) -> None:
        """Compile ``spec`` (once per distinct kernel) and append its launch over ``args``."""
        from fusec.codegen.kernels import build_async, template_of, written

        if self.dry_run:
            self.emit({"type": "kernel", "label": label}, list(args), [])
            self.launch_bytes.append(_value_bytes(args))
            self.count(template_of(spec).split(".")[0])  # as a compiled launch counts
            return
        ck = build_async(spec, self.arch)  # compiles in the background; lower() collects the cubins
        idx = self._kernel_index.get(ck.name)
        if idx is None:
            if self._progress is not None:
                self._progress(ck.name)
            mid = f"m{len(self.modules)}"
            self.blobs[f"cubin/{mid}"] = b""  # keeps the blob order; filled by finish_kernels()
            self.pending.append((f"cubin/{mid}", ck))
            self.blobs[f"source/{mid}"] = ck.source.encode("utf-8")
            self.modules.append({"id": mid, "cubin": f"cubin/{mid}", "source": f"source/{mid}", "entry": ck.name,
                                 "template": ck.template})
            idx = len(self.kernels)
            self.kernels.append({"module": mid, "entry": ck.name, "smem": ck.shared_mem})
            self._kernel_index[ck.name] = idx
        else:  # a kernel this plan has already: the future of its first use is the one collected
            from fusec.codegen.compile import abandon

            abandon([ck.future])
        if len(args) != len(ck.params):
            raise LoweringError(f"{label}: kernel {ck.name} takes {len(ck.params)} pointers, lowering gave {len(args)}")
        out = set(written(ck.params))
        self.emit({"type": "kernel", "kernel": idx, "grid": list(ck.grid), "block": list(ck.block),
                   "smem": ck.shared_mem, "args": [self.ptr(a) for a in args], "label": label},
                  [a for i, a in enumerate(args) if i not in out], [a for i, a in enumerate(args) if i in out], ck.pdl)
        self.launch_bytes.append(_value_bytes(args))
        self.count(ck.template.split(".")[0])

    def gemm(self, fields: dict[str, Any], a: Value, b: Value, c: Value | tuple[Value, int] | Raw, label: str,
             extra_reads: tuple[Value | Raw, ...] = ()) -> None:
        self.emit({"type": "gemm", **fields, "a": list(self.addr(a)), "b": list(self.addr(b)),
                   "c": self.ptr(c)[1:], "label": label}, [a, b, *extra_reads], [c])
        self.launch_bytes.append(_value_bytes([a, b, c]))  # the bench adds a cuBLASLt bias/residual
        self.count("cublas_gemm")

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


def lower(graph: Graph, offsets: dict[str, int], arch: str, compute: str = "f32",
          progress: Callable[[str], None] | None = None, dry_run: bool = False, arena_base: int = 0,
          choices: dict[str, str] | None = None, state: dict[str, int] | None = None,
          shared: Lowered | None = None, sync_base: int = 0) -> Lowered:
    """Lower every node of ``graph`` (in order) against the memory plan's ``offsets``.
    ``dry_run``: decide every launch but compile nothing (the launch records are placeholders).
    ``choices``: {choice key: variant} for nodes with alternative kernels (``fusec.lower.choices``);
    absent keys lower as by default. ``state``: {value name: byte offset in the state region} for
    the values the memory plan stores in state. ``shared``: an earlier entry point of the same plan,
    whose weights, kernels and modules this one reuses (one weights buffer, each kernel compiled once).
    A state update that the memory plan did not store in its state is copied there last."""
    from fusec.lower.nodes import lower_node

    if any(n.kernel is None for n in graph.nodes):  # a graph that skipped the pipeline: the same pass selects
        from fusec.passes import select_kernels
        from fusec.passes.base import PassOptions

        graph = select_kernels.run(graph, PassOptions(choices=dict(choices or {}), clusters=sm90_or_later(arch))).graph

    ctx = Context(arch, offsets, compute, progress, dry_run, -(-arena_base // _ALIGN) * _ALIGN, state, sync_base)
    if shared is not None:
        ctx.weights, ctx.kernels, ctx.modules, ctx.blobs = shared.packer, shared.kernels, shared.modules, shared.blobs
        ctx._kernel_index = {k["entry"]: i for i, k in enumerate(shared.kernels)}
    try:
        for i, node in enumerate(graph.nodes):
            ctx.node = node.name
            if not _gpu_ready(ctx, node, _label(i, node)):
                continue
            lower_node(ctx, node, label=_label(i, node))  # as passes/select_kernels.py decided
        ctx.node = ""
        _write_back_state(ctx, graph)
        weights = ctx.weights.blob()  # packed while the kernels compile
        if weights:
            ctx.blobs["weights"] = weights
        ctx.finish_kernels()
    except BaseException:  # an error or Ctrl-C: the compiles still queued are not wanted
        from fusec.codegen.compile import abandon

        abandon([pk.future for _, pk in ctx.pending])
        raise
    launches = [t.to_json() for t in ctx.tasks]
    report = {"launches": len(launches), "kernels_compiled": len(ctx.kernels), "by_template": dict(sorted(ctx.counts.items()))}
    report["scratch_bytes"] = ctx.scratch_bytes
    report["launch_bytes"] = ctx.launch_bytes  # minimum bytes per launch (fusec bench --per-kernel)
    if choices:
        report["choices"] = _explicit_choices(graph, choices)
    return Lowered(launches, ctx.kernels, ctx.modules, ctx.blobs, ctx.weights.size, ctx.scratch_bytes, report,
                   ctx.weights, ctx.sync_bytes)


def _explicit_choices(graph: Graph, choices: dict[str, str]) -> dict[str, dict[str, str]]:
    """Which explicitly asked-for variants the selection applied, and why the others were not."""
    applied: dict[str, str] = {}
    declined: dict[str, str] = {}
    for n in graph.nodes:
        sel = n.kernel
        if sel is None or not sel.key or sel.key not in choices:
            continue
        if sel.variant == choices[sel.key] and sel.reason == "explicit choice":
            applied[sel.key] = sel.variant
        else:
            declined[sel.key] = f"variant {choices[sel.key]!r} not applied: {sel.reason}"
    return {"applied": applied, "declined": declined}


def _write_back_state(ctx: Context, graph: Graph) -> None:
    """Copy each state update that lives outside its state (e.g. ``pos + 1`` in the arena) into it."""
    from fusec.codegen.copyspecs import CopySpec

    for src, dst in graph.state_pairs():
        if dst is src or ctx.addr(dst) == ctx.addr(src):
            continue
        n = dst.numel
        ctx.kernel(CopySpec(dst.dtype, (n,), (1,), (1,)), [dst, Raw(*ctx.addr(src), src.nbytes)],
                   f"state {src.name!r} <- update")


def _gpu_ready(ctx: Context, node: Node, label: str) -> bool:
    """False for a node with nothing to compute (every output empty); a LoweringError naming the op
    and dtype for a value generated CUDA has no type for (fp64, 8/16-bit and unsigned integers run
    on the reference backend only), or for an empty input of a node whose output is not empty."""
    body = node.attrs.body.nodes if node.op.value == "fused" else [node]
    for n in body:
        for v in (*n.inputs, *n.outputs):
            if n.op.value in ("qmatmul", "qgather") and v in n.inputs[1:]:
                continue  # packed weights (u8 codes...): read by the quantized kernels' own types
            if not v.dtype.on_gpu:
                raise LoweringError(f"{label}: {n.op.value} on {v.dtype.value} has no GPU lowering "
                                    "(that dtype runs on the reference backend only)")
    if node.outputs and all(o.numel == 0 for o in node.outputs):
        ctx.count("empty")
        return False
    if any(v.numel == 0 for v in node.inputs):
        raise LoweringError(f"{label}: {node.op.value} of an empty (zero-size) input has no GPU lowering")
    return True


def _value_bytes(args: list[Any]) -> int:
    """Bytes of the distinct values a launch touches (each read or written once: its minimum
    traffic); raw scratch addresses are not counted."""
    seen = {id(v): v for a in args if not isinstance(a, Raw) for v in [a[0] if isinstance(a, tuple) else a]}
    return sum(int(v.nbytes) for v in seen.values())


def _label(i: int, node: Node) -> str:
    # Labels are for people (inspect, profiles); they never reach generated source.
    return f"#{i} {node.op.value}"


__all__ = ["Context", "Lowered", "LoweringError", "Raw", "lower"]
