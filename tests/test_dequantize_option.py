"""--dequantize (generate, compile --generate, serve): a GGUF file's quantized weights dequantized
at load instead of kept packed; the reference backend draws the same tokens either way (it
dequantizes packed weights exactly as the format defines), and the option is refused in one line
where it cannot apply."""

from __future__ import annotations

import json
import os

import pytest

gguf = pytest.importorskip("gguf")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec.cli import main  # noqa: E402
from test_gguf import Q, write_gguf  # noqa: E402


def _new_ids(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["new_ids"]


def test_dequantized_weights_draw_the_packed_weights_tokens(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the reference backend, also on a GPU machine
    path = str(write_gguf(tmp_path / "m.gguf", Q.Q4_K, types={"blk.0.attn_v.weight": Q.Q6_K}))
    argv = ["generate", path, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "5", "--json"]
    assert _new_ids(capsys, argv + ["--dequantize"]) == _new_ids(capsys, argv)


def test_dequantized_weights_are_not_packed(tmp_path):
    from fusec.genmodel import load_generation_model

    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K)
    packed, plain = load_generation_model(path), load_generation_model(path, packed=False)
    cfg, name = packed.config, "layers.0.self_attn.q_proj.weight"
    shape = (cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    assert packed.weights.get_packed(name, shape) is not None and plain.weights.get_packed(name, shape) is None


@pytest.mark.parametrize("argv,message", [
    (["generate", "llama-tiny", "--prompt-ids", "1,2", "--dequantize"], "applies to GGUF files"),
    (["compile", "gpt2-tiny", "--dequantize", "--arch", "sm_90"], "--dequantize applies to generation plans"),
    (["serve", "plan.fplan", "--dequantize"], "a plan's weights are compiled in"),
])
def test_dequantize_is_refused_where_it_cannot_apply_in_one_line(capsys, tmp_path, argv, message):
    code = main(argv + (["-o", str(tmp_path / "x.fplan")] if argv[0] == "compile" else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
