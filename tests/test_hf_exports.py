"""Real exporter output: tiny HF models (tests/hf_models.py) exported by the legacy (TorchScript)
and dynamo exporters, imported by fusec, run by the numpy reference and compared with onnxruntime
on the same file and inputs (and with torch itself, which checks the export)."""

from __future__ import annotations

import hf_models
import numpy as np
import onnxruntime as ort
import pytest

from fusec import reference
from fusec.frontend.onnx_import import import_onnx
from fusec.ir import verify

CASES = [(f, e, "eager") for f in hf_models.FAMILIES for e in hf_models.EXPORTERS]
CASES += [("llama", "dynamo", "sdpa"), ("bert", "legacy", "sdpa")]


@pytest.mark.slow
@pytest.mark.parametrize("family, exporter, attn", CASES, ids=["-".join(c) for c in CASES])
def test_hf_export_matches_onnxruntime(family: str, exporter: str, attn: str) -> None:
    path, inputs, model = hf_models.export_hf(family, exporter, attn=attn)
    g = import_onnx(path, {k: v.shape for k, v in inputs.items()})
    verify(g)
    assert [v.name for v in g.inputs] == ["input_ids", "attention_mask"]
    out_name = hf_models.OUTPUT_NAME[family]
    assert [v.name for v in g.outputs] == [out_name]
    got = reference.run(g, inputs)[out_name]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # the test machine's cores are shared
    want = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"]).run([out_name], inputs)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.isfinite(want).all()
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    ctx = f"{family}/{exporter}/{attn} (FUSEC_HF_SEED={hf_models.SEED})"
    assert rel <= 1e-5, f"{ctx}: ||ref - ort|| / ||ort|| = {rel:.3g}"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=ctx)
    # the export itself is faithful (a looser bound: torch and onnxruntime order sums differently)
    np.testing.assert_allclose(hf_models.torch_forward(family, model, inputs), want, rtol=1e-3, atol=1e-4,
                               err_msg=ctx)
