"""Every Llama-style decoder family, from a Hugging Face directory and from a GGUF file, against
transformers (tests/decoder_families.py makes the tiny random checkpoints and writes their GGUF
files as llama.cpp's converter does).

- greedy generation on the reference backend (passes applied, as ``fusec generate`` runs it) for a
  batch of three prompts of different lengths, right-padded in one batch, equals transformers'
  greedy ``generate`` of each prompt alone; the longest prompt and the generated text outgrow each
  windowed family's sliding window;
- the logits graph (models/llama.py, what ``fusec compile``/``run`` build) equals the torch
  forward, which is where Gemma 2's final soft-cap shows (greedy tokens cannot see it);
- the window of KV_ATTENTION against loops, and its kernel compiled by NVRTC (no GPU needed).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

import decoder_families as DF  # noqa: E402

from fusec import reference  # noqa: E402
from fusec.generation import ReferenceEngine, generate  # noqa: E402
from fusec.genmodel import build_graphs, load_generation_model  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
NEW = 10


@functools.lru_cache(maxsize=None)
def _case(name: str, root: str) -> tuple[Path, Path, Any, list[list[int]]]:
    """(HF directory, GGUF file, torch model, transformers' greedy tokens) of case ``name``."""
    d, model = DF.checkpoint(name, Path(root))
    want = []
    for p in PROMPTS:  # one at a time: no padding convention to match
        out = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        want.append(out[0, len(p):].tolist())
    return d, DF.write_gguf(name, model, Path(root) / f"{name}.gguf"), model, want


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.fspath(tmp_path_factory.mktemp("families"))


def _greedy(source: Path) -> tuple[list[list[int]], Any]:
    gm = load_generation_model(source)
    longest = max(map(len, PROMPTS))
    engine = ReferenceEngine(build_graphs(gm, len(PROMPTS), longest + NEW, longest, eos_ids=[]),
                             optimize=True)
    return generate(engine, PROMPTS, NEW, gm.config.vocab_size).new_ids, gm.config


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", list(DF.CASES))
def test_greedy_generation_matches_transformers(root: str, name: str, source: str) -> None:
    d, g, _, want = _case(name, root)
    got, cfg = _greedy(d if source == "hf" else g)
    case = DF.CASES[name]
    assert cfg.family == (case.family if source == "hf" else "llama" if case.gguf_arch == "llama" else case.family)
    window = DF.CASES[name].window
    assert cfg.sliding_window == window and (not window or max(map(len, PROMPTS)) > window)
    assert got == want


@pytest.mark.parametrize("name", list(DF.CASES))
def test_logits_graph_matches_transformers(root: str, name: str) -> None:
    from fusec.models.hf_weights import HFWeights, hf_decoder_config
    from fusec.models.llama import build_llama
    from fusec.models.weights import model_weights

    d, _, model, _ = _case(name, root)
    cfg = hf_decoder_config(d)
    ids = np.array([PROMPTS[0][:12], PROMPTS[2] + [40, 41, 42]], dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    weights = model_weights(cfg, HFWeights(d, cfg))
    graph = build_llama(cfg, *ids.shape, weights)
    weights.finish()
    got = reference.run(graph, {"input_ids": ids, "attention_mask": mask})["logits"]
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    keep = mask.astype(bool)  # padded positions differ by convention
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_transformers_reads_the_test_gguf_files_as_the_hf_directory(root: str, tmp_path: Path) -> None:
    """The GGUF writer of these tests against transformers' own GGUF loader, for an architecture
    and features it reads (qwen2: q/k/v biases; no RoPE scaling, no window)."""
    import transformers as T

    cfg = T.Qwen2Config(**DF._dec())
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    DF.CASES["qwen2-plain"] = dataclasses.replace(DF.CASES["qwen2"], make_config=lambda: cfg)
    try:
        DF.write_gguf("qwen2-plain", model, tmp_path / "q.gguf")
    finally:
        del DF.CASES["qwen2-plain"]
    theirs = T.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        np.testing.assert_allclose(theirs(ids).logits.numpy(), model(ids).logits.numpy(), rtol=1e-5, atol=1e-5)


# ---- the window of KV_ATTENTION -------------------------------------------------------------------

@pytest.mark.parametrize("window", [1, 3, 8])
def test_kv_attention_window_against_loops(window: int) -> None:
    from fusec import ops as O
    from fusec.ops import Op

    rng = np.random.default_rng(window)
    q = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 12, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 12, 8)).astype(np.float32)
    pos = np.array([0, 7])
    got = reference.IMPL[Op.KV_ATTENTION](O.KVAttentionAttrs(0.3, window=window), q, k, v, pos)
    for b in range(2):
        for h in range(4):
            for s in range(2):
                last = int(pos[b]) + s
                keys = range(max(0, last - window + 1), last + 1)  # the window: itself and window - 1 before
                sc = np.array([q[b, h, s] @ k[b, h // 2, j] * 0.3 for j in keys])
                p = np.exp(sc - sc.max())
                want = (p / p.sum()) @ v[b, h // 2, list(keys)]
                np.testing.assert_allclose(got[b, h, s], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="window"):
        O.KVAttentionAttrs(0.3, window=-1)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_windowed_kv_attention_kernels_compile(arch: str) -> None:
    """The window renders into the kernel only when set (window 0: the kernel of old), and the
    windowed kernels compile with NVRTC without spilling (no GPU needed): split and unsplit,
    decode and S > 1, with a soft-cap."""
    from fusec.codegen import kernels as K
    from fusec.codegen.build_decode import kv_attention_spec
    from fusec.dtypes import DType

    plain = kv_attention_spec(1, 8, 2, 1, 4096, 64, DType.BF16, 0.125)
    windowed = dataclasses.replace(plain, window=512)
    assert "window" not in repr(plain) and "window=512" in repr(windowed)
    src_plain, src_win = K.prepare(plain)[1], K.prepare(windowed)[1]
    assert "WINDOW" not in src_plain and "#define WINDOW 512" in src_win
    for spec in (windowed, kv_attention_spec(2, 4, 4, 3, 64, 16, DType.F32, 0.25, window=5),
                 kv_attention_spec(1, 4, 1, 1, 256, 128, DType.F16, 0.1, window=32, softcap=30.0)):
        assert spec.splits > 1 or spec.S > 1 or spec.window
        ck = K.build(spec, arch)
        assert ck.cubin[:4] == b"\x7fELF" and ck.binary.spill_bytes <= (8 if spec.softcap else 0), ck.binary.log


def test_older_config_forms_map_to_the_same_config(root: str, tmp_path: Path) -> None:
    """transformers 4.x wrote RoPE as rope_theta + rope_scaling (Gemma 3: rope_local_base_freq too)
    and Gemma 3's layer pattern as sliding_window_pattern: the same ModelConfig as 5.x's forms."""
    import json

    from fusec.models.hf_weights import hf_decoder_config

    for name in ("gemma3", "llama3", "qwen2"):
        d, _, _, _ = _case(name, root)
        new = hf_decoder_config(d)
        cfg = json.loads((d / "config.json").read_text())
        rp = cfg.pop("rope_parameters")
        if name == "gemma3":
            cfg.pop("layer_types")
            cfg.update(sliding_window_pattern=6, rope_theta=rp["full_attention"]["rope_theta"],
                       rope_local_base_freq=rp["sliding_attention"]["rope_theta"],
                       rope_scaling={k: v for k, v in rp["full_attention"].items() if k != "rope_theta"})
        else:
            cfg.update(rope_theta=rp["rope_theta"], rope_scaling={k: v for k, v in rp.items() if k != "rope_theta"})
        old = tmp_path / name
        old.mkdir()
        for f in d.iterdir():
            (old / f.name).write_bytes(f.read_bytes())
        (old / "config.json").write_text(json.dumps(cfg))
        got = hf_decoder_config(old)
        assert dataclasses.replace(got, name=new.name, description=new.description) == new
        if name == "gemma3":
            assert [new.window(i) for i in range(6)] == [6, 6, 6, 6, 6, 0] and new.rope(0) == (10000.0, None)
