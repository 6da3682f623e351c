"""`fusec explain`, `fusec inspect` and `fusec compile` count the same plan: the same default dtype
(fp16), the same staging path, and the lowering's launches (issue 19, point 1). Decode-sized
(every product a GEMV) and prefill-sized (cuBLAS GEMMs and their epilogue kernels) shapes."""

from __future__ import annotations

import pytest

import fusec
from fusec.cli.explain import explain
from fusec.cli.inspect import optimized_report
from fusec.loader import load_graph

CASES = [("gpt2-tiny", None), ("gpt2-tiny", {"input_ids": (2, 32), "attention_mask": (2, 32)}),
         ("llama-tiny", None), ("llama-tiny", {"input_ids": (1, 48), "attention_mask": (1, 48)})]


@pytest.mark.parametrize("model,shapes", CASES)
def test_explain_inspect_and_compile_count_the_same_launches(model: str, shapes) -> None:  # noqa: ANN001
    plan = fusec.compile(model, shapes=shapes, arch="sm_90")  # the default dtype
    launches = plan.manifest["launches"]
    assert plan.manifest["dtype"] == "fp16"
    told = explain(load_graph(model, shapes))
    inspected = optimized_report(load_graph(model, shapes))
    assert told["launches"] == inspected["kernels"] == len(launches) > 0
    # the prefill shapes' products run on fusec's GEMM (sm_90's default for at most 128 rows), decode shapes' GEMVs
    products = [L for L in launches if L["type"] == "gemm" or L["label"].endswith("fusec_gemm")]
    assert bool(products) == (shapes is not None)
    # the dry run's counts by template are the compiled plan's
    assert inspected["kernels_by_kind"] == plan.manifest["report"]["lowering"]["by_template"]
    assert inspected["kernels_by_kind"].get("cublas_gemm", 0) == sum(L["type"] == "gemm" for L in launches)
