"""fusec.generate and `fusec generate` on a GPU: the compiled plan draws the reference backend's
tokens, streams the same pieces, and -v shows the compile's steps under "prepare"."""

from __future__ import annotations

import json
import re

import pytest

import fusec
from fusec.cli import main

pytestmark = pytest.mark.gpu


def test_fusec_generate_compiles_on_a_gpu_and_matches_the_reference_backend():
    prompts = [[11, 12, 13, 14], [21, 22]]
    chunks: list[list[list[int]]] = []
    gpu = fusec.generate("qwen3-tiny", prompts, max_new_tokens=12, dtype="fp32", on_tokens=chunks.append)
    ref = fusec.generate("qwen3-tiny", prompts, max_new_tokens=12, backend="reference")
    assert gpu.backend == "cuda" and ref.backend == "reference"
    assert gpu.new_ids == ref.new_ids and gpu.finish_reason == ref.finish_reason
    assert [sum((c[b] for c in chunks), []) for b in (0, 1)] == gpu.new_ids
    assert gpu.prefill_tok_s > 0 and gpu.stats["decode"]["cuda_graph"]


def test_verbose_generate_on_a_gpu_shows_the_compile_under_prepare(capsys):
    assert main(["-v", "generate", "llama-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["backend"] == "cuda"
    assert re.search(r"prepare: compile a generation plan", err) and re.search(r"\] kernel: ", err), err
    assert re.search(r"prepare: done in \d+\.\d\ds", err) and re.search(r"first token: after \d+ ms", err), err
