"""--shapes parsing, valid random inputs, .npz inputs/outputs, the loader's dispatch, the GPU probe."""

from __future__ import annotations

import os
import sys
import types

import ml_dtypes
import numpy as np
import pytest

from fusec import device, reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import InputError, ModelError
from fusec.inputs import index_bound, load_inputs_npz, random_inputs, save_outputs_npz
from fusec.ir import Graph
from fusec.loader import check_shapes_fit, load_graph
from fusec.ops import Op
from fusec.shapes import format_shape, parse_shapes

# ---------------------------------------------------------------------------------------------
# parse_shapes


@pytest.mark.parametrize("text, expected", [
    ("input_ids:8x128,attention_mask:8x128", {"input_ids": (8, 128), "attention_mask": (8, 128)}),
    ("x:1", {"x": (1,)}),
    (" x : 2 x 3 ", {"x": (2, 3)}),
    ("x:2X3", {"x": (2, 3)}),
    ("scalar:", {"scalar": ()}),
    ("past:key:1x2", {"past:key": (1, 2)}),  # the LAST colon separates name and dims
])
def test_parse_shapes_accepts(text: str, expected: dict[str, tuple[int, ...]]) -> None:
    assert parse_shapes(text) == expected


@pytest.mark.parametrize("text, quoted", [
    ("", "empty"),
    ("input_ids", "'input_ids'"),
    ("input_ids=8x128", "'input_ids=8x128'"),
    (":8", "':8'"),
    ("x:8x", "'x:8x'"),
    ("x:8xy", "'y'"),
    ("x:1.5", "'1.5'"),
    ("x:0x4", "'x:0x4'"),
    ("x:-1x4", "'x:-1x4'"),
    ("x:+-3", "'+-3'"),
    ("x:²", "'²'"),
    ("x:1,,y:2", "''"),
    ("x:1,x:2", "'x' is given twice"),
    ("bad\nname:1.5", r"'bad\nname:1.5'"),
])
def test_parse_shapes_rejects_with_one_line_quoting_the_bad_part(text: str, quoted: str) -> None:
    with pytest.raises(InputError) as e:
        parse_shapes(text)
    msg = str(e.value)
    assert quoted in msg
    assert "\n" not in msg


def test_format_shape_inverts_parse() -> None:
    shapes = parse_shapes("a:3x4x5")
    assert parse_shapes("a:" + format_shape(shapes["a"])) == shapes


# ---------------------------------------------------------------------------------------------
# random_inputs


def _embedding_graph(vocab: int = 7, positions: int = 50) -> Graph:
    """ids -> cast i32 -> gather(wte); ids -> reshape -> gather(wpe); mask -> cast -> mul; x float; flag bool."""
    b = GraphBuilder("emb")
    ids = b.input("input_ids", (2, 5), DType.I64)
    mask = b.input("attention_mask", (2, 5), DType.I64)
    x = b.input("x", (2, 5, 4), DType.F32)
    flag = b.input("flag", (2, 5, 4), DType.BOOL)
    wte = b.const(np.arange(vocab * 4, dtype=np.float32).reshape(vocab, 4), name="wte")
    wpe = b.const(np.ones((positions, 4), np.float32), name="wpe")
    e = b.emit(Op.GATHER, wte, b.emit(Op.CAST, ids, to=DType.I32), axis=0)
    p = b.emit(Op.GATHER, wpe, b.emit(Op.RESHAPE, ids, shape=(10,)), axis=0)
    h = b.emit(Op.ADD, e, b.emit(Op.RESHAPE, p, shape=(2, 5, 4)))
    h = b.emit(Op.MUL, h, b.emit(Op.RESHAPE, b.emit(Op.CAST, mask, to=DType.F32), shape=(2, 5, 1)))
    h = b.emit(Op.WHERE, flag, b.emit(Op.ADD, h, x), x)
    b.output(h, "y")
    return b.build()


def test_index_bound_follows_casts_and_reshapes_and_takes_the_smallest_table() -> None:
    g = _embedding_graph(vocab=7, positions=50)
    by_name = {v.name: v for v in g.inputs}
    assert index_bound(g, by_name["input_ids"]) == 7
    assert index_bound(g, by_name["attention_mask"]) is None


def test_random_inputs_are_valid_for_the_model() -> None:
    g = _embedding_graph(vocab=7)
    inputs = random_inputs(g, seed=3)
    ids, mask, x, flag = (inputs[n] for n in ("input_ids", "attention_mask", "x", "flag"))
    assert ids.dtype == np.int64 and ids.shape == (2, 5)
    assert 0 <= ids.min() and ids.max() < 7
    assert len(np.unique(ids)) > 1  # ids are random, not a constant
    assert mask.dtype == np.int64 and np.all(mask == 1)
    assert x.dtype == np.float32 and x.shape == (2, 5, 4) and 0.2 < float(x.std()) < 3.0
    assert flag.dtype == np.bool_ and flag.all()
    reference.run(g, inputs)  # the reference interpreter accepts them (gathers check their indices)


def test_random_inputs_depend_only_on_the_seed() -> None:
    g = _embedding_graph()
    a, b, c = random_inputs(g, seed=1), random_inputs(g, seed=1), random_inputs(g, seed=2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["x"], c["x"])


def test_random_inputs_for_half_precision_inputs() -> None:
    b = GraphBuilder("h")
    for name, dt in (("h", DType.F16), ("bh", DType.BF16), ("i", DType.I32)):
        b.output(b.emit(Op.NEG, b.input(name, (3,), dt)), f"o_{name}")
    inputs = random_inputs(b.build())
    assert inputs["h"].dtype == np.float16
    assert inputs["bh"].dtype == ml_dtypes.bfloat16
    assert inputs["i"].dtype == np.int32 and np.all(inputs["i"] == 1)


# ---------------------------------------------------------------------------------------------
# .npz inputs and outputs


def _small_graph() -> Graph:
    b = GraphBuilder("small")
    ids = b.input("input_ids", (1, 4), DType.I64)
    x = b.input("x", (1, 4), DType.F32)
    b.output(b.emit(Op.ADD, b.emit(Op.CAST, ids, to=DType.F32), x), "y")
    return b.build()


def test_load_inputs_npz_round_trips_and_accepts_int32_ids(tmp_path) -> None:
    g = _small_graph()
    path = tmp_path / "in.npz"
    np.savez(path, input_ids=np.arange(4, dtype=np.int32).reshape(1, 4), x=np.ones((1, 4), np.float32))
    loaded = load_inputs_npz(path, g)
    assert loaded["input_ids"].dtype == np.int64  # check_inputs widens int32 token ids
    assert loaded["input_ids"].tolist() == [[0, 1, 2, 3]]


def test_load_inputs_npz_reads_bf16_saved_by_numpy(tmp_path) -> None:
    b = GraphBuilder("bf")
    b.output(b.emit(Op.NEG, b.input("x", (3,), DType.BF16)), "y")
    g = b.build()
    arr = np.array([1.5, -2.0, 0.25], dtype=ml_dtypes.bfloat16)
    np.savez(tmp_path / "bf.npz", x=arr)  # numpy stores bfloat16 as raw 2-byte voids
    loaded = load_inputs_npz(tmp_path / "bf.npz", g)
    assert loaded["x"].dtype == ml_dtypes.bfloat16
    assert loaded["x"].astype(np.float32).tolist() == [1.5, -2.0, 0.25]


@pytest.mark.parametrize("arrays, fragment", [
    ({"input_ids": np.zeros((1, 4), np.int64)}, "missing input(s): 'x'"),
    ({"input_ids": np.zeros((1, 4), np.int64), "x": np.zeros((1, 4), np.float32), "z": np.zeros(1)},
     "unexpected input(s): 'z'"),
    ({"input_ids": np.zeros((1, 4), np.int64), "x": np.zeros((1, 4), np.float64)}, "input 'x': expected dtype f32"),
    ({"input_ids": np.zeros((1, 5), np.int64), "x": np.zeros((1, 4), np.float32)}, "input 'input_ids': expected shape"),
])
def test_load_inputs_npz_names_the_bad_input_and_the_file(tmp_path, arrays, fragment) -> None:
    path = tmp_path / "in.npz"
    np.savez(path, **arrays)
    with pytest.raises(InputError) as e:
        load_inputs_npz(path, _small_graph())
    assert fragment in str(e.value)
    assert str(path) in str(e.value)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d / "absent.npz", "does not exist"),
    (lambda d: d, "is a directory"),
    (lambda d: _write(d / "text.npz", b"input_ids,x\n1,2\n"), "is not an .npz file"),
    (lambda d: _write(d / "empty.npz", b""), "is not an .npz file"),
    (lambda d: _write(d / "trunc.npz", b"PK\x03\x04" + b"\0" * 20), "is not a readable .npz file"),
])
def test_load_inputs_npz_rejects_unreadable_files(tmp_path, make, fragment) -> None:
    path = make(tmp_path)
    with pytest.raises(InputError) as e:
        load_inputs_npz(path, _small_graph())
    assert fragment in str(e.value) and repr(str(path)) in str(e.value)


def test_load_inputs_npz_refuses_pickles_and_npy(tmp_path) -> None:
    np.savez(tmp_path / "obj.npz", input_ids=np.array([{"a": 1}, None], dtype=object), x=np.zeros((1, 4)))
    with pytest.raises(InputError, match="pickled objects"):
        load_inputs_npz(tmp_path / "obj.npz", _small_graph())
    np.save(tmp_path / "one.npy", np.zeros((1, 4), np.float32))
    with pytest.raises(InputError, match="single .npy array"):
        load_inputs_npz(tmp_path / "one.npy", _small_graph())


def test_save_outputs_npz_keys_by_name_and_leaves_no_temp_file(tmp_path) -> None:
    outs = {"logits": np.arange(6, dtype=np.float32).reshape(2, 3), "file": np.array([True]),
            'we"ird\nname é': np.zeros(2, np.int64)}
    target = tmp_path / "out.npz"
    target.write_bytes(b"old contents")  # replaced, not appended to
    save_outputs_npz(target, outs)
    assert os.listdir(tmp_path) == ["out.npz"]
    with np.load(target, allow_pickle=False) as z:
        assert sorted(z.files) == sorted(outs)
        for k, v in outs.items():
            assert z[k].dtype == v.dtype and np.array_equal(z[k], v)


def test_save_outputs_npz_failure_keeps_the_old_file(tmp_path) -> None:
    target = tmp_path / "out.npz"
    target.write_bytes(b"old contents")
    with pytest.raises(ValueError):  # object arrays cannot be written without pickle
        save_outputs_npz(target, {"a": np.zeros(3), "b": np.array([object()])})
    assert target.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["out.npz"]


def test_save_outputs_npz_into_missing_directory_is_an_input_error(tmp_path) -> None:
    with pytest.raises(InputError, match="cannot write outputs file"):
        save_outputs_npz(tmp_path / "no" / "such" / "out.npz", {"a": np.zeros(1)})


# ---------------------------------------------------------------------------------------------
# loader


def test_load_graph_builds_a_builtin_model_with_shapes() -> None:
    g = load_graph("gpt2-tiny", {"input_ids": (2, 8), "attention_mask": (2, 8)})
    assert [(v.name, v.shape) for v in g.inputs] == [("input_ids", (2, 8)), ("attention_mask", (2, 8))]


def test_load_graph_takes_a_model_proto_a_path_and_a_pathlike(tmp_path) -> None:
    import onnx
    from test_cli import tiny_onnx

    shapes = {"input_ids": (2, 3), "attention_mask": (2, 3)}
    model = tiny_onnx()
    onnx.save(model, tmp_path / "m.onnx")
    for source in (model, str(tmp_path / "m.onnx"), tmp_path / "m.onnx"):
        g = load_graph(source, shapes)
        assert [(v.name, v.shape) for v in g.outputs] == [("probs", (2, 3, 4))]
    with pytest.raises(InputError, match="'nope'"):
        load_graph(model, {**shapes, "nope": (1,)})


def test_load_graph_unknown_name_lists_the_builtins() -> None:
    with pytest.raises(ModelError) as e:
        load_graph("gpt5-huge")
    msg = str(e.value)
    assert msg.startswith("no such file or built-in model 'gpt5-huge'")
    assert "gpt2-tiny" in msg and "qwen3-0.6b" in msg


def test_load_graph_missing_onnx_file_and_directory(tmp_path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        load_graph(str(tmp_path / "absent.onnx"))
    with pytest.raises(ModelError, match="is a directory"):
        load_graph(tmp_path)


def test_check_shapes_fit_names_the_mismatch() -> None:
    g = _small_graph()
    check_shapes_fit(g, {"x": (1, 4)})  # fits: no error
    with pytest.raises(InputError, match="'nope', which is not an input"):
        check_shapes_fit(g, {"nope": (1, 4)})
    with pytest.raises(InputError, match="rank 3"):
        check_shapes_fit(g, {"x": (1, 4, 1)})
    with pytest.raises(InputError, match=r"fixes it at \[1, 4\]"):
        check_shapes_fit(g, {"x": (2, 4)})


# ---------------------------------------------------------------------------------------------
# device


def _fake_cupy(monkeypatch, count) -> None:
    def get_count() -> int:
        if isinstance(count, Exception):
            raise count
        return count

    runtime = types.SimpleNamespace(getDeviceCount=get_count, getDeviceProperties=lambda i: {
        "name": b"Fake GPU", "major": 9, "minor": 0, "totalGlobalMem": 80 * 2**30})
    cuda = types.SimpleNamespace(runtime=runtime, Device=lambda: types.SimpleNamespace(compute_capability="90"))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))


def test_gpu_available_is_false_when_cupy_raises(monkeypatch) -> None:
    _fake_cupy(monkeypatch, RuntimeError("cudaErrorInsufficientDriver"))
    assert device.gpu_available() is False
    assert device.describe().startswith("no GPU found")
    assert device.gpu_arch() is None


def test_gpu_available_is_false_without_cupy(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError
    assert device.gpu_available() is False


def test_gpu_available_and_describe_with_a_device(monkeypatch) -> None:
    _fake_cupy(monkeypatch, 2)
    assert device.gpu_available() is True
    assert device.describe() == "Fake GPU, sm_90, 80.0 GiB (+1 more)"
    assert device.gpu_arch() == "sm_90"
