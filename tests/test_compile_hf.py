"""fusec.compile on real exporter output, with no GPU: every tiny HF family, both torch
exporters, compiles (NVRTC) into a plan whose launch list covers the whole model."""

from __future__ import annotations

import pytest
from hf_models import EXPORTERS, FAMILIES, export_hf

import fusec


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_export_compiles_without_a_gpu(family: str, exporter: str) -> None:
    path, inputs, _ = export_hf(family, exporter)
    shapes = {k: v.shape for k, v in inputs.items()}
    plan = fusec.compile(path, shapes=shapes, dtype="fp16", arch="sm_90")
    info = plan.info()
    assert [d["name"] for d in info["inputs"]] == list(inputs)
    assert info["launches"] > 0
    patterns = plan.manifest["report"].get("patterns", {})
    assert patterns.get("attention", 0) == 2, f"{family}/{exporter}: attention not recognized per layer: {patterns}"
