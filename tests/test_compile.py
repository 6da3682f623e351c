"""fusec.compile on the CPU: every tiny built-in model compiles (NVRTC, sm_80 and sm_90) into a
plan whose file round-trips, and whose launch list addresses only planned memory."""

from __future__ import annotations

import numpy as np
import pytest

import fusec
from fusec.errors import InputError
from fusec.planfile import PlanFileError

TINY = ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"]


@pytest.fixture(scope="module")
def plans():
    return {(m, a): fusec.compile(m, dtype="fp16", arch=a) for m in TINY for a in ("sm_80", "sm_90")}


@pytest.mark.parametrize("model", TINY)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_tiny_models_compile_for_both_archs(plans, model: str, arch: str) -> None:
    plan = plans[(model, arch)]
    info = plan.info()
    assert info["arch"] == arch and info["dtype"] == "fp16"
    assert info["launches"] == len(plan.manifest["launches"]) > 0
    for m in plan.manifest["modules"]:
        assert bytes(plan.blob(m["cubin"]))[:4] == b"\x7fELF"
    arena = plan.manifest["memory"]["arena_bytes"]
    for sig in plan.manifest["inputs"] + plan.manifest["outputs"]:
        assert 0 <= sig["offset"] < arena


def test_plan_file_round_trip(tmp_path, plans) -> None:
    plan = plans[("gpt2-tiny", "sm_90")]
    path = tmp_path / "g.fplan"
    plan.save(path)
    back = fusec.load(path)
    assert back.manifest == plan.manifest
    for name in ("weights", plan.manifest["modules"][0]["cubin"]):
        assert bytes(back.blob(name)) == bytes(plan.blob(name))


def test_corrupted_and_truncated_plans_are_refused(tmp_path, plans) -> None:
    from fusec.plan import Plan

    path = tmp_path / "g.fplan"
    plans[("bert-tiny", "sm_90")].save(path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 3])
    with pytest.raises(PlanFileError):
        fusec.load(path)
    bad = bytearray(raw)
    bad[len(bad) // 2] ^= 0x55  # inside the weights: checked on first use, or at once with verify="all"
    path.write_bytes(bytes(bad))
    with pytest.raises(PlanFileError, match="blob 'weights': checksum"):
        fusec.load(path).blob("weights")
    with pytest.raises(PlanFileError, match="blob 'weights': checksum"):
        Plan.load(path, verify="all")


def test_manifest_cross_references_are_checked(plans) -> None:
    from fusec.plan import Plan

    plan = plans[("gpt2-tiny", "sm_90")]
    m = dict(plan.manifest)
    m["launches"] = [dict(m["launches"][0], kernel=10**6)] + m["launches"][1:]
    with pytest.raises(PlanFileError, match="launch #0: kernel index out of range"):
        Plan(m, {k: plan.blob(k) for k in ("weights", *[x["cubin"] for x in m["modules"]], *[x["source"] for x in m["modules"]])})


def test_bad_dtype_and_arch_are_refused() -> None:
    with pytest.raises(InputError, match="unknown dtype"):
        fusec.compile("gpt2-tiny", dtype="fp8")
    with pytest.raises(InputError, match="--arch"):
        fusec.compile("gpt2-tiny", arch="hopper")


def test_weights_blob_holds_the_constants_in_storage_dtype(plans) -> None:
    plan = plans[("llama-tiny", "sm_90")]
    w = np.frombuffer(bytes(plan.blob("weights")), dtype=np.uint8)
    assert w.size == plan.manifest["memory"]["weights_bytes"] and w.any()


@pytest.mark.slow
@pytest.mark.parametrize("model,dtype", [("gpt2-small", "fp16"), ("minilm", "fp16"), ("bert-base", "fp16"),
                                         ("qwen3-0.6b", "bf16")])
def test_large_built_in_models_compile_without_a_gpu(model: str, dtype: str) -> None:
    plan = fusec.compile(model, dtype=dtype, arch="sm_90")
    rep = plan.manifest["report"]
    layers = {"gpt2-small": 12, "minilm": 6, "bert-base": 12, "qwen3-0.6b": 28}[model]
    assert rep["patterns"]["attention"] == layers
    mem = plan.manifest["memory"]
    assert mem["planned_bytes"] <= 1.1 * mem["lower_bound_bytes"]
    assert plan.info()["launches"] > layers
