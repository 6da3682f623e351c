"""Shared pieces of the hostile-input suites (tests/test_hostile_*.py): run the CLI in-process and
check that a failure is exactly one ``fusec: error:`` line with the documented exit code, in
bounded time and memory; small ONNX builders."""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from fusec.cli import main

MAX_SECONDS = 60.0
MAX_GROWTH = 2 << 30  # peak RSS may grow at most 2 GiB during one hostile case


def fails(capsys, argv: Sequence[str], code: int = 1, needles: Sequence[str] = ()) -> str:
    """Run ``fusec argv``; assert exit ``code``, one ``fusec: error:`` line on stderr and no
    traceback, within MAX_SECONDS and MAX_GROWTH; return the message (without the prefix)."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    got = main(list(argv))
    elapsed = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith(("no GPU found", "["))]
    assert got == code, (got, err)
    assert len(lines) == 1 and lines[0].startswith("fusec: error: "), err
    assert "Traceback" not in err
    assert elapsed < MAX_SECONDS, elapsed
    assert rss1 - rss0 < MAX_GROWTH, (rss0, rss1)
    msg = lines[0][len("fusec: error: "):]
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


def model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(list(nodes), "hostile", list(inputs), list(outputs), list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def vi(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, arr) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def save(m: onnx.ModelProto, path: Path) -> Path:
    path.write_bytes(m.SerializeToString())
    return path


def relu_model() -> onnx.ModelProto:
    return model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [2, 4])], [vi("y", [2, 4])])
