"""fusec.bulk: the blockwise threaded cast and transpose give the plain
numpy expressions' exact bytes on the awkward values (NaN payloads of both signs, signalling
NaNs, -0.0, fp32 and target subnormals, values at and just past the rounding/clipping edges), on
sizes that split unevenly, and on non-contiguous and Fortran-ordered inputs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fusec import bulk

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow/NaN casts, in both paths alike

EDGE_BITS = [0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF800ABC, 0x7FBFFFFF, 0x7FE12345,  # quiet/signalling NaNs
             0x80000000, 0x00000000, 0x00000001, 0x807FFFFF, 0x00400000,  # zeros, fp32 subnormals
             0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF]  # infinities, fp32 max
EDGE_VALUES = [65504.0, -65504.0, 65519.99, 65520.0, -65520.0, 5.96e-8, 2.98e-8, 2.9802322e-08, 6.1e-5, -6.0e-8,
               3.3895314e38, 3.3961776e38, -3.3961776e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -9, 9.18e-41, 1e-45]


def _awkward(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 10.0 ** rng.integers(-42, 39, n)).astype(np.float32)
    edges = np.concatenate([np.array(EDGE_BITS, np.uint32).view(np.float32), np.array(EDGE_VALUES, np.float32)])
    idx = rng.integers(0, n, 4000)
    a[idx] = edges[np.arange(idx.size) % edges.size]
    a[: edges.size] = edges  # in the first block
    a[-edges.size:] = edges  # in the last, short block
    return a


@pytest.mark.parametrize("threads", ["1", "3", "7"])
@pytest.mark.parametrize("target", ["bfloat16", "float16"])
def test_cast_clipped_is_the_plain_expression_bytes(target: str, threads: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_BULK_THREADS", threads)
    dt = np.dtype(ml_dtypes.bfloat16 if target == "bfloat16" else np.float16)
    limit = float(ml_dtypes.finfo(dt).max)
    n = bulk._MIN * 3 + bulk._BLOCK // 3 + 5  # uneven parts, a short last block
    flat = _awkward(n, 7)
    for a in (flat, flat[: n // 7 * 7].reshape(-1, 7)[:, 1:6], np.asfortranarray(flat[: 1231 * 2560].reshape(1231, 2560))):
        want = np.ascontiguousarray(np.clip(a, -limit, limit).astype(dt)).reshape(a.shape)
        got = bulk.cast_clipped(a, dt, limit)
        assert got.shape == a.shape and got.dtype == dt and got.flags.c_contiguous
        assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.int64])
def test_transposed_is_the_plain_copy(dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_BULK_THREADS", "5")
    raw = _awkward(bulk._MIN + 12345, 3).view(np.uint8)[: (bulk._MIN + 12345) * 4]
    item = np.dtype(dtype).itemsize
    a = raw[: (raw.size // item // 1037) * 1037 * item].view(dtype).reshape(-1, 1037)  # rows not a multiple of 256
    for x in (a, a[:, 5:], a[::2], np.asfortranarray(a)):
        got = bulk.transposed(x, (1, 0))
        assert got.flags.c_contiguous and got.tobytes() == np.ascontiguousarray(x.T).tobytes()
        assert bulk.transposed(x, [1, 0]).tobytes() == got.tobytes()


@pytest.mark.parametrize("value, want", [("4", 4), ("1", 1), ("0", None), ("", None), ("-2", None), (" 3", 3)])
def test_bulk_threads_parsing(value: str, want, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_BULK_THREADS", value)
    import os

    assert bulk.threads() == (want if want is not None else max(1, min(16, os.cpu_count() or 1)))


def test_bulk_threads_that_are_not_a_number_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusec.errors import InputError

    monkeypatch.setenv("FUSEC_BULK_THREADS", "x")
    with pytest.raises(InputError, match="FUSEC_BULK_THREADS"):
        bulk.threads()
