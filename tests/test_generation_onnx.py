"""Generation from ONNX decoders exported with a KV cache (fusec/frontend/kv_cache.py): tiny HF
Llama/Qwen3 models exported by the legacy and dynamo exporters (tests/hf_kv_export.py), rewritten
into fusec's prefill/decode graphs, run by the reference backend against transformers' greedy
``generate``; the state contract of models/generate.py; plans compiled without a GPU; bad files."""

from __future__ import annotations

import json
import os

import hf_kv_export
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec.cli import main  # noqa: E402
from fusec.dtypes import DType  # noqa: E402
from fusec.errors import ModelError  # noqa: E402
from fusec.generation import ReferenceEngine, generate  # noqa: E402
from fusec.compiler import compile_generation  # noqa: E402
from fusec.genmodel import build_graphs, load_generation_model  # noqa: E402
from fusec.ir import verify  # noqa: E402
from fusec.ops import Op  # noqa: E402
from fusec.sampling import Sampling  # noqa: E402

PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [21, 22, 23], [31, 32, 33, 34, 35, 36]]
NEW = 16
CASES = [("llama", "legacy"), ("qwen3", "legacy"),
         pytest.param("llama", "dynamo", marks=pytest.mark.slow),
         pytest.param("qwen3", "dynamo", marks=pytest.mark.slow)]


def _hf_greedy(model, prompt, eos):
    import torch

    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                         eos_token_id=eos if eos is not None else None)
    return out[0, len(prompt):].tolist()


def _pick_eos(rows):
    """A token that first shows up a few steps into some row: it ends that row early."""
    for row in rows:
        for i, tok in enumerate(row):
            if i >= 3 and tok not in row[:i]:
                return tok
    return None


@pytest.mark.parametrize("family, exporter", CASES)
def test_export_then_greedy_generation_matches_transformers(family, exporter):
    path, model = hf_kv_export.export_kv(family, exporter)
    # the export itself: a padded prompt, then a step on the returned cache, onnxruntime vs torch
    assert hf_kv_export.check_export(path, model) < 1e-4
    gm = load_generation_model(path)
    assert gm.eos_ids == (hf_kv_export.EOS,) and gm.tokenizer is None
    assert (gm.config.vocab_size, gm.config.num_layers) == (model.config.vocab_size, model.config.num_hidden_layers)
    graphs = build_graphs(gm, 3, 40, 12, eos_ids=[])
    for g in graphs.values():
        verify(g)
    free = generate(ReferenceEngine(graphs, optimize=True), PROMPTS, NEW, gm.config.vocab_size).new_ids
    eos = _pick_eos(free)
    res = generate(ReferenceEngine(build_graphs(gm, 3, 40, 12, eos_ids=[] if eos is None else [eos]),
                                   optimize=True), PROMPTS, NEW, gm.config.vocab_size)
    ctx = f"{family}/{exporter} eos={eos}"
    for p, a, b in zip(PROMPTS, free, res.new_ids):
        assert a == _hf_greedy(model, p, None), ctx
        assert b == _hf_greedy(model, p, eos), ctx
    if eos is not None:
        assert any(len(b) < NEW and b[-1] == eos for b in res.new_ids), ctx


def test_graphs_keep_the_state_contract_of_the_builtin_decoders():
    """Same states (names, order, dtypes, shapes), user inputs/outputs and meta as models/generate.py."""
    path, model = hf_kv_export.export_kv("llama", "legacy")
    ours = build_graphs(load_generation_model(path), 2, 24, 8, eos_ids=[3, 4])
    builtin = build_graphs(load_generation_model("llama-tiny"), 2, 24, 8, eos_ids=[3, 4])
    cfg = model.config
    cache = (2, cfg.num_key_value_heads, 24, cfg.hidden_size // cfg.num_attention_heads)
    for entry in ("prefill", "decode"):
        g, want = ours[entry], builtin[entry]
        assert g.meta["generation"] == want.meta["generation"]
        ours_states = {s.name: (s.shape, s.dtype, d is s) for s, d in g.state_pairs()}
        want_states = {s.name: (s.shape, s.dtype, d is s) for s, d in want.state_pairs()}
        assert list(ours_states) == list(want_states)
        for name, (shape, dt, read_only) in ours_states.items():
            if name[:2] in ("k.", "v."):
                assert (shape, dt, read_only) == (cache, DType.F32, False), name
            else:
                assert (shape, dt, read_only) == want_states[name], name
        assert [(v.name, v.shape, v.dtype) for v in g.user_inputs()] == \
            [(v.name, v.shape, v.dtype) for v in want.user_inputs()]
        assert g.user_outputs() == [] == want.user_outputs()
        ops = [n.op for n in g.nodes]
        assert ops.count(Op.CACHE_WRITE) == 2 * cfg.num_hidden_layers + 1 and ops.count(Op.SAMPLE) == 1
        assert Op.CONCAT not in {n.op for n in g.nodes if any(i.shape == cache for i in n.inputs)}
    # decode attends keys 0..pos through kv_attention, as the built-in decoders do
    assert [n.op for n in ours["decode"].nodes].count(Op.KV_ATTENTION) == cfg.num_hidden_layers
    assert Op.ATTENTION not in {n.op for n in ours["decode"].nodes}


@pytest.mark.parametrize("compare, swapped", [(Op.LESS_EQUAL, True), (Op.LESS, False)])
def test_kv_attention_replaces_only_a_mask_proven_to_be_keys_up_to_pos(compare, swapped):
    from fusec import reference
    from fusec.builder import GraphBuilder
    from fusec.frontend.kv_attention import use_kv_attention

    # head_dim 8: an attention the kernels cannot take (head_dim 4) is unfused again by recognition
    b = GraphBuilder("attn")
    k, v = (b.state(n, (2, 1, 6, 8), DType.F32) for n in ("k.0", "v.0"))
    pos = b.state("pos", (2,), DType.I64)
    q, new = b.input("q", (2, 2, 1, 8), DType.F32), b.input("new", (2, 1, 1, 8), DType.F32)
    kc, vc = (b.emit(Op.CACHE_WRITE, c, new, pos, axis=2) for c in (k, v))
    allowed = b.emit(compare, b.const(np.arange(6)[None, :]), b.emit(Op.RESHAPE, pos, shape=(2, 1)))
    mask = b.emit(Op.RESHAPE, allowed, shape=(2, 1, 1, 6))
    b.output(b.emit(Op.ATTENTION, q, kc, vc, mask, scale=0.5), "out")
    for s, u in ((k, kc), (v, vc), (pos, pos)):
        b.update(s, u)
    g = b.build()
    got = use_kv_attention(g)
    assert (Op.KV_ATTENTION in {n.op for n in got.nodes}) == swapped
    rng = np.random.default_rng(0)
    feeds = {"k.0": rng.standard_normal((2, 1, 6, 8), np.float32), "v.0": rng.standard_normal((2, 1, 6, 8), np.float32),
             "pos": np.array([2, 5]), "q": rng.standard_normal((2, 2, 1, 8), np.float32),
             "new": rng.standard_normal((2, 1, 1, 8), np.float32)}
    np.testing.assert_allclose(reference.run(got, feeds)["out"], reference.run(g, feeds)["out"], rtol=1e-6)


def test_sampled_generation_is_reproducible():
    path, _ = hf_kv_export.export_kv("qwen3", "legacy")
    gm = load_generation_model(path)
    runs = [generate(ReferenceEngine(build_graphs(gm, 2, 20, 6, eos_ids=[])), PROMPTS[1:], 8, gm.config.vocab_size,
                     seed=s, sampling=Sampling(0.9, 20, 0.9)).new_ids for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]
    assert all(len(r) == 8 for r in runs[0])


def test_generation_plan_compiles_without_a_gpu(tmp_path):
    import fusec

    path, _ = hf_kv_export.export_kv("llama", "legacy")
    plan = compile_generation(path, batch=2, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90")
    m = plan.manifest
    assert set(plan.entries) == {"prefill", "decode"}
    assert [r["name"] for r in m["state"]] == ["k.0", "v.0", "k.1", "v.1", "pos", "cur", "done", "tokens",
                                                "temperature", "top_k", "top_p", "seed"]
    assert m["entries"]["decode"]["inputs"] == []
    assert [i["name"] for i in m["entries"]["prefill"]["inputs"]] == ["input_ids", "lengths"]
    assert m["generation"]["vocab_size"] == 256 and m["generation"]["source"] == "model.onnx"
    assert m["generation"]["eos_ids"] == [hf_kv_export.EOS] and m["generation"]["num_layers"] == 2
    # the decode step writes the caches in place: no launch copies a whole cache back
    assert not any("k.0" in L.get("label", "") for L in m["entries"]["decode"]["launches"])
    plan.save(tmp_path / "g.fplan")
    assert fusec.load(tmp_path / "g.fplan").manifest["entries"].keys() == m["entries"].keys()


def test_cli_generates_from_the_onnx_file(capsys, monkeypatch):
    from fusec import device

    path, _ = hf_kv_export.export_kv("qwen3", "legacy")
    monkeypatch.setattr(device, "gpu_available", lambda: False)
    code = main(["generate", path, "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "5", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and "reference backend" in err
    res = json.loads(out)
    gm = load_generation_model(path)
    want = generate(ReferenceEngine(build_graphs(gm, 2, 8, 8)), [[1, 2, 3], [4, 5]], 5,
                    gm.config.vocab_size).new_ids
    assert res["new_ids"] == want


# ---- bad files ------------------------------------------------------------------------------------

def _toy(tmp_path, *, past=True, layout="bhsd", present_value=True, concat=True, extra_input=False):
    """A hand-made one-layer 'decoder' (embedding -> heads; logits from the embedding)."""
    v, d, h, hd = 32, 8, 2, 4
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((v, d)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((d, v)).astype(np.float32), "head"),
             numpy_helper.from_array(np.array([0, 0, h, hd], np.int64), "heads_shape")]
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"]),
           helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["b", "s"])]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", v])]
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["x"]),
             helper.make_node("MatMul", ["x", "head"], ["logits"]),
             helper.make_node("Reshape", ["x", "heads_shape"], ["x4"]),
             helper.make_node("Transpose", ["x4"], ["new"], perm=[0, 2, 1, 3])]
    if extra_input:
        ins.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["b", "s"]))
    if past:
        dims = ["b", h, "p", hd] if layout == "bhsd" else ["b", "p", h, hd]
        for kv in ("key", "value") if present_value else ("key",):
            ins.append(helper.make_tensor_value_info(f"past_key_values.0.{kv}", TensorProto.FLOAT, dims))
            outs.append(helper.make_tensor_value_info(f"present.0.{kv}", TensorProto.FLOAT,
                                                      ["b", h, "pt", hd] if layout == "bhsd" else ["b", "pt", h, hd]))
            if concat:
                nodes.append(helper.make_node("Concat", [f"past_key_values.0.{kv}", "new"], [f"present.0.{kv}"],
                                              axis=2 if layout == "bhsd" else 1))
            else:
                nodes.append(helper.make_node("Mul", [f"past_key_values.0.{kv}", f"past_key_values.0.{kv}"],
                                              [f"present.0.{kv}"]))
    graph = helper.make_graph(nodes, "toy", ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    path = tmp_path / "toy.onnx"
    onnx.save(model, path)
    return str(path)


def test_a_well_formed_toy_decoder_generates(tmp_path):
    gm = load_generation_model(_toy(tmp_path))
    assert gm.eos_ids == () and (gm.config.vocab_size, gm.config.num_layers) == (32, 1)
    res = generate(ReferenceEngine(build_graphs(gm, 2, 10, 4)), [[1, 2, 3], [4]], 5, 32)
    assert [len(r) for r in res.new_ids] == [5, 5]


@pytest.mark.parametrize("kwargs, message", [
    (dict(past=False), "no past_key_values.* inputs"),
    (dict(layout="bshd"), "[batch, kv_heads, past, head_dim]"),
    (dict(present_value=False), "'past_key_values.0.value' is missing"),
    (dict(concat=False), "not Concat('past_key_values.0.key', new, axis=2)"),
    (dict(extra_input=True), "'token_type_ids'"),
])
def test_bad_decoders_are_one_line_model_errors(tmp_path, kwargs, message):
    with pytest.raises(ModelError) as e:
        gm = load_generation_model(_toy(tmp_path, **kwargs))
        build_graphs(gm, 2, 10, 4)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_exported_cache_in_the_wrong_layout_is_refused():
    path, _ = hf_kv_export.export_kv("llama", "legacy", layout="bshd")
    with pytest.raises(ModelError, match=r"'past_key_values\.0\.key' has shape \[batch, past, 2, 16\]") as e:
        load_generation_model(path)
    assert "\n" not in str(e.value)


def test_an_export_without_a_cache_is_refused():
    import hf_models

    path, _, _ = hf_models.export_hf("llama", "legacy")
    with pytest.raises(ModelError, match="no past_key_values") as e:
        load_generation_model(path)
    assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="not found"):
        load_generation_model("no-such-model.onnx")


@pytest.mark.parametrize("attn, dtype", [("sdpa", "fp32"), ("eager", "fp16")])
def test_sdpa_and_fp16_exports_generate_as_transformers(attn, dtype):
    path, model = hf_kv_export.export_kv("llama", "legacy", attn=attn, dtype=dtype)
    assert hf_kv_export.check_export(path, model) < (1e-4 if dtype == "fp32" else 2e-2)
    gm = load_generation_model(path)
    graphs = build_graphs(gm, 3, 40, 12, eos_ids=[])
    assert [n.op for n in graphs["decode"].nodes].count(Op.KV_ATTENTION) == gm.config.num_layers
    assert all(s.dtype == DType.F32 for s, _ in graphs["decode"].state_pairs() if s.name[:2] in ("k.", "v."))
    res = generate(ReferenceEngine(graphs, optimize=True), PROMPTS, NEW, gm.config.vocab_size)
    for p, new in zip(PROMPTS, res.new_ids):
        assert new == _hf_greedy(model, p, None), f"{attn}/{dtype}"
