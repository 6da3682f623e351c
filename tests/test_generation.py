"""Generation on the CPU: state in the IR, the generation ops, sampling, the reference loop against
transformers, generation plans compiled without a GPU, the CLI, and bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec import reference  # noqa: E402
from fusec.builder import GraphBuilder  # noqa: E402
from fusec.cli import main  # noqa: E402
from fusec.dtypes import DType  # noqa: E402
from fusec.errors import FusecError, InputError, ModelError  # noqa: E402
from fusec.generation import ReferenceEngine, generate  # noqa: E402
from fusec.compiler import compile_generation  # noqa: E402
from fusec.genmodel import build_graphs, load_generation_model  # noqa: E402
from fusec.ir import IRError, verify  # noqa: E402
from fusec.ops import Op  # noqa: E402
from fusec.sampling import (  # noqa: E402
    keep_mask,
    sample,
)

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23], [31, 32, 33, 34, 35, 36]]


# ---- ops and state ----------------------------------------------------------------------------

def test_cache_write_and_kv_attention_against_loops():
    rng = np.random.default_rng(0)
    b = GraphBuilder("kv")
    cache = b.state("cache", (2, 2, 7, 4), DType.F32)
    pos = b.state("pos", (2,), DType.I64)
    new = b.input("new", (2, 2, 2, 4), DType.F32)
    q = b.input("q", (2, 4, 2, 4), DType.F32)
    c2 = b.emit(Op.CACHE_WRITE, cache, new, pos, axis=2)
    out = b.emit(Op.KV_ATTENTION, q, c2, c2, pos, scale=0.5)
    b.output(out, "out")
    b.update(cache, c2)
    b.update(pos, pos)
    g = b.build()
    feeds = {"cache": rng.standard_normal((2, 2, 7, 4)).astype(np.float32), "pos": np.array([0, 5]),
             "new": rng.standard_normal((2, 2, 2, 4)).astype(np.float32),
             "q": rng.standard_normal((2, 4, 2, 4)).astype(np.float32)}
    res = reference.run(g, feeds)
    want = feeds["cache"].copy()
    for row, p in enumerate(feeds["pos"]):
        want[row, :, p:p + 2] = feeds["new"][row, :, :2]
    np.testing.assert_array_equal(res[c2.name], want)
    for row, p in enumerate(feeds["pos"]):
        for h in range(4):
            for s in range(2):
                k = want[row, h // 2, : p + s + 1]
                w = np.exp((k @ feeds["q"][row, h, s]) * 0.5 - ((k @ feeds["q"][row, h, s]) * 0.5).max())
                ref = (w / w.sum()) @ k
                np.testing.assert_allclose(res["out"][row, h, s], ref, rtol=1e-5, atol=1e-6)


def test_verify_rejects_stale_reads_and_writes_into_non_state():
    b = GraphBuilder("bad")
    cache = b.state("cache", (1, 4), DType.F32)
    pos = b.input("pos", (1,), DType.I64)
    x = b.input("x", (1, 1), DType.F32)
    c2 = b.emit(Op.CACHE_WRITE, cache, x, pos, axis=1)
    stale = b.emit(Op.ADD, cache, cache)  # reads the cache after it was overwritten in place
    b.output(stale, "y")
    b.update(cache, c2)
    with pytest.raises(IRError, match="overwrote it in place"):
        b.build()
    b = GraphBuilder("bad2")
    cache = b.state("cache", (1, 4), DType.F32)
    x = b.input("x", (1, 4), DType.F32)
    pos = b.input("pos", (1,), DType.I64)
    y = b.emit(Op.CACHE_WRITE, x, b.input("n", (1, 1), DType.F32), pos, axis=1)
    b.output(y, "y")
    b.update(cache, cache)
    with pytest.raises(IRError, match="needs a state"):
        b.build()


def test_keep_mask_matches_a_sort_based_definition():
    rng = np.random.default_rng(1)
    for _ in range(50):
        z = rng.standard_normal(300).astype(np.float32)
        z[rng.integers(0, 300, 20)] = z[0]  # ties
        k, p = int(rng.integers(0, 40)), float(rng.uniform(0.05, 1.0))
        got = keep_mask(z, k, p)
        order = np.argsort(-z, kind="stable")
        keep = np.zeros(300, bool)
        if 0 < k < 300:
            keep[z >= z[order[k - 1]]] = True
        else:
            keep[:] = True
        e = np.where(keep, np.exp(z - z.max()), 0)
        total = e.sum()
        want = keep & np.array([e[z > zv].sum() < p * total for zv in z])
        assert (got == want).all() or p == 1.0 and (got == keep).all()


def test_sampling_is_reproducible_and_greedy_limits():
    logits = np.random.default_rng(2).standard_normal((3, 500)).astype(np.float32)
    a = sample(logits, np.array([9]), np.array([4, 5, 6]), 0.8, 50, 0.9)
    assert (a == sample(logits, np.array([9]), np.array([4, 5, 6]), 0.8, 50, 0.9)).all()
    assert (a != sample(logits, np.array([10]), np.array([4, 5, 6]), 0.8, 50, 0.9)).any()
    assert (sample(logits, np.array([9]), np.array([4, 5, 6]), 0.8, 1, 1.0) == logits.argmax(1)).all()
    draws = [int(sample(logits[:1], np.array([s]), np.array([0]), 1.0, 0, 1.0)[0]) for s in range(4000)]
    # Gumbel-max draws follow softmax(logits): compare the most likely token's frequency
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    top = int(p.argmax())
    assert abs(draws.count(top) / 4000 - p[top]) < 4 * np.sqrt(p[top] * (1 - p[top]) / 4000) + 1e-3


# ---- the reference loop against transformers ----------------------------------------------------

@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny"])
def test_greedy_generation_matches_transformers(name, tmp_path):
    torch = pytest.importorskip("torch")
    from test_models_hf import hf_model

    from fusec.models import get_config

    model = hf_model(get_config(name))
    model.save_pretrained(tmp_path)
    gm = load_generation_model(name, weights_dir=tmp_path)
    engine = ReferenceEngine(build_graphs(gm, 3, 40, 12, eos_ids=[5]))
    res = generate(engine, PROMPTS, 20, gm.config.vocab_size)
    for p, new in zip(PROMPTS, res.new_ids):
        out = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=5, pad_token_id=0)
        assert out[0, len(p):].tolist() == new


def test_streamed_chunks_add_up_to_the_result():
    from fusec.generation import iter_generate

    gm = load_generation_model("llama-tiny")
    engine = ReferenceEngine(build_graphs(gm, 2, 32, 8, eos_ids=[]))
    it = iter_generate(engine, [[1, 2, 3], [4]], 11, gm.config.vocab_size, stream_every=4)
    chunks = []
    while True:
        try:
            chunks.append(next(it))
        except StopIteration as stop:
            res = stop.value
            break
    assert [len(c[0]) for c in chunks] == [1, 4, 4, 2]  # the first token right after the prefill
    assert [sum((c[b] for c in chunks), []) for b in range(2)] == res.new_ids
    assert [len(n) for n in res.new_ids] == [11, 11]


# ---- plans without a GPU -------------------------------------------------------------------------

def test_generation_plan_compiles_and_round_trips(tmp_path):
    import fusec

    plan = compile_generation("qwen3-tiny", batch=2, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90", eos_ids=[3])
    assert set(plan.entries) == {"prefill", "decode"}
    m = plan.manifest
    names = [r["name"] for r in m["state"]]
    assert {"pos", "cur", "done", "tokens", "seed", "k.0", "v.1"} <= set(names)
    assert next(r for r in m["state"] if r["name"] == "k.0")["dtype"] == "bf16"
    assert m["entries"]["decode"]["inputs"] == [] and m["entries"]["prefill"]["inputs"][0]["name"] == "input_ids"
    # the decode step writes the caches in place: no launch copies a whole cache back
    cache_bytes = next(r for r in m["state"] if r["name"] == "k.0")
    assert not any("k.0" in L.get("label", "") for L in m["entries"]["decode"]["launches"]), cache_bytes
    plan.save(tmp_path / "g.fplan")
    again = fusec.load(tmp_path / "g.fplan")
    assert again.manifest["entries"].keys() == m["entries"].keys()
    assert again.manifest["memory"]["weights_bytes"] == m["memory"]["weights_bytes"]


def test_entries_share_one_copy_of_the_weights():
    from fusec.compiler import compile_entries

    gm = load_generation_model("llama-tiny")
    graphs = build_graphs(gm, 1, 16, 4, eos_ids=[])
    # weights_nk: how compile_generation compiles (cuBLAS in the prefill reads the decode GEMV's layout)
    both = compile_entries(graphs, dtype="fp32", arch="sm_90", weights_nk=True)
    one = compile_entries({"main": graphs["decode"]}, dtype="fp32", arch="sm_90", weights_nk=True)
    params = gm.config.vocab_size * gm.config.hidden_size * 4
    # the two entries together store about what one does (not twice): shared by content
    assert both.manifest["memory"]["weights_bytes"] < one.manifest["memory"]["weights_bytes"] + params


# ---- CLI and bad input ---------------------------------------------------------------------------

def test_cli_generate_json_on_the_reference_backend(capsys, monkeypatch):
    import json

    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    code = main(["generate", "qwen3-tiny", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "6",
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "reference backend" in err
    res = json.loads(out)
    assert res["prompt_ids"] == [[1, 2, 3], [4, 5]] and [len(n) for n in res["new_ids"]] == [6, 6]
    gm = load_generation_model("qwen3-tiny")
    want = generate(ReferenceEngine(build_graphs(gm, 2, 9, 9, eos_ids=[])),
                    [[1, 2, 3], [4, 5]], 6, gm.config.vocab_size).new_ids
    assert res["new_ids"] == want


@pytest.mark.parametrize("argv, message", [
    (["generate", "bert-tiny", "--prompt-ids", "1,2"], "cannot generate"),
    (["generate", "nope", "--prompt-ids", "1,2"], "unknown built-in model"),
    (["generate", "llama-tiny"], "at least one"),
    (["generate", "llama-tiny", "--prompt-ids", "1,x"], "comma-separated"),
    (["generate", "llama-tiny", "--prompt", "hello"], "no tokenizer"),
    (["generate", "llama-tiny", "--prompt-ids", "1,2", "--prompt-ids", "3", "--batch", "1"], "more than --batch 1"),
    (["generate", "llama-tiny", "--prompt-ids", "1,2,3,4,5", "--max-prompt-len", "4"], "longer than"),
    (["generate", "llama-tiny", "--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["generate", "llama-tiny", "--prompt-ids", "1,2", "--max-seq-len", "4", "--max-new-tokens", "8"], "exceed"),
    (["generate", "llama-tiny", "--prompt-ids", "1", "--temperature", "-1"], "temperature"),
    (["generate", "missing.onnx", "--prompt-ids", "1"], "not found"),
])
def test_cli_generate_bad_input_is_one_line(capsys, monkeypatch, argv, message):
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 + ("reference backend" in err[0]), err
    assert err[-1].startswith("fusec: error:") and message in err[-1]


def test_generate_api_errors_name_the_problem():
    gm = load_generation_model("llama-tiny")
    engine = ReferenceEngine(build_graphs(gm, 1, 16, 4, eos_ids=[]))
    with pytest.raises(InputError, match="empty"):
        generate(engine, [[]], 2, gm.config.vocab_size)
    with pytest.raises(InputError, match="max_new_tokens"):
        generate(engine, [[1]], 0, gm.config.vocab_size)
    with pytest.raises(ModelError):
        load_generation_model("gpt2-tiny")
    with pytest.raises(FusecError):
        compile_generation("llama-tiny", batch=1, max_seq_len=1000, prefill_len=8, arch="sm_90")  # > positions
    verify(build_graphs(gm, 1, 16, 4, eos_ids=[1, 2])["decode"])


def test_head_rope_group_is_one_kernel_and_keeps_the_numbers():
    """Qwen3 with head_dim 64: each layer's q norm + RoPE, k norm + RoPE + cache write and V's cache
    write are fused into one launch (rope_siblings: one kernel over the q, k and v heads), which in decode is the
    attention's prologue (rope_attention: one launch for the heads and the attention); the fused graphs generate
    exactly what the unfused ones do."""
    import dataclasses

    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights
    from fusec.passes.fusion import records

    cfg = dataclasses.replace(get_config("qwen3-tiny"), head_dim=64, name="qwen3-d64")

    def model():
        return GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)

    plan = compile_generation(model(), batch=2, max_seq_len=32, prefill_len=8, dtype="fp32", arch="sm_90", eos_ids=[])
    labels = [L["label"] for L in plan.manifest["entries"]["decode"]["launches"]]
    assert sum("fused[rope_siblings+rope_attention]" in x for x in labels) == cfg.num_layers
    assert not any("rope" in x and "rope_siblings+rope_attention" not in x for x in labels)
    assert not any("kv_attention" in x for x in labels)  # no attention launch of its own
    # V's cache write joins the rope_siblings launch: the one cache_write left records the tokens
    assert sum(x.endswith("cache_write") for x in labels) == 1
    raw = ReferenceEngine(build_graphs(model(), 2, 32, 12, []))
    fused = ReferenceEngine(build_graphs(model(), 2, 32, 12, []), optimize=True)
    applied = [r for r in records(fused.graphs["decode"]) if r.rule == "rope_siblings" and r.applied]
    assert len(applied) == cfg.num_layers
    a = generate(raw, PROMPTS[:2], 8, cfg.vocab_size).new_ids
    assert a == generate(fused, PROMPTS[:2], 8, cfg.vocab_size).new_ids


@pytest.mark.parametrize("batch", [1, 4])
def test_a_decode_step_gathers_cos_and_sin_in_one_launch(batch):
    """The decode step reads each sequence's cos and sin rows with one gather from the two tables stacked [2, T, D]:
    with the token's embedding row, two gather launches (three before); the halves are views (no copy launch more
    than the step's own slices)."""
    plan = compile_generation("qwen3-tiny", batch=batch, max_seq_len=48, prefill_len=8, dtype="bf16", eos_ids=[],
                              arch="sm_90")
    launches = plan.manifest["entries"]["decode"]["launches"]
    labels = [L["label"] for L in launches]
    assert sum(lab.endswith(" gather") for lab in labels) == 2, labels  # the token's embedding row, cos and sin
    written = [tuple(w) for L in launches if L["label"].endswith(" gather") for w in L["writes"]]
    copies = [L for L in launches if L["label"].endswith((" slice", " reshape"))]
    overlap = lambda r, w: r[0] == w[0] and r[1] < w[1] + w[2] and w[1] < r[1] + r[2]  # noqa: E731
    assert not [L["label"] for L in copies if any(overlap(r, w) for r in L["reads"] for w in written)]  # views
    graph = build_graphs(load_generation_model("qwen3-tiny"), batch, 48, 8, [])["decode"]
    tables = [n for n in graph.nodes if n.op == Op.GATHER and n.inputs[0].data is not None
              and n.inputs[0].name.startswith("rope_cos_sin_table")]
    assert len(tables) == 1 and tables[0].inputs[0].shape[0] == 2 and tables[0].attrs.axis == 1


def test_a_prefill_attends_causally_without_a_mask_and_generates_as_with_the_padding_mask():
    """Right-padded prompts: a causal layer's prefill attention is the kernel's causal form over q/k/v alone (no
    [N,1,S,S] mask read a score at a time; the blocks skip keys past their rows), a windowed layer keeps the window
    combined with the padding mask; and the tokens equal those of the graph that masks the padding too
    (models.generate.prompt_masks)."""
    import dataclasses
    from unittest import mock

    from fusec.genmodel import GenModel
    from fusec.models import generate as G
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.llama import window_masks
    from fusec.models.weights import RandomWeights

    def attention_nodes(g) -> list:  # noqa: ANN001
        out = []
        for n in g.nodes:
            out += [n] if n.op == Op.ATTENTION else attention_nodes(n.attrs.body) if n.op == Op.FUSED else []
        return out

    base = get_config("llama-tiny")
    for cfg, windowed in ((base, 0), (dataclasses.replace(base, sliding_window=5, sliding_layers=(True, False),
                                                          name="llama-tiny-window"), 1)):
        def model(cfg=cfg):  # noqa: ANN202
            return GenModel(cfg, SharedWeights(RandomWeights(2)), None, (), cfg.name)

        fused = ReferenceEngine(build_graphs(model(), 3, 32, 12, []), optimize=True)
        atts = attention_nodes(fused.graphs["prefill"])
        assert len(atts) == cfg.num_layers
        assert sum(a.attrs.causal and len(a.inputs) == 3 for a in atts) == cfg.num_layers - windowed
        assert sum(len(a.inputs) == 4 for a in atts) == windowed  # the window's mask, with the padding
        padded = mock.patch.object(G, "window_masks", lambda m, cfg, mask_in, causal_alone=False:
                                   window_masks(m, cfg, mask_in))
        with padded:
            masked = ReferenceEngine(build_graphs(model(), 3, 32, 12, []), optimize=True)
            assert not any(a.attrs.causal and len(a.inputs) == 3 for a in attention_nodes(masked.graphs["prefill"]))
        prompts = [p[: 3 + 4 * i] for i, p in enumerate(PROMPTS[:3])]  # three lengths: padding rows in the batch
        assert generate(fused, prompts, 6, cfg.vocab_size).new_ids == generate(masked, prompts, 6,
                                                                                 cfg.vocab_size).new_ids
