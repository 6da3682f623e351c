"""Lowering on the CPU: the view algebra against numpy, the fused plan against the reference,
and the launch list against the dry run."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fusec
from fusec import reference
from fusec.builder import GraphBuilder
from fusec.dtypes import DType
from fusec.inputs import random_inputs
from fusec.ir import verify
from fusec.loader import load_graph
from fusec.lower import layout as L
from fusec.lower import lower
from fusec.lower.fused_plan import can_fuse
from fusec.ops import Op
from fusec.passes.memory_plan import plan_memory
from fusec.passes.pipeline import optimize

TINY = ["gpt2-tiny", "bert-tiny", "llama-tiny", "qwen3-tiny"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.data())
def test_nocopy_reshape_agrees_with_numpy(dims, data) -> None:
    base = np.arange(int(np.prod(dims)) * 8).reshape([d * 2 for d in dims[:1]] + dims[1:] + [4])
    view = base[::2, ..., 1] if len(dims) > 0 else base  # a strided view: step 2 on axis 0, fixed last index
    perm = data.draw(st.permutations(range(view.ndim)))
    view = view.transpose(perm)
    n = view.size
    target = data.draw(st.sampled_from([s for s in _factorizations(n)]))
    v = L.View(tuple(view.shape), tuple(s // view.itemsize for s in view.strides),
               (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize)
    got = L.reshape(v, target)
    try:
        want = view.view()
        want.shape = target  # numpy raises when the reshape needs a copy
    except AttributeError:
        want = None
    if want is None:
        assert got is None
    else:
        assert got is not None
        flat = base.reshape(-1)
        idx = np.indices(target).reshape(len(target), -1)
        addr = got.offset + sum(idx[k] * got.strides[k] for k in range(len(target)))
        assert np.array_equal(flat[addr].reshape(target), want)


def _factorizations(n: int) -> list[tuple[int, ...]]:
    out = [(n,)]
    for a in range(1, n + 1):
        if n % a == 0:
            out.append((a, n // a))
            for b in range(1, n // a + 1):
                if (n // a) % b == 0:
                    out.append((a, b, n // a // b))
    return out


@pytest.mark.parametrize("model", TINY)
def test_fused_plan_keeps_the_reference_numbers(model: str) -> None:
    graph = load_graph(model)
    x = random_inputs(graph, seed=3)
    g, _ = optimize(graph)
    verify(g)
    assert all(can_fuse(n.attrs.body) for n in g.nodes if n.op == Op.FUSED)
    want = reference.run(graph, x)
    got = reference.run_planned(g, x, plan_memory(g))
    for k in want:
        assert np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k]) < 1e-5


@pytest.mark.parametrize("model", TINY)
def test_dry_run_counts_the_compiled_launches(model: str) -> None:
    g, _ = optimize(load_graph(model))
    offsets = plan_memory(g).offsets
    assert lower(g, offsets, "sm_90", dry_run=True).report["launches"] == lower(g, offsets, "sm_90").report["launches"]


def test_swiglu_and_attention_layouts_lower_to_single_kernels() -> None:
    plan = fusec.compile("llama-tiny", dtype="fp16", arch="sm_90")
    kinds = plan.manifest["report"]["lowering"]["by_template"]
    assert kinds.get("fused_attention") == 2 and kinds.get("fused_rope") == 4
    assert "copy" not in kinds, f"layout ops should be absorbed into strides, got {kinds}"


def _odd_n_graph(dtype: DType):
    rng = np.random.default_rng(0)
    b = GraphBuilder("oddn")
    x = b.input("x", (4, 5, 64), dtype)  # 20 rows: cuBLAS (the skinny product takes 16 or fewer)
    w = b.const((rng.standard_normal((64, 1001)) * 0.1).astype(np.float32), name="w", dtype=dtype)
    b.output(b.emit(Op.MATMUL, x, w), "y")
    return b.build()


def test_odd_n_gemm_computes_into_a_padded_arena_value_no_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSEC_GEMM_STREAM", "0")  # cuBLAS's padded product (sm_90 runs few rows on fusec's GEMM)
    plan = fusec.compile(_odd_n_graph(DType.F16), dtype="fp16", arch="sm_90")
    gemm = [L for L in plan.manifest["launches"] if L["type"] == "gemm"]
    assert len(gemm) == 1 and gemm[0]["n"] == 1008 and gemm[0]["ldb"] == 1008
    mem = plan.manifest["memory"]
    assert mem["scratch_bytes"] == 0  # passes/pad_gemm: the padded product is an ordinary value
    assert gemm[0]["c"][0] == "arena" and gemm[0]["c"][1] + 10 * 1008 * 2 <= mem["arena_bytes"]
    assert plan.manifest["launches"][-1]["label"].endswith("slice")


def _attention_graph(dtype: DType):
    """One standalone attention node: GQA, an additive mask with a fully masked query row, and
    torch's nan_to_zero guard."""
    b = GraphBuilder("attn")
    q = b.input("q", (2, 4, 8, 32), dtype)
    k = b.input("k", (2, 2, 8, 32), dtype)
    v = b.input("v", (2, 2, 8, 32), dtype)
    mask = np.zeros((2, 1, 8, 8), np.float32)
    mask[1, 0, 3, :] = -np.inf  # query row 3 of batch 1 sees no key
    m = b.const(mask, name="mask", dtype=dtype)
    b.output(b.emit(Op.ATTENTION, q, k, v, m, scale=32 ** -0.5, causal=False, nan_to_zero=True), "o")
    return b.build()


def test_standalone_attention_lowers_to_the_kernel_and_the_nan_guard() -> None:
    plan = fusec.compile(_attention_graph(DType.F16), dtype="fp16", arch="sm_90")
    entries = [plan.manifest["kernels"][L["kernel"]]["entry"] for L in plan.manifest["launches"]]
    assert len(entries) == 2 and entries[0].startswith("fc_attn_") and entries[1].startswith("fc_ew_")
    out = plan.manifest["outputs"][0]["offset"]
    assert plan.manifest["launches"][0]["args"][-1] == ["ptr", "arena", out]


def test_add_norm_whose_sum_nobody_reads_is_one_row_kernel_writing_the_sum_to_scratch() -> None:
    b = GraphBuilder("addnorm")
    x = b.input("x", (4, 32), DType.F32)
    y = b.input("y", (4, 32), DType.F32)
    w = b.const(np.ones(32, np.float32), name="w")
    b.output(b.emit(Op.LAYERNORM, b.emit(Op.ADD, x, y), w, axis=1, eps=1e-5), "n")
    g, _ = optimize(b.build())
    (node,) = [n for n in g.nodes if n.op == Op.FUSED]
    assert [m.op for m in node.attrs.body.nodes] == [Op.ADD, Op.LAYERNORM] and len(node.outputs) == 1
    mplan = plan_memory(g)
    low = lower(g, mplan.offsets, "sm_90", arena_base=mplan.arena_bytes)
    assert len(low.launches) == 1 and low.report["by_template"]["fused_add_norm"] == 1
    assert low.scratch_bytes >= 4 * 32 * 4
    sum_arg = low.launches[0]["args"][-2]  # x, res, w, sum, out
    assert sum_arg[:2] == ["ptr", "arena"] and sum_arg[2] >= mplan.arena_bytes  # the scratch tail of the arena


def test_an_indexed_chain_moves_whole_aligned_vectors_or_halves_down() -> None:
    """``lower.fused._indexed_vec``: 16 bytes of the widest type a thread where every operand along the last dim is
    stride 1 at an aligned address and offset with rows a whole number of vectors apart (or stride 0), halved
    until it is; 1 where nothing lines up."""
    from types import SimpleNamespace

    from fusec.codegen import specs as S
    from fusec.lower.fused import _indexed_vec

    BF, F32_ = DType.BF16, DType.F32
    addrs = {"y": 0, "out": 0, "odd": 2, "s": 4, "f": 0}
    ctx = SimpleNamespace(aligned=lambda *vals, to=16: all(addrs[v.name] % to == 0 for v in vals))
    y, out, odd, s = (SimpleNamespace(name=n, dtype=BF) for n in ("y", "out", "odd", "s"))
    halves = (S.Operand(BF, (6144, 1)), S.Operand(BF, (6144, 1)))
    assert _indexed_vec(ctx, (2048, 3072), halves, [y, y], [0, 3072], [out]) == 8  # a gated unit's halves
    assert _indexed_vec(ctx, (2048, 3072), halves, [y, y], [0, 3070], [out]) == 2  # the second half 4 bytes in
    assert _indexed_vec(ctx, (2048, 3071), halves, [y, y], [0, 3071], [out]) == 1  # rows of an odd length
    assert _indexed_vec(ctx, (64, 64), halves[:1], [odd], [0], [out]) == 1  # a 2-byte aligned base
    col = S.Operand(F32_, (1, 0))  # one value a row (stride 0 along it) at any address; fp32: 4 a vector
    assert _indexed_vec(ctx, (64, 64), (halves[0], col), [y, SimpleNamespace(name="s", dtype=F32_)], [0, 1], [out]) == 4
    assert _indexed_vec(ctx, (64, 64), (S.Operand(BF, (65, 1)),), [y], [0], [out]) == 1  # rows 65 elements apart
    # a multi-output kernel: every output's address and type count (an fp32 output: 4 a vector; a 2-byte aligned one)
    assert _indexed_vec(ctx, (64, 64), halves[:1], [y], [0], [out, SimpleNamespace(name="f", dtype=F32_)]) == 4
    assert _indexed_vec(ctx, (64, 64), halves[:1], [y], [0], [out, odd]) == 1


def test_a_long_prefills_swiglu_over_the_products_halves_moves_16_bytes_a_thread() -> None:
    """Past 128 rows a prefill's gate/up product is cuBLAS's and its SwiGLU an indexed chain over the two halves of
    the product's output: the kernel reads them 8 bf16 a thread (it read one)."""
    import dataclasses

    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    cfg = dataclasses.replace(get_config("llama-tiny"), max_positions=256)
    gm = GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)
    plan = compile_generation(gm, batch=2, max_seq_len=200, prefill_len=160, dtype="bf16", eos_ids=[], arch="sm_90")
    bodies = [b for k, v in plan.blobs().items() if k.startswith("source/")
              for b in bytes(v).decode().split('extern "C" __global__')[1:]]
    swiglu = [s for s in bodies if " fc_ew_" in s and "fc_sigmoid(x0)" in s]  # silu(gate) * up
    assert swiglu and all("const fc_vec<fc_bf16, 8> v0" in s and "const fc_vec<fc_bf16, 8> v1" in s for s in swiglu)


def test_a_row_broadcast_operand_does_not_stop_the_vectors() -> None:
    """``specs.vector_width``, the one rule of both elementwise paths: an operand with one value a row (stride 0
    along the last dim) is one load a group wherever its rows sit, so x[M, N] * s[M, 1] moves 16 bytes a thread
    (it took one element: s's rows, 1 apart, were not whole vectors)."""
    from fusec.codegen import specs as S
    from fusec.codegen.elementwise import Apply, In
    from fusec.ops import Op as O

    spec = S.elementwise_spec(Apply(O.MUL, (In(0), In(1))), [(6, 40), (6, 1)], [DType.BF16] * 2, (6, 40))
    assert spec.inputs[1].strides == (1, 0) and spec.vec == 8
    odd = S.elementwise_spec(Apply(O.MUL, (In(0), In(1))), [(6, 36), (6, 1)], [DType.BF16] * 2, (6, 36))
    assert odd.vec == 4  # 36 a row: whole vectors of 4
