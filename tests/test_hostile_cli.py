"""Careless and hostile use of the CLI and the API (issue 10, items 4 and 6): nothing bad is
accepted silently, every failure is one line naming the file, node, input or field, and deep
graphs or deeply nested files do not overflow the stack (10,000-node chains)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hostile_helpers import const, fails, model, relu_model, save, vi
from onnx import helper

import fusec
from fusec import device
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.errors import FusecError, InputError, ModelError
from fusec.frontend.onnx_import import import_onnx
from fusec.inputs import random_inputs_for
from fusec.loader import load_graph
from fusec.ops import Op

CHAIN = 10_000


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_available", lambda: False)


# ---- item 6: nothing bad accepted silently ------------------------------------------------------

def test_duplicate_graph_output_names_are_refused(capsys, tmp_path) -> None:
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 4])], [vi("y", [2, 4]), vi("y", [2, 4])])
    path = save(m, tmp_path / "dup.onnx")
    fails(capsys, ["inspect", str(path)], needles=["dup.onnx", "graph output 'y'", "listed twice"])


def test_invalid_utf8_names_are_refused(capsys, tmp_path) -> None:
    m = model([helper.make_node("Relu", ["x"], ["yy"], name="nodeQ")], [vi("x", [2])], [vi("yy", [2])])
    raw = m.SerializeToString().replace(b"nodeQ", b"nod\xffQ")
    path = tmp_path / "utf8.onnx"
    path.write_bytes(raw)
    fails(capsys, ["inspect", str(path)], needles=["utf8.onnx", "not valid UTF-8", "\\xff"])


@pytest.mark.parametrize("shapes, needle", [
    ({"x": (1.5, 4)}, "not an integer"),
    ({"x": ("2", 4)}, "not an integer"),
    ({"x": (True, 4)}, "not an integer"),
    ({"x": "2x4"}, "sequence of ints"),
    ({"x": (0, 4)}, "must be positive"),
])
def test_api_shapes_are_never_truncated(tmp_path, shapes, needle) -> None:
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["n", 4])], [vi("y", ["n", 4])])
    path = save(m, tmp_path / "dyn.onnx")
    for call in (lambda: import_onnx(path, shapes), lambda: load_graph(str(path), shapes),
                 lambda: fusec.compile(str(path), shapes=shapes)):
        with pytest.raises(InputError) as ei:
            call()
        assert "'x'" in str(ei.value) and needle in str(ei.value), str(ei.value)
    assert import_onnx(path, {"x": (np.int64(2), 4)}).inputs[0].shape == (2, 4)  # numpy ints are ints


def test_misspelled_fusion_names_are_refused(capsys, tmp_path) -> None:
    fails(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan"), "--disable-fusion", "gemm_epilog"],
          needles=["'gemm_epilog'", "gemm_epilogue"])
    fails(capsys, ["run", "gpt2-tiny", "--enable-fusion", "mlpp"], needles=["'mlpp'"])
    with pytest.raises(InputError, match="'reduce'"):
        fusec.compile("gpt2-tiny", disabled_fusions=["reduce"])
    with pytest.raises(InputError, match="list of fusion rule names"):
        fusec.compile("gpt2-tiny", disabled_fusions="mlp")


def test_negative_seed_is_one_line(capsys) -> None:
    fails(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--seed", "-1"], needles=["--seed", "-1"])
    with pytest.raises(InputError, match="seed"):
        random_inputs_for([{"name": "x", "shape": [2], "dtype": "f32"}], seed=-5)


def test_token_ids_out_of_range_name_the_input_and_the_file(capsys, tmp_path) -> None:
    inp = tmp_path / "ids.npz"
    np.savez(inp, input_ids=np.full((1, 16), 5000, np.int64), attention_mask=np.ones((1, 16), np.int64))
    fails(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--inputs", str(inp)],
          needles=["ids.npz", "'input_ids'", "5000", "[-1000, 1000)"])


def test_inputs_from_a_pipe_are_read_once(tmp_path) -> None:
    """`--inputs <(cat in.npz)`: a pipe can be read once; fusec opens it once."""
    inp = tmp_path / "in.npz"
    np.savez(inp, x=np.arange(8, dtype=np.float32).reshape(2, 4))
    path = save(relu_model(), tmp_path / "relu.onnx")
    cmd = f'{sys.executable} -m fusec.cli run {path} --backend reference --inputs <(cat {inp}) --save-outputs {tmp_path}/o.npz'
    res = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with np.load(tmp_path / "o.npz") as z:
        assert np.array_equal(z["y"], np.maximum(np.arange(8, dtype=np.float32).reshape(2, 4), 0))


def test_npz_holding_objects_is_refused_without_unpickling(capsys, tmp_path) -> None:
    inp = tmp_path / "evil.npz"
    np.savez(inp, x=np.array([{"a": 1}, None], dtype=object))
    path = save(relu_model(), tmp_path / "relu.onnx")
    fails(capsys, ["run", str(path), "--backend", "reference", "--inputs", str(inp)], needles=["evil.npz", "pickled"])


# ---- item 4: deep graphs and deep files ----------------------------------------------------------

def _chain(op: str, n: int):
    nodes, inits, prev = [], [], "x"
    if op == "Reshape":
        inits = [const("s1", np.array([2, 8], np.int64)), const("s2", np.array([4, 4], np.int64))]
    for i in range(n):
        out = "y" if i == n - 1 else f"t{i}"
        ins = [prev, "s1" if i % 2 == 0 else "s2"] if op == "Reshape" else [prev]
        nodes.append(helper.make_node(op, ins, [out], name=f"n{i}"))
        prev = out
    shape = [2, 8] if (op == "Reshape" and n % 2 == 1) else [4, 4]
    return model(nodes, [vi("x", [4, 4])], [vi("y", shape)], inits)


def test_10000_reshapes_import_inspect_and_run(capsys, tmp_path) -> None:
    path = save(_chain("Reshape", CHAIN), tmp_path / "reshapes.onnx")
    t0 = time.perf_counter()
    from fusec.cli import main

    assert main(["inspect", str(path)]) == 0
    assert main(["run", str(path), "--backend", "reference"]) == 0
    assert time.perf_counter() - t0 < 120
    capsys.readouterr()


def test_10000_elementwise_nodes_import_and_run_on_the_reference(capsys, tmp_path) -> None:
    path = save(_chain("Relu", CHAIN), tmp_path / "relus.onnx")
    from fusec.cli import main

    assert main(["run", str(path), "--backend", "reference", "--no-optimize"]) == 0
    capsys.readouterr()


def test_a_10000_op_elementwise_body_is_declined_not_a_recursion_error() -> None:
    """lower/fused_plan.py: the capability query measures a body iteratively and declines one deeper
    than a kernel takes (the fusion pass then splits the chain), instead of recursing 10,000 deep."""
    from fusec.lower.fused_plan import MAX_EXPR_DEPTH, can_fuse

    def body(n: int):
        b = GraphBuilder()
        v = b.input("x", (4, 4), DType.F32)
        for _ in range(n):
            v = b.emit(Op.RELU, v)
        b.output(v, "y")
        return b.build()

    cap = can_fuse(body(CHAIN))
    assert not cap and f"at most {MAX_EXPR_DEPTH} ops" in cap.reason
    assert can_fuse(body(MAX_EXPR_DEPTH))


def test_a_wide_diamond_body_is_declined_before_expanding_it() -> None:
    """x -> a = x + x -> b = a + a ...: 60 levels would expand to 2^60 terms as a tree."""
    from fusec.lower.fused_plan import can_fuse

    b = GraphBuilder()
    v = b.input("x", (4, 4), DType.F32)
    for _ in range(60):
        v = b.emit(Op.ADD, v, v)
    b.output(v, "y")
    cap = can_fuse(b.build())
    assert not cap and "terms" in cap.reason


def test_a_chain_of_10000_elementwise_nodes_compiles_into_bounded_kernels(tmp_path) -> None:
    """End to end (the 500-node chain of the issue ended in RecursionError in lower/fused.py)."""
    from fusec.lower.fused_plan import MAX_EXPR_DEPTH

    path = save(_chain("Relu", CHAIN), tmp_path / "relus.onnx")
    t0 = time.perf_counter()
    plan = fusec.compile(str(path))
    kernels = [L for L in plan.manifest["launches"] if L["type"] == "kernel"]
    assert CHAIN // MAX_EXPR_DEPTH <= len(kernels) <= CHAIN // 20
    assert time.perf_counter() - t0 < 300


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
def test_a_100k_deep_decisions_file_is_one_line(capsys, tmp_path, text) -> None:
    ledger = tmp_path / "ledger.json"
    ledger.write_text(text)
    fails(capsys, ["compile", "gpt2-tiny", "-o", str(tmp_path / "g.fplan"), "--decisions", str(ledger)],
          needles=["ledger.json"])


def test_every_cli_failure_here_is_a_fusec_error_in_the_api(tmp_path) -> None:
    m = model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", [2, 4])], [vi("y", [2, 4]), vi("y", [2, 4])])
    with pytest.raises(ModelError):
        import_onnx(save(m, tmp_path / "d.onnx"))
    with pytest.raises(FusecError):
        fusec.load(tmp_path / "d.onnx")
    with pytest.raises(FusecError):
        fusec.load(tmp_path)  # a directory
    os.mkfifo(tmp_path / "fifo.fplan")
    with pytest.raises(FusecError):
        fusec.load(tmp_path / "fifo.fplan")  # refused without blocking on the pipe
