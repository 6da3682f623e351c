"""Review of the 3xTF32 rewrite (passes/split_tf32.py) and the rope_siblings fusion: adversarial
graphs whose rewritten reference must equal the unrewritten one, and the --fp32-gemm plumbing."""

from __future__ import annotations

import numpy as np

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
