"""Hostile plans on a GPU (issue 10, item 2): a plan whose cubin was replaced and the container
re-hashed is refused by ``fusec.load`` before any code loads: no module reaches the driver."""

from __future__ import annotations

import numpy as np
import pytest

import fusec
from fusec.planfile import PlanFileError, read_plan, write_plan

pytestmark = pytest.mark.gpu


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Every cubin handed to the CUDA driver (cupy Module.load) and every plan Device made while
    the test runs. cupy's Module is an immutable extension type: a recording subclass stands in."""
    import cupy.cuda.function

    import fusec.runtime.executor as ex

    calls: list[str] = []

    class RecordingModule(cupy.cuda.function.Module):
        def load(self, cubin):
            calls.append(f"module of {len(cubin)} bytes")
            return super().load(cubin)

    monkeypatch.setattr(cupy.cuda.function, "Module", RecordingModule)
    real_init = ex.Device.__init__

    def device_init(self, *a, **k):
        calls.append("Device")
        return real_init(self, *a, **k)

    monkeypatch.setattr(ex.Device, "__init__", device_init)
    return calls


def _with_cubin(tmp_path, plan_path, make_cubin):
    pf = read_plan(plan_path)
    blobs = {n: bytes(pf.blob(n)) for n in pf.names()}
    name = pf.manifest["modules"][0]["cubin"]
    blobs[name] = make_cubin(blobs[name])
    out = tmp_path / "replaced.fplan"
    write_plan(out, pf.manifest, blobs)  # re-hashed: only the manifest checks can catch it
    return out


def _other_arch_cubin(arch: str) -> bytes:
    from fusec.codegen.compile import compile_cuda

    other = "sm_80" if arch != "sm_80" else "sm_90"
    return compile_cuda('extern "C" __global__ void k(float* x) { x[0] = 1; }', "k", other, use_disk=False).cubin


def test_a_plan_with_a_replaced_cubin_is_refused_before_any_code_loads(tmp_path, loads) -> None:
    from fusec.device import gpu_arch

    arch = gpu_arch()
    plan = fusec.compile("gpt2-tiny", arch=arch)
    good = tmp_path / "good.fplan"
    plan.save(good)
    ids = np.random.default_rng(0).integers(0, 1000, (1, 16)).astype(np.int64)
    inputs = {"input_ids": ids, "attention_mask": np.ones((1, 16), np.int64)}

    rng = np.random.default_rng(1)
    for make in (lambda c: bytes(rng.integers(0, 256, len(c), np.uint8)),    # random bytes
                 lambda c: b"\x7fELF" + bytes(rng.integers(0, 256, len(c) - 4, np.uint8)),  # ELF magic, junk after
                 lambda c: _other_arch_cubin(arch)):                            # a real cubin, wrong arch
        bad = _with_cubin(tmp_path, good, make)
        with pytest.raises(PlanFileError, match="module 'm0'"):
            fusec.load(bad)
        with pytest.raises(PlanFileError):
            fusec.load(bad, recompile=True)
    assert loads == [], "a module reached the driver before the plan was refused"

    # the untouched plan loads its modules (through the recorder) and runs
    out = fusec.load(good).run(inputs)
    assert "Device" in loads and any(c.startswith("module") for c in loads)
    assert out["logits"].shape == (1, 16, 1000)
