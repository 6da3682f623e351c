"""The 3xTF32 rewrite (passes/split_tf32.py) and the rope_siblings fusion: adversarial
graphs whose rewritten reference must equal the unrewritten one, and the --fp32-gemm plumbing."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.ops import Op
from fusec.passes.base import PassOptions
from fusec.passes.pipeline import optimize

TINY = {"input_ids": (2, 128), "attention_mask": (2, 128)}


def test_report_of_an_sgemm_plan_restages_with_its_recorded_fp32_gemm(tmp_path) -> None:  # noqa: ANN001
    import fusec
    from fusec.report.subject import load_subject

    path = tmp_path / "sgemm.fplan"
    fusec.compile("gpt2-tiny", shapes=TINY, dtype="fp32", arch="sm_90", fp32_gemm="sgemm").save(str(path))
    sub = load_subject(str(path))
    assert sub.missing is None and sub.graph is not None
    assert "tf32_split" not in sub.graph.op_histogram()


def _tampered(tmp_path, options: dict) -> str:  # noqa: ANN001
    """A gpt2-tiny fp32 plan whose manifest's source.options is replaced by ``options``."""
    import fusec
    from fusec.planfile import read_plan, write_plan

    good = tmp_path / "good.fplan"
    fusec.compile("gpt2-tiny", shapes={"input_ids": (1, 16), "attention_mask": (1, 16)}, dtype="fp32",
                  arch="sm_90").save(str(good))
    pf = read_plan(str(good))
    m = {k: v for k, v in pf.manifest.items() if k != "blobs"}
    m["source"] = dict(m["source"], options=options)
    bad = tmp_path / "bad.fplan"
    write_plan(str(bad), m, {name: bytes(pf.blob(name)) for name in pf._table})
    return str(bad)


def test_plan_source_options_admit_only_compile_options(tmp_path) -> None:  # noqa: ANN001
    """A re-target from source passes source.options to fusec.compile as keywords: a string option
    (allowed for fp32_gemm) named dump_dir made it write pass dumps where the plan said."""
    import os

    from fusec.errors import FusecError
    from fusec.passes.split_tf32 import MODES
    from fusec.plancheck import FP32_GEMM_MODES
    from fusec.retarget import recompile

    assert tuple(FP32_GEMM_MODES) == tuple(MODES)
    evil = tmp_path / "evil"
    for options, why in (({"dump_dir": str(evil)}, "unknown key"), ({"fp32_gemm": "fast"}, "is not one of"),
                         ({"fp32_gemm": ["sgemm"]}, "is not one of")):
        bad = _tampered(tmp_path, options)
        with pytest.raises(FusecError, match=why):
            recompile(bad, "sm_80", str(tmp_path / "out.fplan"), from_source=True)
        assert not os.path.exists(evil)


def _const_bytes(g) -> int:  # noqa: ANN001
    return sum(c.nbytes for c in g.constants)


def test_split_tf32_extra_bytes_of_a_weight_read_in_both_layouts() -> None:
    """W (more than constant_fold's layout limit) read as x @ W and, through the transpose flag,
    x2 @ W^T: two W3s (one per layout) replace W, which dies: 6 - 1 = 5x its bytes (was 6x, each W3
    counted as if the other product kept W alive). The counter must equal the constants' growth."""
    from fusec import reference
    from fusec.passes import dce, pipeline

    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.1, (128, 128)).astype(np.float32)
    b = GraphBuilder("both_layouts")
    x, x2 = b.input("x", (256, 128), DType.F32), b.input("x2", (256, 128), DType.F32)
    wv = b.const(w, "w")
    b.output(b.emit(Op.MATMUL, x, wv), "y1")
    b.output(b.emit(Op.MATMUL, x2, b.emit(Op.TRANSPOSE, wv, perm=(1, 0))), "y2")
    g = b.build()
    i = [pipeline.pass_name(m) for m in pipeline.PIPELINE].index("split_tf32")
    pre, _ = optimize(g, PassOptions(fp32_gemm="3xtf32"), pipeline=pipeline.PIPELINE[:i])
    assert sorted(bool(n.attrs.trans_b) for n in pre.nodes if n.op == Op.MATMUL) == [False, True]
    assert [c.name for c in pre.constants] == ["w"]  # one weight, read in both layouts
    post, opts = optimize(pre, PassOptions(fp32_gemm="3xtf32"), pipeline=[pipeline.PIPELINE[i], dce])
    assert opts.stats["gemms_split_tf32"] == 2
    assert opts.stats["split_tf32_extra_bytes"] == _const_bytes(post) - _const_bytes(pre) == 5 * w.nbytes
    feed = {"x": rng.normal(0, 1, (256, 128)).astype(np.float32), "x2": rng.normal(0, 1, (256, 128)).astype(np.float32)}
    got, want = reference.run(post, feed), reference.run(g, feed)
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-5 * np.abs(want[k]).max()


def test_an_infinite_activation_stays_infinite_through_3xtf32() -> None:
    """A non-finite x meets hi(W) only (the split puts 0 in the block that meets lo(W)), as in an SGEMM."""
    from test_split_tf32 import inf_row_case

    from fusec import reference
    from fusec.compiler import stage

    g, feed = inf_row_case(1)
    st = stage(g, "fp32", "sm_90", dry_run=True)
    assert st.report["gemms_split_tf32"] == 1
    want = reference.run(g, feed)["y"]
    assert np.isposinf(want[0]).all()
    got = reference.run(st.graph, feed)["y"]
    np.testing.assert_array_equal(got[0], want[0])


def _two_ropes(variant: str):  # noqa: ANN202
    """x @ [Wq | Wk] (merged by merge_gemms) -> q heads [2, 2, 8, 64] and k heads [2, 1, 8, 64],
    each rotated; ``variant``: "between" (a reader of q placed before k's RoPE), "k_twice" (k also
    read outside), "k_from_q" (k's input reads q: grouping would be a cycle), "diffpos" (k's cos
    differs: not siblings)."""
    rng = np.random.default_rng(0)
    B, S, E, D = 2, 8, 128, 64
    b = GraphBuilder(variant)
    x = b.input("x", (B, S, E), DType.F32)
    cos, sin, cos2 = (b.input(n, (S, D), DType.F32) for n in ("cos", "sin", "cos2"))

    def heads(w, h):  # noqa: ANN001, ANN202
        y = b.emit(Op.RESHAPE, b.emit(Op.MATMUL, x, b.const(w, f"w{h}")), shape=(B, S, h, D))
        return b.emit(Op.TRANSPOSE, y, perm=(0, 2, 1, 3))

    q = b.emit(Op.ROPE, heads(rng.normal(0, 0.1, (E, 2 * D)).astype(np.float32), 2), cos, sin, rotary_dim=D)
    if variant == "between":
        b.output(b.emit(Op.MUL, q, q), "qq")
    kin = heads(rng.normal(0, 0.1, (E, D)).astype(np.float32), 1)
    if variant == "k_from_q":
        kin = b.emit(Op.ADD, kin, b.emit(Op.SLICE, q, axes=(1,), starts=(0,), ends=(1,), steps=(1,)))
    k = b.emit(Op.ROPE, kin, cos2 if variant == "diffpos" else cos, sin, rotary_dim=D)
    b.output(q, "q")
    b.output(k, "k")
    if variant == "k_twice":
        b.output(b.emit(Op.ADD, k, k), "k2")
    feeds = {"x": rng.normal(0, 1, (B, S, E)).astype(np.float32)}
    feeds.update({n: rng.normal(0, 1, (S, D)).astype(np.float32) for n in ("cos", "sin", "cos2")})
    return b.build(), feeds


@pytest.mark.parametrize("variant,grouped", [("between", True), ("k_twice", True), ("k_from_q", False),
                                             ("diffpos", False)])
def test_rope_siblings_on_adversarial_graphs(variant: str, grouped: bool) -> None:
    from fusec import reference
    from fusec.compiler import stage
    from fusec.passes.fusion import describe_kernels

    g, feeds = _two_ropes(variant)
    out = optimize(g, PassOptions())[0]
    sib = [k for k in describe_kernels(out) if k.startswith("rope_siblings")]
    assert len(sib) == (1 if grouped else 0), describe_kernels(out)
    got, want = reference.run(out, feeds), reference.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    labels = [L["label"] for L in stage(g, "fp32", "sm_90", dry_run=True).lowered.launches]
    assert sum("rope_siblings" in lab for lab in labels) == (1 if grouped else 0), labels
