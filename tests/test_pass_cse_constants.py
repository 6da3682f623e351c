"""cse.dedupe_constants (a sample of the bytes as key, byte-for-byte on a
collision): what must stay apart stays apart, what is equal merges."""

from __future__ import annotations

import numpy as np

from fusec.dtypes import DType
from fusec.ir import Graph, Value
from passes.cse import _SAMPLE, dedupe_constants


def _kept(*consts: Value) -> list[str]:
    out, _ = dedupe_constants(Graph([], [], [], list(consts)))
    return [c.name for c in out.constants]


def _f32(name: str, a) -> Value:
    a = np.asarray(a, np.float32)
    return Value(name, a.shape, DType.F32, a)


def test_same_bytes_other_type_or_shape_stay_apart() -> None:
    f = np.arange(6, dtype=np.float32).reshape(2, 3)
    i = f.view(np.int32)
    assert _kept(_f32("f", f), Value("i", i.shape, DType.I32, i)) == ["f", "i"]
    assert _kept(_f32("a", f), _f32("b", f.reshape(3, 2)), _f32("c", f.reshape(6))) == ["a", "b", "c"]
    e1, e2 = np.zeros((0, 3), np.float32), np.zeros((3, 0), np.float32)
    assert _kept(_f32("e1", e1), _f32("e2", e2), _f32("e3", e1.copy())) == ["e1", "e2"]
    s = np.float32(2.5)
    assert _kept(_f32("s0", np.array(s)), _f32("s1", np.array([s])), _f32("s2", np.array(s))) == ["s0", "s1"]


def test_signed_zeros_and_nan_payloads_compare_as_bits() -> None:
    z, nz = np.zeros(5, np.float32), np.zeros(5, np.float32)
    nz[3] = -0.0
    q = np.array([0x7FC00000, 0x7FC00001, 0x7FC00000], np.uint32).view(np.float32)
    assert _kept(_f32("z", z), _f32("nz", nz), _f32("z2", z.copy())) == ["z", "nz"]
    assert _kept(_f32("n0", q[[0]]), _f32("n1", q[[1]]), _f32("n2", q[[2]])) == ["n0", "n1"]


def test_views_merge_with_equal_contiguous_arrays() -> None:
    base = np.random.default_rng(0).standard_normal((64, 40)).astype(np.float32)
    t = base.T  # Fortran-ordered view
    assert _kept(_f32("t", t), _f32("c", np.ascontiguousarray(t)), _f32("s", base[:, ::2])) == ["t", "s"]


def test_large_constants_differing_anywhere_stay_apart() -> None:
    for nbytes in (2 * _SAMPLE + 4, 5 * _SAMPLE + 12, 64 * _SAMPLE):
        a = np.random.default_rng(nbytes).standard_normal(nbytes // 4).astype(np.float32)
        for where in (_SAMPLE // 8 + 1, a.size // 2 + 1, a.size - _SAMPLE // 8 - 2):
            b = a.copy()
            b[where] = np.nextafter(b[where], np.float32(np.inf))
            assert _kept(_f32("a", a), _f32("b", b), _f32("a2", a.copy())) == ["a", "b"], (nbytes, where)
