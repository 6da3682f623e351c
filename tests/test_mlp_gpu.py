"""The fused MLP kernel (``MlpSpec``: Linear -> activation -> Linear [+ residual] in one launch) on
the GPU (skipped without one), against the numpy reference of the unfused graph: GPT-2 small's and
BERT-base's shapes, odd sizes (M not a multiple of the row tile, F and N odd multiples of 8, K with
a partial k step), both weight layouts, an x that starts mid-buffer, fp16 and bf16; and whole
plans with ``mlp`` enabled, eager and as a CUDA graph, against the plan without it.
Outputs are poisoned first; tolerances as in test_kernels_gpu."""

from __future__ import annotations

import numpy as np
import pytest

from fusec import reference
from fusec.codegen import kernels as K
from fusec.dtypes import DType
from fusec.lower import mlp

from mlp_graphs import body_of, feeds, kernel_args, mlp_graph
from test_kernels_gpu import BF16, F16, TOL, dev, host, poisoned, rel_err

pytestmark = pytest.mark.gpu
SEED = int(np.random.default_rng().integers(1 << 30))  # fresh data each run (reported on failure)


def _upload(a: np.ndarray, misalign: bool = False):  # noqa: ANN202
    """A flat device copy of ``a``; ``misalign``: starting 2 bytes past a 16-byte boundary (x read
    through a view that starts mid-buffer)."""
    import cupy as cp

    d = dev(np.ascontiguousarray(a).reshape(-1))
    if misalign:
        buf = cp.zeros(d.size + 1, dtype=d.dtype)
        buf[1:] = d
        d = buf[1:]
    return d


def _check(dt: DType, lead: tuple[int, ...], k: int, f: int, n: int, act: str = "gelu_tanh",
           nk: tuple[bool, bool] = (False, False), misalign: bool = False, **kw: bool) -> None:
    g = mlp_graph(dt, lead, k, f, n, act=act, w1_nk=nk[0], w2_nk=nk[1], seed=SEED, **kw)
    cut = body_of(g)
    p = mlp.plan(cut.body)
    spec = p.spec(x_vec=not misalign)
    inputs = feeds(g, SEED + 1)
    args = [_upload(a, misalign and i == 0) for i, a in enumerate(kernel_args(cut, p, inputs))]
    out = poisoned((spec.M, spec.N), spec.out_dtype)
    ck = K.build(spec)
    import cupy as cp

    K.launch(ck, args + [out])
    cp.cuda.runtime.deviceSynchronize()
    want = reference.run(g, inputs)["y"].reshape(spec.M, spec.N).astype(np.float64)
    got = host(out, spec.out_dtype).astype(np.float64)
    err = rel_err(got, want)
    assert err <= TOL[dt], f"seed {SEED}: {spec.tiles}: relative error {err:.3g} > {TOL[dt]}"


@pytest.mark.parametrize("dt", [F16, BF16])
def test_gpt2_small_mlp(dt: DType) -> None:
    _check(dt, (8, 128), 768, 3072, 768)  # Conv1D weights [K, F], [F, N]; tanh GELU; bias; residual


@pytest.mark.parametrize("dt", [F16, BF16])
def test_bert_base_mlp(dt: DType) -> None:
    _check(dt, (32, 128), 768, 3072, 768, act="gelu", nk=(True, True))  # nn.Linear weights read [N, K]


@pytest.mark.parametrize("dt", [F16, BF16])
@pytest.mark.parametrize("lead,k,f,n,act,nk,kw", [
    ((77,), 72, 200, 40, "silu", (True, True), {}),  # M, K, F, N all off the tiles
    ((3, 11), 136, 328, 104, "quick_gelu", (False, True), {"residual": False}),  # a chain of ops as the activation
    ((1,), 64, 256, 64, "relu", (True, False), {"bias": False}),  # one row (decode)
    ((5, 13), 200, 1000, 776, "gelu_tanh", (False, False), {}),  # N split over several blocks with a tail
])
def test_odd_sizes(dt: DType, lead: tuple[int, ...], k: int, f: int, n: int, act: str, nk: tuple[bool, bool],
                   kw: dict[str, bool]) -> None:
    _check(dt, lead, k, f, n, act=act, nk=nk, **kw)


def test_x_starting_mid_buffer() -> None:
    _check(F16, (33,), 96, 264, 72, misalign=True)


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny", "hf-gpt2"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_plans_with_mlp_enabled_match_the_plan_without(model: str, dtype: str) -> None:
    """The whole path: fusion applies the candidate, kernel selection records the family, the
    lowering emits one launch per MLP; eager and CUDA-graph (PDL on sm_90) runs agree with the
    rule-based plan within the dtype's tolerance, and the graph replay is bitwise the eager run.
    hf-gpt2: HF GPT-2 exported to ONNX (reshapes around each product, inside the fused body)."""
    import fusec
    from fusec.ab.decide import rel_error
    from fusec.ab.runner import GpuRunner

    shapes = None
    if model == "hf-gpt2":
        pytest.importorskip("transformers")
        import hf_models

        path, hf_inputs, _ = hf_models.export_hf("gpt2", "legacy")
        model, shapes = path, {k: v.shape for k, v in hf_inputs.items()}
    runner = GpuRunner()
    base = fusec.compile(model, shapes=shapes, dtype=dtype)
    on = fusec.compile(model, shapes=shapes, dtype=dtype, enabled_fusions=["mlp"])
    graph = on.with_cuda_graph(True)  # the same kernels and memory, replayed as one CUDA graph
    assert sum(1 for L in on.manifest["launches"] if L["label"].endswith(" mlp")) == 2
    inputs = runner.inputs(base, SEED)
    want = runner.outputs(base, inputs)
    got = runner.outputs(on, inputs)
    err = rel_error(got, want)
    assert err <= TOL[DType.F16 if dtype == "fp16" else DType.BF16] * 5, f"seed {SEED}: {err:.3g}"
    replay = runner.outputs(graph, inputs)
    assert all(np.array_equal(replay[k], got[k]) for k in got)
