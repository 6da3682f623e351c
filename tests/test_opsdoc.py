"""docs/OPS.md, the published list of supported ONNX ops, opsets and dtypes, is what
``python -m fusec.opsdoc`` generates from the op tables (issue 11, item 7)."""

from __future__ import annotations

import difflib
from pathlib import Path

import onnx

from fusec.opsdoc import REGENERATE, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "OPS.md"


def test_the_committed_ops_page_is_what_the_generator_prints() -> None:
    want = render()
    got = DOC.read_text(encoding="utf-8") if DOC.is_file() else ""
    if got != want:
        diff = "".join(list(difflib.unified_diff(got.splitlines(True), want.splitlines(True), "docs/OPS.md",
                                                 "generated", n=0))[:40])
        raise AssertionError(f"docs/OPS.md is out of date with the op tables; regenerate it with: {REGENERATE}\n{diff}")


def test_the_page_lists_every_onnx_op_every_ir_op_and_the_opset_range() -> None:
    from fusec.frontend.onnx_ctx import HANDLERS
    from fusec.frontend.onnx_import import MIN_OPSET
    from fusec.ops import OP_INFO

    text = render()
    rows = {line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| `")}
    assert {f"`{name}`" for name in HANDLERS} <= rows
    assert {f"`{op.value}`" for op in OP_INFO} <= rows
    assert f"opset {MIN_OPSET} to {onnx.defs.onnx_opset_version()}" in text
    exp = next(line for line in text.splitlines() if line.startswith("| `exp` |"))
    assert "f32" in exp and "i64" not in exp  # the rule's answer: exp takes floats only
