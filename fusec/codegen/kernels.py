"""Spec -> rendered source -> CUBIN -> ``CompiledKernel`` (name, binary, launch geometry, params),
and ``launch`` through CuPy.

``build(spec, arch)`` needs no GPU. All sizes are compile-time constants of the source (fusec's
shapes are static), so a launch passes only pointers, in the order the spec documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from fusec.codegen.compile import Binary, compile_cuda_async
from fusec.codegen.render import CType, Ident, ctype, render
from fusec.dtypes import DType

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    name: str
    template: str
    source: str
    binary: Binary
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int  # dynamic bytes
    params: tuple[str, ...]  # pointer parameters, in launch order
    pdl: bool = False  # waits for the kernel before it in-kernel (fc_pdl_wait): may be launched overlapping it

    @property
    def cubin(self) -> bytes:
        return self.binary.cubin


def kernel_name(kind: str, spec: Any) -> Ident:
    """A deterministic identifier from the spec's repr (specs hold only fusec-made values)."""
    return Ident(f"fc_{kind}_{hashlib.sha256(repr(spec).encode()).hexdigest()[:12]}")


def idx_type(*extents: int) -> CType:
    """32-bit index math where every offset fits (cheaper), else 64-bit."""
    return ctype(DType.I32 if max(extents, default=0) <= _INT32_MAX else DType.I64)


# Output parameters are named so (every builder follows it): what a launch writes, for the program's
# read/write regions (fusec.program).
_WRITTEN = ("out", "C", "part", "sum_out", "dst", "dual", "sync")


def written(params: Sequence[str]) -> tuple[int, ...]:
    """Indices of the parameters a kernel writes (out*, C, part, sum_out, dst, dual*, sync)."""
    return tuple(i for i, p in enumerate(params) if p in _WRITTEN or p.startswith(("out", "dual")))


def waits_in_kernel(source: str) -> bool:
    """Whether the kernel itself (after its pasted helper headers) calls fc_pdl_wait(): only such a
    kernel may be launched overlapping the one before it."""
    body = source.rsplit("// ---- end ", 1)[-1]
    return "fc_pdl_wait();" in body or "fc_pdl_wait_after(" in body


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Rendered:
    template: str
    ctx: dict[str, Any]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    params: tuple[str, ...]
    shared_mem: int = 0


_BUILDERS: dict[type, Callable[[Any], Rendered]] = {}


def builder(spec_type: type) -> Callable[[Callable[[Any], Rendered]], Callable[[Any], Rendered]]:
    def deco(fn: Callable[[Any], Rendered]) -> Callable[[Any], Rendered]:
        _BUILDERS[spec_type] = fn
        return fn

    return deco


def prepare(spec: Any) -> tuple[Rendered, str]:
    """Render a spec's kernel: (geometry and params, CUDA source). No compilation."""
    _load_builders()
    fn = _BUILDERS.get(type(spec))
    if fn is None:
        raise TypeError(f"no kernel template for {type(spec).__name__}")
    r = fn(spec)
    return r, render(r.template, **r.ctx)


def template_of(spec: Any) -> str:
    """The template a spec renders (its geometry computed, nothing rendered or compiled)."""
    _load_builders()
    fn = _BUILDERS.get(type(spec))
    if fn is None:
        raise TypeError(f"no kernel template for {type(spec).__name__}")
    return fn(spec).template


def build(spec: Any, arch: str | None = None) -> CompiledKernel:
    return build_async(spec, arch).result()


@dataclasses.dataclass(frozen=True)
class PendingKernel:
    """A rendered kernel whose CUBIN is still compiling: everything a launch record needs now
    (name, geometry, params), the binary from ``result()``."""

    name: str
    template: str
    source: str
    future: Future[Binary]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    params: tuple[str, ...]
    pdl: bool = False

    def result(self) -> CompiledKernel:
        """Waits for the compile; raises its KernelCompileError."""
        return CompiledKernel(self.name, self.template, self.source, self.future.result(), self.grid, self.block,
                              self.shared_mem, self.params, self.pdl)


def build_async(spec: Any, arch: str | None = None) -> PendingKernel:
    """Render ``spec`` and start compiling it (``compile_cuda_async``: in parallel with other
    kernels; an identical source compiles once)."""
    r, source = prepare(spec)
    name = str(r.ctx["name"])
    future = compile_cuda_async(source, name, arch)
    return PendingKernel(name, r.template, source, future, r.grid, r.block, r.shared_mem, r.params,
                         waits_in_kernel(source))


def _load_builders() -> None:
    # the per-template builders register themselves on import
    from fusec.codegen import build_attention, build_gemm, build_misc  # noqa: F401
    from fusec.codegen import build_decode, build_heads, build_mlp, build_quant, build_topk, build_train  # noqa: F401


# ---- launching (GPU only) --------------------------------------------------------------------

_MODULES: dict[str, Any] = {}


def load(ck: CompiledKernel) -> Any:
    """The CuPy function of a compiled kernel, loaded once per process (per current device)."""
    import cupy

    key = f"{cupy.cuda.Device().id}:{ck.binary.key}:{ck.name}"
    entry = _MODULES.get(key)
    if entry is None:
        mod = cupy.cuda.function.Module()
        mod.load(ck.cubin)
        fn = mod.get_function(ck.name)
        if ck.shared_mem > 0:  # opt in: without it, static + dynamic shared memory must stay within 48 KB
            from cupy.cuda import driver

            driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ck.shared_mem)
        entry = (mod, fn)  # keep the module alive as long as its function
        _MODULES[key] = entry
    return entry[1]


def launch(ck: CompiledKernel, args: Sequence[Any], stream: Any = None) -> None:
    """Launch with one argument per ``ck.params`` (CuPy arrays, or raw device pointers as ints)."""
    if len(args) != len(ck.params):
        raise ValueError(f"kernel {ck.name} takes {len(ck.params)} arguments ({', '.join(ck.params)}), got {len(args)}")
    fn = load(ck)
    fn(ck.grid, ck.block, tuple(args), shared_mem=ck.shared_mem, stream=stream)
