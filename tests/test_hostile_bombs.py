"""Hostile input, resource bombs (issue 10, item 3): sizes are checked before anything is
allocated. ConstantOfShape/Expand/Range/Tile to 1e12 elements, a 1e12 dim in a model input or in
--shapes, an .npz whose header claims 1e12 elements or whose member inflates to gigabytes: each is
one error naming the node, input or file, in bounded time and memory. The limits are
FUSEC_MAX_ELEMENTS / FUSEC_MAX_BYTES (per tensor)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
from hostile_helpers import const, fails, model, relu_model, save, vi
from onnx import TensorProto, helper

import fusec
from fusec.errors import FusecError, InputError, ModelError
from fusec.frontend.onnx_import import import_onnx
from fusec.inputs import load_inputs_npz
from fusec.loader import load_graph

BIG = 1_000_000  # two of these: 1e12 elements


def _bomb(op: str) -> object:
    if op == "ConstantOfShape":
        nodes = [helper.make_node("ConstantOfShape", ["shape"], ["c"], name="bomb"),
                 helper.make_node("Add", ["x", "c"], ["y"])]
        inits = [const("shape", np.array([BIG, BIG], np.int64))]
    elif op == "Expand":
        nodes = [helper.make_node("Expand", ["x", "shape"], ["y"], name="bomb")]
        inits = [const("shape", np.array([BIG, BIG], np.int64))]
    elif op == "Range":
        nodes = [helper.make_node("Range", ["start", "limit", "delta"], ["r"], name="bomb"),
                 helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
                 helper.make_node("Add", ["x", "rf"], ["y"])]
        inits = [const("start", np.array(0, np.int64)), const("limit", np.array(BIG * BIG, np.int64)),
                 const("delta", np.array(1, np.int64))]
    elif op == "Tile (constant)":
        nodes = [helper.make_node("Tile", ["c", "reps"], ["t"], name="bomb"),
                 helper.make_node("Add", ["x", "t"], ["y"])]
        inits = [const("c", np.ones((1, 1), np.float32)), const("reps", np.array([BIG, BIG], np.int64))]
    else:  # a run-time Tile: the plan's arena would be 4 TB
        nodes = [helper.make_node("Tile", ["x", "reps"], ["y"], name="bomb")]
        inits = [const("reps", np.array([BIG, BIG], np.int64))]
    return model(nodes, [vi("x", [1, 1])], [vi("y", ["d0", "d1"])], inits)


@pytest.mark.parametrize("op", ["ConstantOfShape", "Expand", "Range", "Tile (constant)", "Tile (run time)"])
def test_shape_op_bombs_are_refused_before_allocating(capsys, tmp_path, op) -> None:
    path = save(_bomb(op), tmp_path / "bomb.onnx")
    with pytest.raises(ModelError) as ei:
        import_onnx(path)
    msg = str(ei.value)
    assert "bomb.onnx" in msg and "FUSEC_MAX_ELEMENTS" in msg and ("'bomb'" in msg or "'y'" in msg), msg
    fails(capsys, ["compile", str(path), "-o", str(tmp_path / "b.fplan")], needles=["bomb.onnx", "elements"])
    assert not (tmp_path / "b.fplan").exists()


def test_a_huge_dim_in_a_model_input_is_refused(capsys, tmp_path) -> None:
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [BIG, BIG])], [vi("y", [BIG, BIG])])
    path = save(m, tmp_path / "wide.onnx")
    fails(capsys, ["run", str(path), "--backend", "reference"], needles=["'x'", "elements", "FUSEC_MAX_ELEMENTS"])


def test_negative_model_dims_are_refused_and_zero_dims_are_empty_tensors(tmp_path) -> None:
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [-3, 4])], [vi("y", [-3, 4])])
    with pytest.raises(InputError, match="'x'.*dim 0"):
        import_onnx(save(m, tmp_path / "z.onnx"))
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [0, 4])], [vi("y", [0, 4])])
    assert import_onnx(save(m, tmp_path / "e.onnx")).inputs[0].shape == (0, 4)  # ONNX allows empty tensors


@pytest.mark.parametrize("shapes", ["input_ids:1000000x1000000,attention_mask:1000000x1000000",
                                    "input_ids:1x1000000000000"])
def test_a_huge_dim_in_shapes_is_refused(capsys, shapes) -> None:
    fails(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--shapes", shapes],
          needles=["input_ids", "elements", "FUSEC_MAX_ELEMENTS"])


def test_the_limit_can_be_raised_or_lowered(monkeypatch, tmp_path) -> None:
    path = save(relu_model(), tmp_path / "relu.onnx")
    monkeypatch.setenv("FUSEC_MAX_ELEMENTS", "4")
    with pytest.raises(InputError, match="more than the limit 4"):
        import_onnx(path)
    monkeypatch.setenv("FUSEC_MAX_ELEMENTS", "8")
    assert import_onnx(path).inputs[0].shape == (2, 4)
    monkeypatch.setenv("FUSEC_MAX_ELEMENTS", "lots")
    with pytest.raises(InputError, match="FUSEC_MAX_ELEMENTS"):
        import_onnx(path)


def test_api_shapes_with_a_huge_product_are_refused() -> None:
    with pytest.raises(InputError, match="elements"):
        fusec.compile("gpt2-tiny", shapes={"input_ids": (BIG, BIG), "attention_mask": (BIG, BIG)})


def _npz_with_header(path: Path, name: str, shape: tuple[int, ...], payload: bytes = b"",
                     compression: int = zipfile.ZIP_STORED) -> Path:
    header = {"descr": "<f4", "fortran_order": False, "shape": shape}
    with zipfile.ZipFile(path, "w", compression=compression) as zf, zf.open(name + ".npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        f.write(payload)
    return path


def test_npz_header_claiming_1e12_elements_is_refused_before_reading(capsys, tmp_path) -> None:
    graph = import_onnx(save(relu_model(), tmp_path / "relu.onnx"))
    bad = _npz_with_header(tmp_path / "in.npz", "x", (BIG, BIG), b"\0" * 64)
    with pytest.raises(InputError) as ei:
        load_inputs_npz(bad, graph)
    assert "in.npz" in str(ei.value) and "'x'" in str(ei.value) and "[1000000, 1000000]" in str(ei.value)
    fails(capsys, ["run", str(tmp_path / "relu.onnx"), "--backend", "reference", "--inputs", str(bad)],
          needles=["in.npz", "'x'", "expected shape"])


def test_npz_member_that_inflates_to_gigabytes_is_refused_before_inflating(tmp_path) -> None:
    """A deflated member of 1 GiB of zeros (a ~1 MB file) behind a header for the right shape."""
    graph = import_onnx(save(relu_model(), tmp_path / "relu.onnx"))
    path = tmp_path / "bomb.npz"
    header = {"descr": "<f4", "fortran_order": False, "shape": (2, 4)}
    zeros = bytes(64 << 20)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf, \
            zf.open("x.npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_2_0(f, header)
        for _ in range(16):
            f.write(zeros)
    assert path.stat().st_size < 8 << 20
    with pytest.raises(InputError, match=r"'x' declares \d+ bytes, but its header describes 32"):
        load_inputs_npz(path, graph)


def test_npz_with_an_unknown_member_is_refused_before_inflating_it(tmp_path) -> None:
    graph = import_onnx(save(relu_model(), tmp_path / "relu.onnx"))
    path = _npz_with_header(tmp_path / "in.npz", "not_an_input", (BIG, BIG))
    with pytest.raises(InputError, match="unexpected input.*'not_an_input'"):
        load_inputs_npz(path, graph)


def test_random_inputs_for_a_huge_signature_are_refused() -> None:
    from fusec.inputs import random_inputs_for

    with pytest.raises(InputError, match="'ids'.*elements"):
        random_inputs_for([{"name": "ids", "shape": [BIG, BIG], "dtype": "i64", "bound": 10}])


def test_load_graph_refuses_huge_builtin_shapes() -> None:
    with pytest.raises(FusecError, match="elements"):
        load_graph("gpt2-tiny", {"input_ids": (BIG, BIG), "attention_mask": (BIG, BIG)})


def test_a_plan_whose_arena_passes_the_byte_limit_is_refused_when_compiled(capsys, monkeypatch, tmp_path) -> None:
    """No single tensor passes the limits, but the memory plan does: compile refuses the plan."""
    from fusec.planfile import PlanFileError

    monkeypatch.setenv("FUSEC_MAX_BYTES", "40000")  # gpt2-tiny's arena is about 45 KB
    with pytest.raises(PlanFileError, match="memory.arena_bytes.*FUSEC_MAX_BYTES"):
        fusec.compile("gpt2-tiny")
    fails(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan")], needles=["arena_bytes", "FUSEC_MAX_BYTES"])
    assert not (tmp_path / "g.fplan").exists()
