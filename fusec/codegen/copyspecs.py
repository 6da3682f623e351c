"""The generic index-mapping kernel's spec, and constructors for every data-movement op.

Each constructor returns the specs to launch in order, with what each launch binds (src and dst
are the op's input and output unless said otherwise), so that every INJECTIVE/OPAQUE movement op
of fusec.ops has a GPU path.
"""

from __future__ import annotations

import dataclasses
import math

from fusec.codegen.specs import contiguous_strides
from fusec.dtypes import DType


_INT32_MAX = (1 << 31) - 1
FLAT_FAST_PATH = True  # benchmarks/unpad_lt.py turns it off in-process for its before/after


def _req(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class IndexMap:
    """Index tuples read from an int tensor: component j of the tuple for iteration point c is at
    sum(c_d * strides_d) + j * comp_stride; it indexes a data axis of size dims[j] and stride
    axis_strides[j]. Negative values count from the end; out-of-range ones are not followed."""

    dtype: DType
    strides: tuple[int, ...]
    comp_stride: int
    dims: tuple[int, ...]
    axis_strides: tuple[int, ...]

    def __post_init__(self) -> None:
        _req(self.dtype in (DType.I32, DType.I64), "indices are int32/int64")
        _req(len(self.dims) == len(self.axis_strides) >= 1, "one dim and stride per index component")
        _req(all(d >= 1 for d in self.dims), "indexed axes must be non-empty")


@dataclasses.dataclass(frozen=True)
class CopySpec:
    """Params: src, [index], dst. See templates/copy.cu.jinja for the mapping."""

    dtype: DType
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src_offset: int = 0
    dst_offset: int = 0
    src_mod: tuple[int, ...] = ()  # per dim; 0 = none (tile takes coordinates modulo the input dim)
    index: IndexMap | None = None
    scatter: bool = False  # the index addresses dst instead of src
    trilu: tuple[bool, int, int, int] | None = None  # (upper, k, row_dim, col_dim): zero the rest

    def __post_init__(self) -> None:
        r = len(self.shape)
        _req(all(isinstance(d, int) and d >= 0 for d in self.shape), "shape must be non-negative ints")
        _req(len(self.src_strides) == r and len(self.dst_strides) == r, "one stride per dim")
        _req(not self.src_mod or len(self.src_mod) == r, "src_mod needs one entry per dim")
        _req(self.index is None or len(self.index.strides) == r, "index strides need one entry per dim")
        _req(not self.scatter or self.index is not None, "a scatter needs an index")
        _req(self.trilu is None or self.index is None, "trilu takes no index")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class FlatRows:
    """A copy whose output is contiguous and whose source is rows of a wider (or equal) array:
    flat output element f = row * width + col reads src_offset + row * src_row_stride + col.
    The copy kernel's fast path (templates/copy.cu.jinja): each warp takes a tile of
    ``32 * per_lane`` consecutive output elements, loads them with coalesced scalar loads (lane l
    reads tile elements i * 32 + l, ``per_lane`` loads in flight per thread), stages them in shared
    memory and stores them as 16-byte vectors (two per lane); the output row stride may be odd.
    ``col_64``: the in-tile column ``col0 + k`` (< width + tile) needs 64 bits."""

    rows: int
    width: int
    src_row_stride: int
    total: int
    vec: int  # elements per 16-byte vector
    per_lane: int  # elements each lane moves per tile (2 vectors)

    @property
    def tile(self) -> int:
        return 32 * self.per_lane

    @property
    def tiles(self) -> int:
        return -(-self.total // self.tile)

    @property
    def col_64(self) -> bool:
        return self.width + self.tile > _INT32_MAX

    def index_bound(self, warps: int) -> int:
        """A bound of every flat index the grid-stride loop forms (a tile base below ``total``
        plus one stride of at most ``tiles + warps`` tiles; see ``flat_ctx``'s grid)."""
        return (2 * self.tiles + warps) * self.tile


def _collapse(shape: tuple[int, ...], *strides: tuple[int, ...]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous in every stride list."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    out_shape: list[int] = []
    out_strides: list[list[int]] = [[] for _ in strides]
    for d in dims:
        if out_shape and all(ss[-1] == shape[d] * s[d] for ss, s in zip(out_strides, strides)):
            out_shape[-1] *= shape[d]
            for ss, s in zip(out_strides, strides):
                ss[-1] = s[d]
        else:
            out_shape.append(shape[d])
            for ss, s in zip(out_strides, strides):
                ss.append(s[d])
    return out_shape, out_strides


def flat_rows(spec: CopySpec) -> FlatRows | None:
    """The fast path's parameters when ``spec`` is a plain strided read into a contiguous output
    whose rows are contiguous in the source (a SLICE on the last axis such as the unpad of padded
    logits, a contiguous copy, a slice of middle axes that leaves the inner ones whole); else None."""
    if not FLAT_FAST_PATH or spec.index is not None or spec.scatter or spec.trilu is not None \
            or any(spec.src_mod) or spec.numel == 0:
        return None
    shape, (src, dst) = _collapse(spec.shape, spec.src_strides, spec.dst_strides)
    if not shape:  # a single element
        shape, src, dst = [1], [1], [1]
    if dst != list(contiguous_strides(tuple(shape))) or src[-1] != 1 or len(shape) > 2:
        return None
    width = shape[-1]
    rows = shape[0] if len(shape) == 2 else 1
    row_stride = src[0] if len(shape) == 2 else width
    vec = max(1, 16 // spec.dtype.itemsize)
    return FlatRows(rows, width, row_stride, spec.numel, vec, 2 * vec)


def flat_ctx(spec: CopySpec, block: int) -> tuple[dict | None, int]:
    """(template context of the fast path or None, threads to launch) for the copy kernel."""
    from fusec.codegen.render import ctype

    fr = flat_rows(spec)
    if fr is None:
        return None, spec.numel
    warps = block // 32
    ctx = {"width": fr.width, "row_stride": fr.src_row_stride, "vec": fr.vec, "per_lane": fr.per_lane,
           "tile": fr.tile, "warps": warps, "vecs": fr.per_lane // fr.vec,
           "idx_t": ctype(DType.I32 if fr.index_bound(warps) <= _INT32_MAX else DType.I64),
           # source offsets relative to src + src_offset, formed for lanes past the end too (not read)
           "src_t": ctype(DType.I32 if 0 <= fr.src_row_stride and fr.rows * fr.src_row_stride + fr.width
                          + fr.tile <= _INT32_MAX else DType.I64),
           "col_t": ctype(DType.I64 if fr.col_64 else DType.I32)}
    return ctx, fr.tiles * 32


def contiguous(shape: tuple[int, ...], dtype: DType) -> CopySpec:
    cs = contiguous_strides(shape)
    return CopySpec(dtype, shape, cs, cs)


def transpose(shape: tuple[int, ...], perm: tuple[int, ...], dtype: DType) -> CopySpec:
    ins = contiguous_strides(shape)
    out_shape = tuple(shape[p] for p in perm)
    return CopySpec(dtype, out_shape, tuple(ins[p] for p in perm), contiguous_strides(out_shape))


def slice_(shape: tuple[int, ...], axes: tuple[int, ...], starts: tuple[int, ...], ends: tuple[int, ...],
           steps: tuple[int, ...], dtype: DType) -> CopySpec:
    ins = contiguous_strides(shape)
    out_shape, src_strides, off = list(shape), list(ins), 0
    for ax, s, e, st in zip(axes, starts, ends, steps):
        out_shape[ax] = len(range(s, e, st))
        src_strides[ax] = ins[ax] * st
        off += s * ins[ax] if out_shape[ax] else 0
    return CopySpec(dtype, tuple(out_shape), tuple(src_strides), contiguous_strides(tuple(out_shape)), src_offset=off)


def expand(in_shape: tuple[int, ...], out_shape: tuple[int, ...], dtype: DType) -> CopySpec:
    full = (1,) * (len(out_shape) - len(in_shape)) + tuple(in_shape)
    cs = contiguous_strides(full)
    src = tuple(0 if full[d] == 1 else cs[d] for d in range(len(out_shape)))
    return CopySpec(dtype, tuple(out_shape), src, contiguous_strides(tuple(out_shape)))


def tile(shape: tuple[int, ...], repeats: tuple[int, ...], dtype: DType) -> CopySpec:
    out_shape = tuple(d * r for d, r in zip(shape, repeats))
    return CopySpec(dtype, out_shape, contiguous_strides(shape), contiguous_strides(out_shape),
                    src_mod=tuple(shape))


def concat(shapes: list[tuple[int, ...]], axis: int, dtype: DType) -> list[CopySpec]:
    """One launch per input i (src = input i, dst = the output), each writing its slab."""
    out_shape = list(shapes[0])
    out_shape[axis] = sum(s[axis] for s in shapes)
    ocs = contiguous_strides(tuple(out_shape))
    specs, start = [], 0
    for s in shapes:
        specs.append(CopySpec(dtype, tuple(s), contiguous_strides(tuple(s)), ocs, dst_offset=start * ocs[axis]))
        start += s[axis]
    return specs


def gather(data_shape: tuple[int, ...], idx_shape: tuple[int, ...], axis: int, dtype: DType,
           idx_dtype: DType) -> CopySpec:
    ds = contiguous_strides(data_shape)
    ics = contiguous_strides(idx_shape)
    out_shape = data_shape[:axis] + tuple(idx_shape) + data_shape[axis + 1:]
    ni, post = len(idx_shape), len(data_shape) - axis - 1
    src = ds[:axis] + (0,) * ni + ds[axis + 1:]
    istr = (0,) * axis + ics + (0,) * post
    im = IndexMap(idx_dtype, istr, 0, (data_shape[axis],), (ds[axis],))
    return CopySpec(dtype, out_shape, src, contiguous_strides(out_shape), index=im)


def gather_elements(data_shape: tuple[int, ...], idx_shape: tuple[int, ...], axis: int, dtype: DType,
                    idx_dtype: DType) -> CopySpec:
    ds = contiguous_strides(data_shape)
    src = tuple(0 if d == axis else ds[d] for d in range(len(data_shape)))
    im = IndexMap(idx_dtype, contiguous_strides(idx_shape), 0, (data_shape[axis],), (ds[axis],))
    return CopySpec(dtype, tuple(idx_shape), src, contiguous_strides(tuple(idx_shape)), index=im)


def gather_nd(data_shape: tuple[int, ...], idx_shape: tuple[int, ...], batch_dims: int, dtype: DType,
              idx_dtype: DType) -> CopySpec:
    b, k = batch_dims, idx_shape[-1]
    ds = contiguous_strides(data_shape)
    ics = contiguous_strides(idx_shape)
    lead = len(idx_shape) - 1
    tail = data_shape[b + k:]
    out_shape = tuple(idx_shape[:-1]) + tuple(tail)
    src = tuple(ds[:b]) + (0,) * (lead - b) + tuple(ds[b + k:])
    istr = tuple(ics[:-1]) + (0,) * len(tail)
    im = IndexMap(idx_dtype, istr, 1, tuple(data_shape[b:b + k]), tuple(ds[b:b + k]))
    return CopySpec(dtype, out_shape, src, contiguous_strides(out_shape), index=im)


def scatter_nd(data_shape: tuple[int, ...], idx_shape: tuple[int, ...], dtype: DType,
               idx_dtype: DType) -> list[CopySpec]:
    """Two launches: (data -> out) copy, then (updates -> out) scatter with the index tensor.
    Duplicate indices leave one of the updates (ONNX leaves the order unspecified)."""
    k = idx_shape[-1]
    ds = contiguous_strides(data_shape)
    upd_shape = tuple(idx_shape[:-1]) + tuple(data_shape[k:])
    lead = len(idx_shape) - 1
    dst = (0,) * lead + tuple(ds[k:])
    istr = tuple(contiguous_strides(idx_shape)[:-1]) + (0,) * (len(data_shape) - k)
    im = IndexMap(idx_dtype, istr, 1, tuple(data_shape[:k]), tuple(ds[:k]))
    scatter = CopySpec(dtype, upd_shape, contiguous_strides(upd_shape), dst, index=im, scatter=True)
    return [contiguous(tuple(data_shape), dtype), scatter]


def trilu(shape: tuple[int, ...], upper: bool, k: int, dtype: DType) -> CopySpec:
    cs = contiguous_strides(shape)
    r = len(shape)
    return CopySpec(dtype, tuple(shape), cs, cs, trilu=(bool(upper), int(k), r - 2, r - 1))
