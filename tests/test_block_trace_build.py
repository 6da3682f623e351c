"""FUSEC_TRACE (benchmarks/block_trace.py's per-block timestamps) on the CPU: a traced kernel is another
binary under another cache key, with the module global the benchmark reads; untraced kernels carry no
trace code."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.build_gemm import gemv_form
from fusec.codegen.kernels import build
from fusec.dtypes import DType


def test_the_trace_is_another_binary_with_its_global(monkeypatch) -> None:  # noqa: ANN001
    spec = S.GemvSpec(1, 4096, 1024, DType.BF16, norm=True, **gemv_form(4096, 1024, DType.BF16))
    plain = build(spec, "sm_90")
    monkeypatch.setenv("FUSEC_TRACE", "1")
    traced = build(spec, "sm_90")
    assert traced.source == plain.source  # the same source: the trace is a compile option
    assert traced.binary.key != plain.binary.key and traced.binary.cubin != plain.binary.cubin
    assert b"fc_trace" in traced.binary.cubin and b"fc_trace" not in plain.binary.cubin
