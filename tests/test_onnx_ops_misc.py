"""RotaryEmbedding, Hardmax, SpaceToDepth/DepthToSpace and EyeLike as IR ops, against onnxruntime
(or numpy written from the ONNX spec where onnxruntime lacks the op at the tested opset)."""

from __future__ import annotations

import numpy as np
import pytest
from test_onnx_ops import C, F, _build
from test_onnx_ops import test_op_matches_onnxruntime as check_against_onnxruntime

from fusec import reference
from fusec.frontend.onnx_import import import_onnx

CASES = [
    C("Hardmax", "Hardmax", F(3, 4, 5), opset=13, ops=("argmax", "equal")),
    C("Hardmax-axis0", "Hardmax", F(3, 4), attrs={"axis": 0}, opset=13),
    C("Hardmax-ties", "Hardmax", np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32), opset=13),
    C("SpaceToDepth", "SpaceToDepth", F(2, 3, 4, 6), attrs={"blocksize": 2}, opset=13, ops=("transpose",)),
    C("DepthToSpace-DCR", "DepthToSpace", F(1, 8, 2, 3), attrs={"blocksize": 2}, opset=13),
    C("DepthToSpace-CRD", "DepthToSpace", F(1, 8, 2, 3), attrs={"blocksize": 2, "mode": "CRD"}, opset=13),
    C("EyeLike", "EyeLike", F(3, 4), attrs={"k": 1}, opset=13),
    C("EyeLike-dtype", "EyeLike", F(4, 3), attrs={"k": -1, "dtype": 7}, out="i", opset=13),
    C("ScatterElements", "ScatterElements", F(3, 4), np.array([[1, 0, 2, 0], [2, 2, 0, 1]], np.int64), F(2, 4),
      opset=18, ops=("scatter_nd",)),
    C("ScatterElements-axis-neg", "ScatterElements", F(2, 5), np.array([[1, -1], [0, -3]], np.int64), F(2, 2),
      attrs={"axis": 1}, opset=18),
    C("ReverseSequence-batch0", "ReverseSequence", F(3, 5, 2), np.array([5, 1, 3], np.int64),
      attrs={"batch_axis": 0, "time_axis": 1}, opset=13, ops=("gather_elements",)),
    C("ReverseSequence-time0", "ReverseSequence", F(4, 2), np.array([2, 4], np.int64), opset=13),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_onnxruntime(case) -> None:
    check_against_onnxruntime(case)


def _rope_spec(x, cos, sin, pos, interleaved, rd, heads):
    """The ONNX spec of RotaryEmbedding in numpy (float64)."""
    shape = x.shape
    x = x.astype(np.float64)
    x = np.transpose(x, (0, 2, 1, 3)) if x.ndim == 4 else x.reshape(shape[0], shape[1], heads, -1)
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else np.split(rot, 2, axis=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rot = np.stack([real, imag], axis=-1).reshape(rot.shape)
    else:
        rot = np.concatenate([real, imag], axis=-1)
    y = np.concatenate([rot, rest], axis=-1)
    return y.reshape(shape) if len(shape) == 3 else np.transpose(y, (0, 2, 1, 3))


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["4d-pos", "3d-pos", "4d-nopos-partial"])
def test_rotary_embedding_matches_the_spec(layout: str, interleaved: int) -> None:
    rng = np.random.default_rng(3)
    rd = 4 if layout.endswith("partial") else 8
    if layout == "3d-pos":
        x, heads = rng.standard_normal((2, 3, 32)).astype(np.float32), 4
    else:
        x, heads = rng.standard_normal((2, 4, 3, 8)).astype(np.float32), 0
    pos = rng.integers(0, 50, (2, 3)) if "nopos" not in layout else None
    rows = (50,) if pos is not None else (2, 3)
    cos, sin = (rng.uniform(-1, 1, rows + (rd // 2,)).astype(np.float32) for _ in range(2))
    attrs = {"interleaved": interleaved, **({"num_heads": heads} if heads else {}),
             **({"rotary_embedding_dim": rd} if rd != 8 else {})}
    ins = [(x.shape, "f"), cos, sin] + ([pos.astype(np.int64)] if pos is not None else [])
    model, feeds = _build(C(f"rope-{layout}", "RotaryEmbedding", *ins, attrs=attrs, opset=23))
    feeds["in0"] = x
    g = import_onnx(model)
    assert ("rope" in g.op_histogram()) == (not interleaved)
    got = reference.run(g, feeds)["out0"]
    np.testing.assert_allclose(got, _rope_spec(x, cos, sin, pos, interleaved, rd, heads), rtol=1e-5, atol=1e-6)


def test_space_to_depth_refuses_a_blocksize_that_does_not_divide() -> None:
    from fusec.errors import ModelError

    model, _ = _build(C("s2d-bad", "SpaceToDepth", F(1, 1, 4, 6), attrs={"blocksize": 4}, opset=13))
    with pytest.raises(ModelError, match="multiples of blocksize"):
        import_onnx(model)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter_matches_the_spec(mode: str) -> None:
    """TensorScatter (opset 24) against the spec's pseudocode in numpy."""
    rng = np.random.default_rng(9)
    cache = rng.standard_normal((2, 3, 5, 4)).astype(np.float32)
    upd = rng.standard_normal((2, 3, 2, 4)).astype(np.float32)
    write = np.array([1, 4 if mode == "circular" else 3], np.int64)  # circular wraps 4, 5 to 4, 0
    model, feeds = _build(C(f"ts-{mode}", "TensorScatter", F(2, 3, 5, 4), F(2, 3, 2, 4), ((2,), "i"),
                            attrs={"mode": mode}, opset=24))
    feeds = {"in0": cache, "in1": upd, "in2": write}
    want = cache.copy()
    for idx in np.ndindex(cache.shape[:2]):
        for s in range(upd.shape[2]):
            pos = write[idx[0]] + s
            if mode == "circular":
                pos %= cache.shape[2]
            want[idx + (pos,)] = upd[idx + (s,)]
    g = import_onnx(model)
    assert "scatter_nd" in g.op_histogram()
    np.testing.assert_array_equal(reference.run(g, feeds)["out0"], want)


def test_scatter_elements_reductions_are_refused() -> None:
    from fusec.errors import ModelError

    model, _ = _build(C("se-add", "ScatterElements", F(2, 3), np.zeros((2, 3), np.int64), F(2, 3),
                        attrs={"reduction": "add"}, opset=18))
    with pytest.raises(ModelError, match="reduction 'add' is not supported"):
        import_onnx(model)
