"""The L2 prefetch pass (fusec/lower/l2_prefetch.py) on the CPU: which weights a prefetching kernel
streams ahead (only after a task that streams no weights; the next task's, contiguous, within the
arch's budget), and a generation plan whose product after the decode attention streams the next
product's weights (its plan file still valid)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fusec.lower import Context
from fusec.lower.l2_prefetch import IDLE_BYTES, assign_l2_prefetch, budget, prefetch_range
from fusec.program import Region, Task


def _ctx(reads: list[list[tuple[int, int]]], prefetchers: list[int], arch: str = "sm_90") -> Context:
    ctx = Context(arch, {}, "f32", None)
    for i, rs in enumerate(reads):
        args = [["ptr", "arena", 0], ["ptr", "arena", 0], ["i64", 0]] if i in prefetchers else [["ptr", "arena", 0]]
        ctx.tasks.append(Task({"type": "kernel", "args": args, "label": f"#{i}"},
                              tuple(Region("weights", o, n) for o, n in rs) + (Region("arena", 0, 64),), ()))
    ctx.l2_prefetchers = list(prefetchers)
    return ctx


def test_after_an_idle_task_takes_the_next_tasks_contiguous_weights() -> None:
    # 0: the attention (no weights); 1 prefetches, streaming a product's weights; 2 reads two tensors back to
    # back (after 256-byte padding) and one elsewhere; 3 reads more (not taken: only the next task's)
    ctx = _ctx([[], [(1 << 26, IDLE_BYTES)], [(8192, 1000), (9216, 4096), (1 << 20, 256)], [(13312, 256)]], [1, 2])
    assert prefetch_range(ctx, 1, 1 << 30) == (8192, 13312)
    assert prefetch_range(ctx, 2, 1 << 30) == (0, 0)  # its previous task streams weights: DRAM is busy
    assign_l2_prefetch(ctx)
    assert ctx.tasks[1].record["args"][-2:] == [["ptr", "weights", 8192], ["i64", 5120]]
    assert Region("weights", 8192, 5120) in ctx.tasks[1].reads  # the program knows what it reads
    assert ctx.tasks[2].record["args"][-1] == ["i64", 0]


def test_the_budget_and_the_idle_threshold() -> None:
    ctx = _ctx([[], [(0, 256)], [(4096, 8192)]], [1])
    assert prefetch_range(ctx, 1, 6000) == (4096, 4096 + 6144)  # clipped to the budget (whole 256-byte units)
    big = 64 * IDLE_BYTES
    ctx = _ctx([[(0, IDLE_BYTES - 256)], [(1 << 24, 256)], [(1 << 30, big)]], [1])
    assert prefetch_range(ctx, 1, 1 << 40) == (1 << 30, (1 << 30) + big)  # a few weights: still idle
    ctx = _ctx([[(0, IDLE_BYTES)], [(1 << 24, 256)], [(1 << 30, big)]], [1])
    assert prefetch_range(ctx, 1, 1 << 40) == (0, 0)
    ctx = _ctx([[(0, 1024)], [(1 << 24, 256)], [(1 << 30, 4096)]], [1])  # small: against an eighth of the next
    assert prefetch_range(ctx, 1, 1 << 40) == (0, 0)
    ctx = _ctx([[(0, 256)], [(1 << 24, 256)], [(1 << 30, 4096)]], [1])
    assert prefetch_range(ctx, 1, 1 << 40) == (1 << 30, (1 << 30) + 4096)


def test_nothing_to_prefetch_leaves_the_range_empty() -> None:
    ctx = _ctx([[], [(0, 256)]], [1])  # the last task: nothing after it
    assign_l2_prefetch(ctx)
    assert ctx.tasks[1].record["args"][-1] == ["i64", 0]
    ctx = _ctx([[], [(0, 256)], []], [1])  # the next task reads no weights
    assert prefetch_range(ctx, 1, 1 << 30) == (0, 0)
    assert budget("sm_80") > 0 and budget("sm_90") >= budget("sm_80") and budget("sm_100") > 0


def _plan(monkeypatch: pytest.MonkeyPatch, on: bool):  # noqa: ANN202
    from fusec.compiler import compile_generation
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    monkeypatch.setenv("FUSEC_L2_PREFETCH", "1" if on else "0")
    cfg = dataclasses.replace(get_config("qwen3-tiny"), name="qwen3-l2", hidden_size=128, num_heads=4, num_kv_heads=2,
                              head_dim=64, intermediate_size=256, num_layers=2)
    gm = GenModel(cfg, SharedWeights(RandomWeights(7)), None, (), cfg.name)
    return compile_generation(gm, batch=2, max_seq_len=48, prefill_len=8, dtype="bf16", eos_ids=[], arch="sm_90")


def test_the_product_after_the_attention_streams_the_next_products_weights(monkeypatch) -> None:  # noqa: ANN001
    plan = _plan(monkeypatch, True)
    launches = plan.manifest["entries"]["decode"]["launches"]
    attn = [i for i, L in enumerate(launches) if "rope_attention" in L["label"]]
    assert len(attn) == 2
    ranged = []
    for i, L in enumerate(launches):
        if "gemv" not in L["label"] or L.get("type") != "kernel":
            continue
        (_, space, lo), (kind, n) = L["args"][-2:]
        assert kind == "i64"
        if n:
            ranged.append(i)
            nxt = [r for r in launches[i + 1]["reads"] if r[0] == "weights"]
            big = max(nxt, key=lambda r: r[2])  # the next product's weight matrix
            assert space == "weights" and lo <= big[1] and big[1] + big[2] <= lo + n
    assert ranged == [i + 1 for i in attn]  # exactly the products right after an attention (o)
    from fusec import __version__
    from fusec.plancheck import validate

    # the loader's strict checks (every pointer inside its space, scalars in range) accept the ranges
    validate(json.loads(json.dumps(plan.manifest)), plan.blobs(), "plan", __version__)
    off = _plan(monkeypatch, False).manifest["entries"]["decode"]["launches"]
    assert len(off) == len(launches)
    assert all(len(a["args"]) == len(b["args"]) - 2 for a, b in zip(off, launches) if "gemv" in b["label"])
