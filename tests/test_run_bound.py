"""``plan.bind(inputs, outputs)``: run() is one CUDA-graph launch over buffers bound once
(fusec.runtime.bound). CPU: the refusal without a GPU. GPU: same outputs as ``plan.run`` for bound
caller arrays and for the plan's own input buffers, the caller's later writes are seen, wrong
buffers are refused at bind naming them, and a run is one graph launch (CUPTI, where available)."""

from __future__ import annotations

import numpy as np
import pytest

import fusec
from fusec.errors import FusecError, InputError
from fusec.inputs import random_inputs_for

MODEL = "gpt2-tiny"


def _no_gpu() -> bool:
    from fusec.device import gpu_available

    return not gpu_available()


@pytest.mark.skipif(not _no_gpu(), reason="checks the refusal on a machine without a GPU")
def test_bind_without_a_gpu_is_one_line_error() -> None:
    plan = fusec.compile(MODEL, dtype="fp32", arch="sm_90")
    with pytest.raises(FusecError, match="no GPU"):
        plan.bind()


@pytest.fixture(scope="module")
def plan():  # noqa: ANN201
    return fusec.compile(MODEL, dtype="fp16")


@pytest.mark.gpu
def test_bound_run_matches_run_and_sees_later_writes(plan) -> None:  # noqa: ANN001
    import cupy

    sig = plan.manifest["inputs"]
    first, second = random_inputs_for(sig, 1), random_inputs_for(sig, 2)
    want1 = {k: cupy.asnumpy(v) for k, v in plan.run(first).items()}
    want2 = {k: cupy.asnumpy(v) for k, v in plan.run(second).items()}
    dev_in = {k: cupy.asarray(v) for k, v in first.items()}
    dev_out = {k: cupy.full(v.shape, np.nan, dtype=v.dtype) for k, v in want1.items()}  # poisoned
    bound = plan.bind(dev_in, dev_out)
    bound.run()
    cupy.cuda.get_current_stream().synchronize()
    for k, v in want1.items():
        assert np.array_equal(cupy.asnumpy(dev_out[k]), v), k
    for k, v in second.items():  # the caller writes its own buffers; the next run reads them
        dev_in[k][...] = cupy.asarray(v)
    bound.run()
    cupy.cuda.get_current_stream().synchronize()
    for k, v in want2.items():
        assert np.array_equal(cupy.asnumpy(dev_out[k]), v), k
    assert bound.host_enqueue_ms is not None and bound.host_enqueue_ms > 0


@pytest.mark.gpu
def test_unbound_inputs_are_the_plans_own_buffers(plan) -> None:  # noqa: ANN001
    import cupy

    inputs = random_inputs_for(plan.manifest["inputs"], 3)
    want = {k: cupy.asnumpy(v) for k, v in plan.run(inputs).items()}
    bound = plan.bind()
    for k, v in inputs.items():
        bound.inputs[k][...] = cupy.asarray(v)
    bound.run()
    cupy.cuda.get_current_stream().synchronize()
    for k, v in want.items():
        assert np.array_equal(cupy.asnumpy(bound.outputs[k]), v), k


@pytest.mark.gpu
def test_bind_refuses_wrong_buffers_naming_them(plan) -> None:  # noqa: ANN001
    import cupy

    name = plan.manifest["inputs"][0]["name"]
    with pytest.raises(InputError, match=f"input '{name}'"):
        plan.bind({name: cupy.zeros((1, 1), dtype=np.int64)})
    with pytest.raises(InputError, match="no input 'nope'"):
        plan.bind({"nope": cupy.zeros(1)})
    with pytest.raises(InputError, match="device array"):
        plan.bind({name: np.zeros(3)})


@pytest.mark.gpu
def test_bound_run_is_one_graph_launch(plan) -> None:  # noqa: ANN001
    from fusec.runtime.counters import DriverCounters

    bound = plan.bind()
    bound.run()
    counters = DriverCounters.create()
    if not counters.available:
        pytest.skip(f"CUPTI unavailable: {counters.reason}")
    counters.start()
    bound.run()
    counters.stop()
    res = counters.result()
    assert res["graph_launches"] == 1 and res["kernel_launches"] == 0
    assert res["allocations"] == 0 and res["syncs"] == 0 and res["memcpy_calls"] == 0
