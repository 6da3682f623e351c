"""benchmarks/l2_bound.py's variant of a decode plan, on the CPU: every launch of a kernel an earlier launch ran
reads that first launch's weights (a layer's products the first layer's), and nothing else changes."""

from __future__ import annotations

import copy
import os
import sys

import pytest


def test_each_layer_reads_the_first_layers_weights_and_nothing_else_moves() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from l2_bound import hot_weights

    from fusec.compiler import compile_generation

    plan = compile_generation("llama-tiny", batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90")
    before = copy.deepcopy(plan.manifest)
    saved = hot_weights(plan.manifest)
    old, new = before["entries"]["decode"]["launches"], plan.manifest["entries"]["decode"]["launches"]
    assert len(old) == len(new) and saved > 0
    first: dict[int, list] = {}
    moved = 0
    for a, b in zip(old, new):
        assert {k: v for k, v in a.items() if k != "args"} == {k: v for k, v in b.items() if k != "args"}
        if a.get("type") != "kernel":
            assert a == b
            continue
        ref = first.setdefault(int(a["kernel"]), b["args"])
        for x, y, r in zip(a["args"], b["args"], ref):
            if x[:2] == ["ptr", "weights"]:
                assert y == r
                moved += x != y
            else:
                assert x == y  # activations, caches, state: where they were
    layers = plan.manifest["generation"]["num_layers"]
    assert layers >= 2 and moved >= layers - 1  # every later layer's products at least
    assert before["entries"]["prefill"] == plan.manifest["entries"]["prefill"]


def test_a_dropped_layer_kernel_leaves_every_layer_and_nothing_else() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from l2_bound import drop_layer_kernels, layer_kernels

    from fusec.compiler import compile_generation

    plan = compile_generation("llama-tiny", batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90")
    before = copy.deepcopy(plan.manifest)
    layer = layer_kernels(plan.manifest)
    layers = plan.manifest["generation"]["num_layers"]
    labels = [label for _, label in layer]
    assert sum("norm_gemm" in x for x in labels) == 2 and sum("attention" in x for x in labels) == 1, labels
    at = [i for i, x in enumerate(labels) if "attention" in x][0]
    gone = drop_layer_kernels(plan.manifest, [at, at + 1])  # the attention and the o product
    old, new = before["entries"]["decode"]["launches"], plan.manifest["entries"]["decode"]["launches"]
    dropped = {layer[at][0], layer[at + 1][0]}
    assert gone == len(old) - len(new) == sum(1 for L in old if L.get("type") == "kernel" and L["kernel"] in dropped)
    assert gone == 2 * layers
    assert [L for L in old if not (L.get("type") == "kernel" and L["kernel"] in dropped)] == new
    assert before["entries"]["prefill"] == plan.manifest["entries"]["prefill"]
    twice = next(i for i, (k, _) in enumerate(layer) if [j for j, _ in layer].count(k) > 1)  # the two cache writes
    with pytest.raises(SystemExit, match="other positions too"):
        drop_layer_kernels(plan.manifest, [twice])
    # every position of it named: all of its launches go
    both = [i for i, (k, _) in enumerate(layer) if k == layer[twice][0]]
    launches = copy.deepcopy(plan.manifest["entries"]["decode"]["launches"])
    assert drop_layer_kernels(plan.manifest, both) == sum(
        1 for L in launches if L.get("type") == "kernel" and L["kernel"] == layer[twice][0]) == len(both) * layers
