"""The command line on bad input: exit 1 with exactly one line ``fusec: error: ...`` on stderr
(no traceback) for a FusecError, exit 2 for argparse usage errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from test_cli import tiny_onnx

from fusec import device
from fusec.cli import main


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_available", lambda: False)


def fails(capsys, argv: list[str]) -> str:
    """Run ``fusec argv``; assert exit 1, nothing on stdout, one error line on stderr; return it."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 1, (code, out, err)
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("fusec: error: ")
    assert "Traceback" not in err
    return err[len("fusec: error: "):-1]


@pytest.fixture
def tiny_path(tmp_path):
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(), path)
    return path


SHAPES = "input_ids:2x3,attention_mask:2x3"

# ---------------------------------------------------------------------------------------------
# model files and names


@pytest.mark.parametrize("command", ["inspect", "run"])
def test_truncated_onnx_file(capsys, tmp_path, tiny_path, command) -> None:
    data = tiny_path.read_bytes()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    msg = fails(capsys, [command, str(bad), "--shapes", SHAPES])
    assert "truncated.onnx" in msg


@pytest.mark.parametrize("content", [b"this is not a model\n", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, b""])
def test_non_onnx_file(capsys, tmp_path, content) -> None:
    bad = tmp_path / "notes.onnx"
    bad.write_bytes(content)
    msg = fails(capsys, ["inspect", str(bad)])
    assert "notes.onnx" in msg


def test_nonexistent_path(capsys, tmp_path) -> None:
    msg = fails(capsys, ["inspect", str(tmp_path / "missing.onnx")])
    assert msg == f"no such file: {str(tmp_path / 'missing.onnx')!r}"


def test_directory_as_model(capsys, tmp_path) -> None:
    assert "is a directory" in fails(capsys, ["run", str(tmp_path)])


def test_unknown_model_name(capsys) -> None:
    msg = fails(capsys, ["run", "gpt5-huge"])
    assert msg.startswith("no such file or built-in model 'gpt5-huge' (built-in: gpt2-tiny,")


def test_unknown_model_name_with_newline_stays_one_line(capsys) -> None:
    msg = fails(capsys, ["inspect", "evil\nname\r"])
    assert "evil\\nname\\r" in msg


def test_export_model_unknown_name(capsys, tmp_path) -> None:
    fails(capsys, ["export-model", "nope", "-o", str(tmp_path / "x.onnx")])
    assert not (tmp_path / "x.onnx").exists()


# ---------------------------------------------------------------------------------------------
# --shapes


@pytest.mark.parametrize("shapes, fragment", [
    ("input_ids=1x8", "missing ':'"),
    ("input_ids:1x8,", "empty entry"),
    ("input_ids:1xeight,attention_mask:1x8", "'eight' is not an integer"),
    ("input_ids:0x8,attention_mask:0x8", "dim 0 is not positive"),
    ("input_ids:1x-8,attention_mask:1x-8", "dim -8 is not positive"),
    ("input_ids:1x8,input_ids:1x8", "given twice"),
])
def test_malformed_shapes(capsys, shapes, fragment) -> None:
    assert fragment in fails(capsys, ["run", "gpt2-tiny", "--shapes", shapes])


@pytest.mark.parametrize("shapes, fragment", [
    ("input_ids:1x8", "attention_mask"),  # missing input
    ("input_ids:8,attention_mask:8", "rank"),  # wrong rank
    ("input_ids:1x8,attention_mask:1x8,token_type_ids:1x8", "token_type_ids"),  # unknown input
])
def test_shapes_that_do_not_fit_a_builtin_model(capsys, shapes, fragment) -> None:
    assert fragment in fails(capsys, ["inspect", "gpt2-tiny", "--shapes", shapes])


@pytest.mark.parametrize("shapes, fragment", [
    ("input_ids:2x3", "attention_mask"),  # missing: the model's dims are dynamic
    ("input_ids:2x3x1,attention_mask:2x3x1", "input_ids"),  # wrong rank
    ("input_ids:2x3,attention_mask:2x3,nope:1", "nope"),  # unknown input
])
def test_shapes_that_do_not_fit_an_onnx_model(capsys, tiny_path, shapes, fragment) -> None:
    assert fragment in fails(capsys, ["inspect", str(tiny_path), "--shapes", shapes])


def test_dynamic_onnx_model_without_shapes(capsys, tiny_path) -> None:
    assert "input_ids" in fails(capsys, ["run", str(tiny_path)])


# ---------------------------------------------------------------------------------------------
# --inputs


def _good_inputs() -> dict[str, np.ndarray]:
    return {"input_ids": np.array([[1, 2, 3], [4, 5, 6]], np.int64), "attention_mask": np.ones((2, 3), np.int64)}


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.pop("attention_mask"), "missing input(s): 'attention_mask'"),
    (lambda d: d.update(token_type_ids=np.zeros((2, 3), np.int64)), "unexpected input(s): 'token_type_ids'"),
    (lambda d: d.update(input_ids=d["input_ids"].astype(np.float32)), "input 'input_ids': expected dtype i64"),
    (lambda d: d.update(attention_mask=np.ones((2, 4), np.int64)), "input 'attention_mask': expected shape [2, 3]"),
])
def test_bad_npz_inputs(capsys, tmp_path, tiny_path, edit, fragment) -> None:
    arrays = _good_inputs()
    edit(arrays)
    np.savez(tmp_path / "in.npz", **arrays)
    msg = fails(capsys, ["run", str(tiny_path), "--shapes", SHAPES, "--inputs", str(tmp_path / "in.npz")])
    assert fragment in msg and "in.npz" in msg


def test_bad_npz_inputs_for_builtin_model(capsys, tmp_path) -> None:
    np.savez(tmp_path / "in.npz", input_ids=np.zeros((1, 16), np.int64))
    assert "missing input(s): 'attention_mask'" in fails(capsys, ["run", "gpt2-tiny", "--inputs", str(tmp_path / "in.npz")])


def test_token_ids_out_of_range(capsys, tmp_path) -> None:
    np.savez(tmp_path / "in.npz", input_ids=np.full((1, 16), 10**6, np.int64), attention_mask=np.ones((1, 16), np.int64))
    # --backend reference: no "no GPU found" note before the error, which only the run can find
    msg = fails(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--inputs", str(tmp_path / "in.npz")])
    assert "out of range" in msg


def test_pickled_object_array_npz(capsys, tmp_path) -> None:
    np.savez(tmp_path / "evil.npz", input_ids=np.array([{"x": 1}], dtype=object))
    msg = fails(capsys, ["run", "gpt2-tiny", "--inputs", str(tmp_path / "evil.npz")])
    assert "pickled objects" in msg and "evil.npz" in msg


@pytest.mark.parametrize("content", [b"", b"not an archive", b"PK\x03\x04broken"])
def test_unreadable_npz(capsys, tmp_path, content) -> None:
    (tmp_path / "in.npz").write_bytes(content)
    assert "in.npz" in fails(capsys, ["run", "gpt2-tiny", "--inputs", str(tmp_path / "in.npz")])


def test_missing_npz(capsys, tmp_path) -> None:
    assert "does not exist" in fails(capsys, ["run", "gpt2-tiny", "--inputs", str(tmp_path / "nope.npz")])


def test_unwritable_outputs_path_fails_before_running(capsys, tmp_path) -> None:
    msg = fails(capsys, ["run", "gpt2-tiny", "--save-outputs", str(tmp_path / "no_dir" / "out.npz")])
    assert msg.startswith("cannot write outputs file") and "does not exist" in msg
    assert "is a directory" in fails(capsys, ["run", "gpt2-tiny", "--save-outputs", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# usage errors: argparse, exit 2


@pytest.mark.parametrize("argv", [
    [],
    ["frobnicate"],
    ["run"],
    ["inspect"],
    ["run", "gpt2-tiny", "--backend", "tpu"],
    ["run", "gpt2-tiny", "--seed", "abc"],
    ["run", "gpt2-tiny", "--no-such-flag"],
    ["export-model", "gpt2-tiny"],  # -o is required
])
def test_usage_errors_exit_2(capsys, argv) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: fusec")


def _npz_member_bytes(path, name: str, ids: np.ndarray, version: int = 1) -> None:  # noqa: ANN001
    import io
    import zipfile

    buf = io.BytesIO()
    np.lib.format.write_array(buf, ids)
    raw = bytearray(buf.getvalue())
    raw[6] = version  # the format's major version byte, after the magic
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(name + ".npy", bytes(raw))


@pytest.mark.parametrize("damage, needle", [
    ("encrypted", "cannot be read"),  # the zip's encryption flag set on the member
    ("npy_v3", "version 3.0 (fusec reads 1.0 and 2.0)"),
])
@pytest.mark.parametrize("flag", ["--inputs", "--compare"])
def test_npz_files_numpy_or_zipfile_cannot_read_are_one_line(capsys, tmp_path, damage, needle, flag) -> None:
    """These ended in exit 70 (RuntimeError from zipfile, a tokenizer error from numpy's header parser)."""
    path = tmp_path / "bad.npz"
    # format version 3.0 (a utf-8 header): numpy's 1.0/2.0 header readers cannot parse it
    _npz_member_bytes(path, "input_ids", np.zeros((1, 16), np.int64), version=3 if damage == "npy_v3" else 1)
    data = bytearray(path.read_bytes())
    if damage == "encrypted":  # general-purpose flag bit 0, in the local and the central header
        for sig in (b"PK\x03\x04", b"PK\x01\x02"):
            at = data.find(sig)
            off = at + (6 if sig == b"PK\x03\x04" else 8)
            data[off] |= 1
    path.write_bytes(bytes(data))
    err = fails(capsys, ["run", "gpt2-tiny", "--backend", "reference", flag, str(path)])
    assert needle in err and "input_ids" in err
