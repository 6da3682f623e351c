"""A dp4a quantized GEMV that shares no bytes with the kernel launched before it waits for that kernel (PDL) at its
end instead of before reading x (``QGemvSpec.defer_wait``, ``Context.may_defer_wait``, FUSEC_PDL_DEFER): in a
Q4_K_M decode step, a layer's v product (Q6_K) beside its q/k product (Q4_K), both reading the normalized x.
CPU: which launches defer, what they share with the launch before (nothing), never two in a row, the attention
after a deferred product loading nothing before its wait that the product before it writes; GPU: the same tokens."""

from __future__ import annotations

import pytest


def _model():  # noqa: ANN202
    from test_quant_gpu import _packed_model

    return _packed_model(3)


def _decode(monkeypatch, defer: bool, arch: str = "sm_90"):  # noqa: ANN001, ANN202
    from fusec.compiler import compile_generation

    monkeypatch.setenv("FUSEC_PDL_DEFER", "1" if defer else "0")
    plan = compile_generation(_model(), batch=1, max_seq_len=64, prefill_len=8, dtype="bf16", eos_ids=[], arch=arch)
    mods = {m["id"]: m for m in plan.manifest["modules"]}
    launches = plan.manifest["entries"]["decode"]["launches"]
    srcs = [plan._blobs[mods[plan.manifest["kernels"][L["kernel"]]["module"]]["source"]].decode()
            if "kernel" in L else "" for L in launches]
    return launches, srcs


def _overlap(a: list, b: list) -> bool:
    return any(x[0] == y[0] and x[1] < y[1] + y[2] and y[1] < x[1] + x[2] for x in a for y in b)


def test_the_v_product_beside_the_qk_product_waits_at_its_end(monkeypatch) -> None:  # noqa: ANN001
    launches, srcs = _decode(monkeypatch, True)
    # what the decision reads: every launch's written bytes (a kernel's output parameter named as written)
    assert all(L["writes"] for L in launches if "kernel" in L), [L["label"] for L in launches if not L["writes"]]
    deferred = [i for i, s in enumerate(srcs) if "at its end instead" in s]
    assert deferred, "no decode launch deferred its wait"
    for i in deferred:
        prev, cur = launches[i - 1], launches[i]
        assert "qgemv" in cur["label"] and "norm_gemm" in cur["label"] and "kernel" in prev
        assert not _overlap(prev["writes"], cur["reads"] + cur["writes"]) and not _overlap(cur["writes"], prev["reads"])
        assert i - 1 not in deferred  # never two in a row: the one before must have waited at its start
    # the second of two adjacent normalized products (a layer's q/k in Q4_K, then its v in Q6_K; a layer whose v is
    # in Q4_K has one merged qkv product, which reads the down product's output), and the LM head after the small
    # add that computes the sampler's counter; nothing else
    normed = [i for i, L in enumerate(launches) if L.get("label", "").endswith("fused[norm_gemm] qgemv")]
    pairs = {i for i in normed if i - 1 in normed}
    assert len(pairs) == 1 and launches[normed[-1] - 1]["label"].endswith(" add")
    assert set(deferred) == pairs | {normed[-1]}


def test_the_context_defers_only_past_independent_kernels_and_counts_both_as_running() -> None:
    """``Context.may_defer_wait``: only past a fusec kernel that shares no written byte with the new one (read after
    write, write after read, write after write each refuse), never past a deferred task or a cuBLAS call, never on
    sm_80; after a deferred task, a kernel's loads before its wait must avoid the writes of both tasks (the one
    before it may still run: ``older_rows_stable``)."""
    from fusec.lower import Context, Raw

    a, b, c, d = (Raw("arena", 64 * i, 64) for i in range(4))
    pos, cache = Raw("state", 0, 8), Raw("state", 64, 4096)
    ctx = Context("sm_90", {}, "f32", None)
    assert not ctx.may_defer_wait([a], [c])  # nothing before it
    ctx.emit({"type": "kernel", "label": "k0"}, [a], [b, pos], pdl=True)
    assert ctx.may_defer_wait([a], [c])
    assert not ctx.may_defer_wait([b], [c]) and not ctx.may_defer_wait([c], [a]) and not ctx.may_defer_wait([c], [b])
    assert not ctx.may_defer_wait([pos], [c])
    assert not ctx.older_rows_stable([cache], pos)  # k0 writes pos
    ctx.emit({"type": "kernel", "label": "k1"}, [a], [c], pdl=True)
    ctx.deferred_wait()
    assert not ctx.may_defer_wait([d], [Raw("arena", 512, 64)])  # past a deferred task: never
    assert not ctx.older_rows_stable([cache], pos)  # k0 may still run when the next kernel starts
    ctx.emit({"type": "kernel", "label": "k2"}, [c], [d], pdl=True)
    assert ctx.older_rows_stable([cache], pos)  # k2 waited at its start: only k2 may still run
    ctx.emit({"type": "gemm", "label": "g"}, [d], [b])
    assert not ctx.may_defer_wait([a], [c])  # a cuBLAS call lets nothing launch early
    ctx80 = Context("sm_80", {}, "f32", None)
    ctx80.emit({"type": "kernel", "label": "k0"}, [a], [b], pdl=True)
    assert not ctx80.may_defer_wait([a], [c])


def test_off_by_default_and_on_sm80_nothing_defers(monkeypatch) -> None:  # noqa: ANN001
    for defer, arch in ((False, "sm_90"), (True, "sm_80")):
        _, srcs = _decode(monkeypatch, defer, arch)
        assert not any("at its end instead" in s for s in srcs), (defer, arch)


@pytest.mark.gpu
def test_deferred_waits_give_the_same_tokens(monkeypatch) -> None:  # noqa: ANN001
    from fusec.compiler import compile_generation
    from fusec.runtime.generation import generate_with_plan

    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19]]
    got = {}
    for defer in (False, True):
        monkeypatch.setenv("FUSEC_PDL_DEFER", "1" if defer else "0")
        plan = compile_generation(_model(), batch=1, max_seq_len=64, prefill_len=12, dtype="bf16", eos_ids=[])
        got[defer] = generate_with_plan(plan, prompts, max_new_tokens=40).new_ids
    assert got[True] == got[False]
