"""The L2 prefetch pass (fusec/lower/l2_prefetch.py) on the CPU: which weights a prefetching kernel
streams ahead (contiguous, up to the next prefetching kernel, within the arch's budget), and a
generation plan whose decode attention streams the products after it (its plan file still valid)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fusec.lower import Context
from fusec.lower.l2_prefetch import assign_l2_prefetch, budget, prefetch_range
from fusec.program import Region, Task


def _ctx(reads: list[list[tuple[int, int]]], prefetchers: list[int], arch: str = "sm_90") -> Context:
    ctx = Context(arch, {}, "f32", None)
    for i, rs in enumerate(reads):
        args = [["ptr", "arena", 0], ["ptr", "arena", 0], ["i64", 0]] if i in prefetchers else [["ptr", "arena", 0]]
        ctx.tasks.append(Task({"type": "kernel", "args": args, "label": f"#{i}"},
                              tuple(Region("weights", o, n) for o, n in rs) + (Region("arena", 0, 64),), ()))
    ctx.l2_prefetchers = list(prefetchers)
    return ctx


def test_takes_the_following_contiguous_weights_up_to_the_next_prefetcher() -> None:
    # 0 prefetches; 1, 2 read weights back to back (2 after 256-byte padding); 3 prefetches; 4 reads more
    ctx = _ctx([[], [(0, 1000)], [(1024, 4096)], [], [(5120, 256)]], [0, 3])
    assert prefetch_range(ctx, 0, 1 << 30) == (0, 5120)
    assert prefetch_range(ctx, 3, 1 << 30) == (5120, 5376)
    assign_l2_prefetch(ctx)
    assert ctx.tasks[0].record["args"][-2:] == [["ptr", "weights", 0], ["i64", 5120]]
    assert Region("weights", 0, 5120) in ctx.tasks[0].reads  # the program knows what it reads


def test_stops_at_weights_elsewhere_and_at_the_budget() -> None:
    ctx = _ctx([[], [(0, 512)], [(8192, 512)]], [0])  # task 2's weights are not next in the buffer
    assert prefetch_range(ctx, 0, 1 << 30) == (0, 512)
    ctx = _ctx([[], [(0, 4096)], [(4096, 4096)], [(8192, 4096)]], [0])
    assert prefetch_range(ctx, 0, 6000) == (0, 6144)  # clipped to the budget (whole 256-byte units)
    ctx = _ctx([[], [(4096, 4096)], [(0, 4096)]], [0])  # already-read weights before the range: it ends
    assert prefetch_range(ctx, 0, 1 << 30) == (4096, 8192)


def test_nothing_to_prefetch_leaves_the_range_empty() -> None:
    ctx = _ctx([[(0, 256)], []], [1])  # the last task: nothing after it
    assign_l2_prefetch(ctx)
    assert ctx.tasks[1].record["args"][-1] == ["i64", 0]
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


def test_decode_attention_streams_the_products_after_it(monkeypatch) -> None:  # noqa: ANN001
    plan = _plan(monkeypatch, True)
    launches = plan.manifest["entries"]["decode"]["launches"]
    attn = [i for i, L in enumerate(launches) if "kv_attention" in L["label"]]
    assert len(attn) == 2
    for i in attn:
        (_, space, lo), (_, n) = launches[i]["args"][-2:]
        assert space == "weights" and n > 0
        # the next product's weights are the first bytes it streams, the range covers whole tensors of
        # the products after it and ends before the next attention
        after = [r for L in launches[i + 1:] for r in L["reads"] if r[0] == "weights" and "kv_attention" not in L["label"]]
        assert after[0][1] == lo
        inside = [r for r in after if lo <= r[1] and r[1] + r[2] <= lo + n]
        assert len(inside) >= 3, inside  # o, gate/up, down
    from fusec import __version__
    from fusec.plancheck import validate

    # the loader's strict checks (every pointer inside its space, scalars in range) accept the ranges
    validate(json.loads(json.dumps(plan.manifest)), plan.blobs(), "plan", __version__)
    off = _plan(monkeypatch, False).manifest["entries"]["decode"]["launches"]
    assert all(len(L["args"]) == len(launches[i]["args"]) - 2 for i, L in enumerate(off) if i in attn)
