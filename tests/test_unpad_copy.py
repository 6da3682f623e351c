"""The copy kernel's fast path for a contiguous output read from rows of a wider array (the unpad
of padded logits, fusec.codegen.copyspecs.FlatRows): which specs take it, its rendering and NVRTC
compile, a numpy emulation of its index arithmetic (tiles, lanes, typed intermediates) against the
generic mapping over awkward shapes, a pure-python overflow check near 2^31 elements, and (GPU)
the kernel against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.codegen import copyspecs as C
from fusec.codegen import kernels as K
from fusec.dtypes import DType

F16, BF16, F32, I64, BOOL = DType.F16, DType.BF16, DType.F32, DType.I64, DType.BOOL
_RANGE = {"int": (-(1 << 31), (1 << 31) - 1), "long long": (-(1 << 63), (1 << 63) - 1)}


def _unpad(rows: int, npad: int, n: int, dt: DType) -> C.CopySpec:
    return C.slice_((rows, npad), (1,), (0,), (n,), (1,), dt)


def _typed(v: int, t: str, what: str) -> int:
    lo, hi = _RANGE[t]
    assert lo <= v <= hi, f"{what} = {v} overflows {t}"
    return v


def emulate(spec: C.CopySpec, src: np.ndarray) -> np.ndarray:
    """What the fast path writes, computed the way the kernel computes it: for each warp of the
    launched grid, its grid-stride tiles; per tile the lanes' source offsets (typed intermediates
    checked against their C types) and the tile's store (vector or element-wise: the same values)."""
    r, _ = K.prepare(spec)
    flat = r.ctx["flat"]
    assert flat is not None
    total, width, rs, tile, warps = spec.numel, flat["width"], flat["row_stride"], flat["tile"], flat["warps"]
    it, ct, st = str(flat["idx_t"]), str(flat["col_t"]), str(flat["src_t"])
    out = np.full(total, -7, dtype=src.dtype)
    grid = r.grid[0]
    stride = _typed(grid * warps * tile, it, "stride")
    lanes = np.arange(32, dtype=np.int64)
    for gw in range(grid * warps):
        base = _typed(gw * tile, it, "first base")
        while base < total:
            row0 = base // width
            col0 = _typed(base - row0 * width, ct, "col0")
            got = np.empty(tile, dtype=src.dtype)
            for i in range(flat["per_lane"]):
                c = col0 + i * 32 + lanes
                _typed(int(c.max()), ct, "c")
                dr = c // width
                so = (row0 + dr) * rs + (c - dr * width)
                _typed(int(so.max()), st, "source offset")
                so = so + spec.src_offset
                f = base + i * 32 + lanes
                ok = f < total
                got[i * 32 + lanes[ok]] = src[so[ok]]
            n = min(tile, total - base)
            out[base:base + n] = got[:n]
            base = _typed(base + stride, it, "next base")
    return out


def reference(spec: C.CopySpec, src: np.ndarray) -> np.ndarray:
    """The generic mapping (copy.cu.jinja's slow path) in numpy."""
    idx = np.full(spec.shape, spec.src_offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(spec.shape, spec.src_strides)):
        sh = [1] * len(spec.shape)
        sh[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(sh)
    return src[idx.reshape(-1)]


AWKWARD = [
    _unpad(16, 50264, 50257, F16),  # GPT-2's logits, 16 of the 1024 rows
    _unpad(7, 13, 11, F16),
    _unpad(5, 8, 3, F16),  # N < vector width
    _unpad(1, 40, 37, F32),  # one row
    _unpad(33, 9, 2, F16),  # two columns
    _unpad(3, 1031, 1030, BOOL),
    _unpad(19, 21, 17, I64),
    C.slice_((4, 10, 6), (1,), (2,), (9,), (1,), F16),  # middle axis: rows of 7*6
    C.slice_((3, 50), (1,), (5,), (50,), (1,), F32),  # start > 0: src_offset
    C.slice_((4, 10, 6), (0, 2), (1, 1), (3, 5), (1, 1), F16),  # outer dims merge: rows of 4, stride 6
    C.contiguous((1000,), F16),  # one row, W = total
    C.expand((1, 45), (6, 45), F32),  # row stride 0
    C.CopySpec(F16, (3, 7), (-7, 1), (7, 1), src_offset=14, dst_offset=5),  # rows in reverse (a pad), dst offset
]


def _extent(spec: C.CopySpec) -> int:
    return spec.src_offset + sum(max(0, (n - 1) * s) for n, s in zip(spec.shape, spec.src_strides)) + 1


@pytest.mark.parametrize("spec", AWKWARD, ids=lambda s: f"{s.dtype.value}{list(s.shape)}")
def test_emulation_matches_generic_mapping(spec: C.CopySpec) -> None:
    src = np.arange(_extent(spec), dtype=np.int64)  # distinct values: a wrong offset cannot go unseen
    assert np.array_equal(emulate(spec, src), reference(spec, src))


def test_which_specs_take_the_fast_path() -> None:
    fr = C.flat_rows(_unpad(1024, 50264, 50257, F16))
    assert (fr.rows, fr.width, fr.src_row_stride, fr.vec, fr.per_lane) == (1024, 50257, 50264, 8, 16)
    assert C.flat_rows(_unpad(1024, 50264, 50257, F32)).vec == 4
    assert C.flat_rows(C.transpose((4, 5), (1, 0), F16)) is None  # inner source stride 5
    assert C.flat_rows(_unpad(33, 9, 1, F16)) is None  # one column: source stride 9
    assert C.flat_rows(C.slice_((4, 10, 6), (1, 2), (2, 1), (9, 5), (1, 1), F16)) is None  # 3 dims left
    assert C.flat_rows(C.slice_((3, 50), (1,), (0,), (50,), (2,), F32)) is None  # step 2
    assert C.flat_rows(C.concat([(2, 3), (2, 5)], 1, F16)[0]) is None  # strided output
    assert C.flat_rows(C.tile((2, 3), (2, 2), F16)) is None
    assert C.flat_rows(C.trilu((4, 4), True, 0, F16)) is None


def test_grid_and_index_types() -> None:
    r, src = K.prepare(_unpad(1024, 50264, 50257, F16))
    assert r.grid[0] == -(-1024 * 50257 // 512 // 8)  # one warp per 512-element tile
    assert r.ctx["flat"]["idx_t"] == "int" and r.ctx["flat"]["col_t"] == "int"
    assert "uint4" in src and "__syncwarp" in src
    r, src = K.prepare(C.transpose((4, 5), (1, 0), F16))
    assert r.ctx["flat"] is None and "uint4" not in src and r.grid[0] == 1


@pytest.mark.parametrize("rows", [21367, 42734, 42735, 1 << 20])
def test_index_math_near_2_31_elements(rows: int) -> None:
    """No intermediate overflows its C type where the elements near or past 2^31 (pure python:
    the first, last and one-past-last tile of the last warps, as the kernel computes them)."""
    spec = _unpad(rows, 50264, 50257, F16)
    r, _ = K.prepare(spec)
    flat = r.ctx["flat"]
    total, width, tile, warps = spec.numel, flat["width"], flat["tile"], flat["warps"]
    it, ct, st = str(flat["idx_t"]), str(flat["col_t"]), str(flat["src_t"])
    assert (it == "int") == (2 * total + 9 * tile < (1 << 31))
    assert (st == "int") == (rows * 50264 + 50257 + tile < (1 << 31))
    stride = _typed(r.grid[0] * warps * tile, it, "stride")
    last = (total - 1) // tile * tile
    for base in (0, last - stride if last >= stride else 0, last):
        _typed(base + stride, it, "next base")
        row0 = base // width
        col0 = _typed(base - row0 * width, ct, "col0")
        for k in (0, tile - 1):  # every lane forms its offsets, past the end too (not read)
            c = _typed(col0 + k, ct, "c")
            dr = c // width
            so = _typed((row0 + dr) * 50264 + (c - dr * width), st, "source offset")
            f = base + k
            if f < total:
                assert so == (f // 50257) * 50264 + f % 50257
    assert r.grid[0] * warps * tile >= total or r.grid[0] == 1 << 20


@pytest.mark.parametrize("dt", [F16, BF16, F32, I64, BOOL])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fast_path_compiles(dt: DType, arch: str) -> None:
    ck = K.build(_unpad(37, 50, 45, dt), arch)
    assert ck.params == ("src", "dst") and ck.cubin


# ---- GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dt", [F16, BF16, F32])
@pytest.mark.parametrize("shape", [(1024, 50264, 50257), (7, 13, 11), (5, 8, 3), (1, 40, 37), (333, 1031, 1029)])
def test_unpad_copy_on_gpu(dt: DType, shape: tuple[int, int, int]) -> None:
    cp = pytest.importorskip("cupy")
    rows, npad, n = shape
    spec = _unpad(rows, npad, n, dt)
    ck = K.build(spec)
    host = np.random.default_rng(20261123).integers(0, 1 << 15, size=(rows, npad)).astype(np.uint16 if dt != F32 else np.uint32)
    src = cp.asarray(host)
    for off in (0, 1):  # an output pointer 16-byte aligned, and one that is not (element-wise stores)
        buf = cp.full(rows * n + 1, 0xFFFF, dtype=src.dtype)
        dst = buf[off:off + rows * n]
        K.launch(ck, [src, dst])
        got = dst.get().reshape(rows, n)
        assert np.array_equal(got, host[:, :n]), f"{dt.value} {shape} dst offset {off}"
        assert int(buf[(rows * n) if off == 0 else 0].get()) == 0xFFFF  # nothing written outside


@pytest.mark.gpu
@pytest.mark.parametrize("spec", AWKWARD, ids=lambda s: f"{s.dtype.value}{list(s.shape)}")
def test_fast_path_specs_on_gpu(spec: C.CopySpec) -> None:
    """Every awkward spec of the emulation, launched: the same values as the generic mapping."""
    cp = pytest.importorskip("cupy")
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[spec.dtype.itemsize]
    host = (np.arange(_extent(spec), dtype=np.uint64) % (1 << min(8 * spec.dtype.itemsize - 1, 15))).astype(bits)
    if spec.dtype == BOOL:
        host = host % 2
    dst = cp.full(spec.dst_offset + spec.numel, 0xFF, dtype=bits)
    K.launch(K.build(spec), [cp.asarray(host), dst])
    got = dst.get()
    assert np.array_equal(got[spec.dst_offset:], reference(spec, host)) and (got[:spec.dst_offset] == 0xFF).all()


def test_padded_product_output_is_unpadded_by_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_GEMM_STREAM", "0")  # cuBLAS's padded product (sm_90 runs few rows on fusec's GEMM)
    """y = x @ W with N = 37 (fp16 rows of 74 bytes): pad_gemm pads N to 40 and the graph output is
    the unpad copy, whose kernel in the compiled plan takes the fast path."""
    import fusec
    from fusec.builder import GraphBuilder
    from fusec.ops import Op

    b = GraphBuilder("odd_n")
    x = b.input("x", (24, 64), F32)  # M = 24: a cuBLAS product (M <= 16 runs the GEMV)
    w = np.random.default_rng(0).standard_normal((64, 37)).astype(np.float32)
    b.output(b.emit(Op.MATMUL, x, b.const(w, name="w")), "y")
    plan = fusec.compile(b.build(), dtype="fp16", arch="sm_90")
    launches = plan.manifest["launches"]
    (gemm,) = [L for L in launches if L["type"] == "gemm"]
    assert gemm["n"] == 40  # padded
    kernels = plan.manifest["kernels"]
    sources = {m["id"]: bytes(plan.blob(m["source"])).decode() for m in plan.manifest["modules"]}
    copies = [L for L in launches if L["type"] == "kernel" and kernels[L["kernel"]]["entry"].startswith("fc_copy")]
    assert len(copies) == 1
    assert "uint4" in sources[kernels[copies[0]["kernel"]]["module"]]
