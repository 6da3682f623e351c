"""CLI: --quantize on compile / inspect (a plan records and replays it) and its bad input."""

from __future__ import annotations

import json

import pytest
from test_cli_compile import call, no_gpu  # noqa: F401  (no_gpu: a fixture)


def test_compile_quantized_plan_and_inspect_its_weights(capsys, tmp_path, no_gpu, monkeypatch) -> None:
    monkeypatch.setenv("FUSEC_CACHE_DIR", str(tmp_path / "cache"))
    plan = tmp_path / "q.fplan"
    code, out, err = call(capsys, ["compile", "llama-tiny", "--quantize", "int4", "--quantize-group", "32",
                                   "--dtype", "bf16", "-o", str(plan)])
    assert code == 0, err
    code, out, err = call(capsys, ["inspect", str(plan), "--json"])
    info = json.loads(out)
    assert info["source"]["options"] == {"quantize": "int4", "quantize_group": 32}
    assert info["report"]["weights"]["by_format"]["uint4"]["tensors"] == 8
    code, out, _ = call(capsys, ["inspect", str(plan)])
    assert code == 0 and "uint4" in out and "quantized   14 products with --quantize int4 (group 32)" in out
    code, out, err = call(capsys, ["compile", str(plan), "--arch", "sm_80", "--from-source", "-o", str(tmp_path / "r.fplan")])
    assert code == 0, err
    code, out, _ = call(capsys, ["inspect", str(tmp_path / "r.fplan"), "--json"])
    assert json.loads(out)["report"]["weights"]["by_format"]["uint4"]["tensors"] == 8  # replayed from the record


@pytest.mark.parametrize("argv,needle", [
    (["inspect", "llama-tiny", "--quantize-head"], "--quantize-group/--quantize-head apply only with --quantize"),
    (["inspect", "llama-tiny", "--quantize", "int8", "--quantize-group", "32"], "applies to --quantize int4"),
    (["run", "llama-tiny", "--no-optimize", "--quantize", "int8"], "--no-optimize runs the raw imported graph"),
])
def test_bad_quantize_options_are_one_line(capsys, no_gpu, argv, needle) -> None:
    code, out, err = call(capsys, argv)
    assert code == 1 and needle in err and err.count("\n") == 1, err


def test_inspect_says_when_quantize_packs_nothing() -> None:
    """A --quantize that packed no product gets a line saying so, with the pass's reasons and counts (its ``kept``
    record: a product whose K of 48 fits no chunk of 32, and the output projection), instead of none."""
    import numpy as np

    from fusec.builder import GraphBuilder
    from fusec.cli.inspect_text import weights_lines
    from fusec.dtypes import DType
    from fusec.ops import Op
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import optimize

    rng = np.random.default_rng(0)
    b = GraphBuilder("m")
    h = b.emit(Op.MATMUL, b.input("x", (1, 4, 48), DType.F32), b.const(rng.standard_normal((48, 64), np.float32)))
    b.output(b.emit(Op.MATMUL, b.emit(Op.RELU, h), b.const(rng.standard_normal((64, 8), np.float32))), "y")
    rec = optimize(b.build(), PassOptions(quantize="int4", quantize_group=32))[0].meta["quantized"]
    assert rec["products"] == 0 and rec["kept"] == {"K=48 is not a multiple of 32": 1,
                                                    "the LM head (--quantize-head packs it)": 1}, rec
    w = {"step_bytes": 1024, "by_format": {}, "tensors": []}
    line = next(x for x in weights_lines(w, rec) if x.startswith("quantized"))
    assert line == ("quantized   no product with --quantize int4 (1 kept: K=48 is not a multiple of 32; 1 kept: the "
                    "LM head (--quantize-head packs it))"), line
    line = next(x for x in weights_lines(w, {"method": "int4", "products": 0}) if x.startswith("quantized"))
    assert line.endswith("(no product over a constant weight)"), line
    lines = weights_lines(w, {"method": "int4", "group": 32, "products": 14})
    assert "quantized   14 products with --quantize int4 (group 32)" in lines
    assert not any(line.startswith("quantized") for line in weights_lines(w, None))
