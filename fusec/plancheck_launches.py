"""The launch records of a plan's entries, checked as hostile input (``fusec.plancheck.validate``
calls ``check_entry`` per entry point): its input/output signatures inside the arena, each kernel launch's
kernel index, grid, block, shared memory and pointer arguments, each GEMM's sizes, strides, dtypes and
epilogue, every pointer range inside its region. Every failure is one ``PlanFileError`` naming the field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fusec.plancheck_fields import (
    DTYPES,
    GEMM_COMPUTE,
    GEMM_DTYPES,
    GEMM_KEYS,
    GEMM_OPTIONAL,
    KERNEL_LAUNCH_KEYS,
    MAX_BLOCK,
    MAX_BYTES,
    MAX_GRID,
    MAX_SMEM,
    MAX_THREADS,
    SCALARS,
    SIG_KEYS,
    FieldCheck,
    _kind,
    _shown,
)


def sig_bytes(c: FieldCheck, rec: Mapping[str, Any], f: str) -> int:
    dims = c.shape(rec["shape"], f"{f}.shape")
    n = DTYPES[c.choice(rec["dtype"], f"{f}.dtype", DTYPES)]
    for d in dims:
        n *= d
    if n > MAX_BYTES:
        raise c.fail(f"{f}.shape", f"{dims} is larger than {MAX_BYTES} bytes")
    return n


def check_entry(c: FieldCheck, e: Mapping[str, Any], kernels: list[Any], limits: Mapping[str, int],
                prefix: str) -> None:
    arena_only = {"arena": limits["arena"]}
    for sig in ("inputs", "outputs"):
        names = set()
        for i, d in enumerate(c.arr(e[sig], f"{prefix}{sig}", 100000)):
            f = f"{prefix}{sig}[{i}]"
            d = c.obj(d, f, SIG_KEYS, ("name", "shape", "dtype", "offset"))
            name = c.str(d["name"], f"{f}.name")
            if name in names:
                raise c.fail(f"{f}.name", f"{_shown(name)} appears twice")
            names.add(name)
            nbytes = sig_bytes(c, d, f)
            if d.get("bound") is not None:
                c.int(d["bound"], f"{f}.bound", 0, 2**62)
            off = c.int(d["offset"], f"{f}.offset")
            c.span("arena", off, nbytes, arena_only, f"{f}.offset")
    for i, L in enumerate(c.arr(e["launches"], f"{prefix}launches", 10**6)):
        f = f"{prefix}launches[{i}]"
        L = c.obj(L, f)
        if L.get("type") == "kernel":
            L = c.obj(L, f, KERNEL_LAUNCH_KEYS, ("kernel", "grid", "block", "args"))
            kid = c.int(L["kernel"], f"{f}.kernel", 0, 2**31)
            if kid >= len(kernels):
                raise c.fail(f"{f}.kernel", f"launch #{i}: kernel index out of range ({kid}; the plan has "
                                            f"{len(kernels)} kernels)")
            grid = c.arr(L["grid"], f"{f}.grid", 3)
            block = c.arr(L["block"], f"{f}.block", 3)
            if len(grid) != 3 or len(block) != 3:
                raise c.fail(f"{f}.grid", "grid and block must have 3 dims")
            for j in range(3):
                c.int(grid[j], f"{f}.grid[{j}]", 1, MAX_GRID[j])
                c.int(block[j], f"{f}.block[{j}]", 1, MAX_BLOCK[j])
            if block[0] * block[1] * block[2] > MAX_THREADS:
                raise c.fail(f"{f}.block", f"{block} has more than {MAX_THREADS} threads")
            c.int(L.get("smem", 0), f"{f}.smem", 0, MAX_SMEM)
            if not isinstance(L.get("pdl", False), bool):
                raise c.fail(f"{f}.pdl", f"must be true or false, got {_kind(L['pdl'])}")
            _regions(c, L, limits, f)
            if "label" in L:
                c.str(L["label"], f"{f}.label")
            for j, a in enumerate(c.arr(L["args"], f"{f}.args", 4096)):
                fa = f"{f}.args[{j}]"
                a = c.arr(a, fa, 3)
                if not a or not isinstance(a[0], str):
                    raise c.fail(fa, "must be [kind, ...]")
                if a[0] == "ptr":
                    if len(a) != 3 or not isinstance(a[1], str):
                        raise c.fail(fa, 'a pointer is ["ptr", space, offset]')
                    c.span(a[1], c.int(a[2], fa), 1, limits, fa)  # at least its first byte inside
                elif a[0] in SCALARS:
                    if len(a) != 2:
                        raise c.fail(fa, "a scalar is [type, value]")
                    rng = SCALARS[a[0]]
                    if rng is None:
                        if isinstance(a[1], bool) or not isinstance(a[1], (int, float)):
                            raise c.fail(fa, f"must be a number, got {_kind(a[1])}")
                    else:
                        c.int(a[1], fa, *rng)
                else:
                    raise c.fail(fa, f"unknown argument kind {_shown(a[0])}")
        elif L.get("type") == "gemm":
            L = c.obj(L, f, GEMM_KEYS, tuple(k for k in GEMM_KEYS if k not in GEMM_OPTIONAL))
            _gemm(c, L, limits, f)
            _regions(c, L, limits, f)
        else:
            raise c.fail(f"{f}.type", f"unknown launch type {_shown(L.get('type'))}")


def _gemm(c: FieldCheck, L: Mapping[str, Any], limits: Mapping[str, int], f: str) -> None:
    """A row-major strided-batched GEMM's operands lie inside their regions (see fusec.runtime.cublas)."""
    i32 = 2**31 - 1
    m, n, k = (c.int(L[x], f"{f}.{x}", 1, i32) for x in ("m", "n", "k"))
    batch = c.int(L["batch"], f"{f}.batch", 1, i32)
    lda, ldb, ldc = (c.int(L[x], f"{f}.{x}", 1, i32) for x in ("lda", "ldb", "ldc"))
    sa, sb, sc = (c.int(L[x], f"{f}.{x}", 0, 2**62) for x in ("stride_a", "stride_b", "stride_c"))
    ta, tb = c.bool(L["trans_a"], f"{f}.trans_a"), c.bool(L["trans_b"], f"{f}.trans_b")
    c.choice(L["dtype"], f"{f}.dtype", GEMM_DTYPES)
    c.choice(L["compute"], f"{f}.compute", GEMM_COMPUTE)
    for x in ("alpha", "beta"):
        if x in L and (isinstance(L[x], bool) or not isinstance(L[x], (int, float))):
            raise c.fail(f"{f}.{x}", f"must be a number, got {_kind(L[x])}")
    size = GEMM_DTYPES[L["dtype"]]
    # (rows, cols) as stored, row-major with the given leading dimension
    shapes = {"a": ((k, m) if ta else (m, k), lda, sa), "b": ((n, k) if tb else (k, n), ldb, sb),
              "c": ((m, n), ldc, sc)}
    for x, ((rows, cols), ld, stride) in shapes.items():
        fx = f"{f}.{x}"
        op = c.arr(L[x], fx, 2)
        if len(op) != 2 or not isinstance(op[0], str):
            raise c.fail(fx, "an operand is [space, offset]")
        if ld < cols:
            raise c.fail(f"{f}.ld{x}", f"{ld} is less than the operand's {cols} columns")
        extent = ((batch - 1) * stride + (rows - 1) * ld + cols) * size
        c.span(op[0], c.int(op[1], fx), extent, limits, fx)
    _gemm_epilogue(c, L, limits, f, n * size, ((batch - 1) * sc + (m - 1) * ldc + n) * size)


def _gemm_epilogue(c: FieldCheck, L: Mapping[str, Any], limits: Mapping[str, int], f: str, bias_bytes: int,
                   c_bytes: int) -> None:
    """cuBLASLt fields (fusec.runtime.cublaslt): a known epilogue, a bias of N elements exactly when
    the epilogue adds one, and a C input shaped like C."""
    from fusec.runtime.cublaslt import EPILOGUES, WITH_BIAS

    epi = L.get("epilogue")
    if epi is not None:
        c.choice(epi, f"{f}.epilogue", EPILOGUES)
    if (epi in WITH_BIAS) != ("bias" in L):
        raise c.fail(f"{f}.bias", f"epilogue {_shown(epi)} {'needs' if epi in WITH_BIAS else 'takes no'} bias")
    for x, nbytes in (("bias", bias_bytes), ("c_in", c_bytes)):
        if x in L:
            op = c.arr(L[x], f"{f}.{x}", 2)
            if len(op) != 2 or not isinstance(op[0], str):
                raise c.fail(f"{f}.{x}", "an operand is [space, offset]")
            c.span(op[0], c.int(op[1], f"{f}.{x}"), nbytes, limits, f"{f}.{x}")


def _regions(c: Any, L: Mapping[str, Any], limits: Any, f: str) -> None:
    """A launch's read/write regions (fusec.program): [space, offset, nbytes], each starting inside
    its space (an extent may run past it: a raw scratch address of unknown size)."""
    for key in ("reads", "writes"):
        for j, r in enumerate(c.arr(L.get(key, []), f"{f}.{key}", 4096)):
            fr = f"{f}.{key}[{j}]"
            r = c.arr(r, fr, 3)
            if len(r) != 3 or not isinstance(r[0], str):
                raise c.fail(fr, "a region is [space, offset, nbytes]")
            c.span(r[0], c.int(r[1], fr), 1, limits, fr)
            c.int(r[2], fr, 1, 2**41)
