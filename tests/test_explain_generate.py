"""``fusec explain MODEL --generate``: an entry of the generation plan ``compile --generate`` makes, explained
from the same staging (sizes, dtype, weight layout, states), with kernel selection's records."""

from __future__ import annotations

import json

import pytest

from fusec.cli import main


def _explain(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["explain", "llama-tiny", "--generate", "--batch", "2", "--max-seq-len", "64", "--max-prompt-len",
                 "8", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_each_entry_counts_the_launches_the_compiled_plan_has(capsys: pytest.CaptureFixture[str]) -> None:
    from fusec.codegen.compile import default_arch
    from fusec.compiler import compile_generation

    plan = compile_generation("llama-tiny", batch=2, max_seq_len=64, prefill_len=8, dtype="bf16", arch=default_arch(),
                              join=1)
    for entry in ("decode", "prefill", "join"):
        report = _explain(capsys, "--entry", entry, "--join")
        assert report["entry"] == entry
        assert report["launches"] == len(plan.manifest["entries"][entry]["launches"]), entry
    decode = _explain(capsys)  # the decode step by default: its attention shows the form kernel selection recorded
    kernels = [k for layer in decode["layers"].values() for k in layer["kernels"]]
    attn = [k for k in kernels if "kv_attention" in k]
    assert attn and all("splits" in k and "prefetch" in k for k in attn), attn


def test_generation_options_are_checked(capsys: pytest.CaptureFixture[str], tmp_path) -> None:  # noqa: ANN001
    assert main(["explain", "llama-tiny", "--generate", "--entry", "admit"]) == 1
    err = capsys.readouterr().err
    assert "no admit entry" in err and "--admit-batch A" in err
    assert main(["explain", "llama-tiny", "--batch", "4"]) == 1
    assert "--batch applies to generation plans (--generate)" in capsys.readouterr().err
    assert main(["compile", "gpt2-tiny", "--max-seq-len", "64", "-o", str(tmp_path / "x.fplan")]) == 1  # compile too
    assert "--max-seq-len applies to generation plans (--generate)" in capsys.readouterr().err
    assert not (tmp_path / "x.fplan").exists()
    assert main(["explain", "llama-tiny", "--generate", "--batch", "0"]) == 1
    assert "--batch must be a positive integer" in capsys.readouterr().err


def test_each_layer_lists_its_own_kernels_and_the_step_s_tail_is_the_model_s(
        capsys: pytest.CaptureFixture[str]) -> None:
    decode = _explain(capsys)
    layers = {k: [x.split(" (")[0] for x in v["kernels"]] for k, v in decode["layers"].items()}
    model = layers.pop("model")
    assert sorted(layers) == ["layers.0", "layers.1"]
    assert layers["layers.0"] == layers["layers.1"], layers  # the o product is each layer's, not the model's
    assert sum("matmul" in k for k in layers["layers.0"]) == 4, layers  # qkv, o, gate/up, down
    # the LM head, its sampler and what the step does with the token read no layer's weight: the model's
    assert any("gemm_sample" in k for k in model) and "cache_write" in model, model
    assert not any("matmul" in k and "sample" not in k for k in model), model
