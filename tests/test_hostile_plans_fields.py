"""Hostile plan files, the fields later code reads (after tests/test_hostile_plans.py): a tampered
and re-hashed plan is refused at load with one PlanFileError naming the field, never a crash in
the command that reads it (exit 70: a TypeError, KeyError or ValueError in fusec): dtypes that are
lists or objects, a generation plan without its entry points or with a malformed ``generation``
record, a report of the wrong shape; ``fusec inspect`` prints a report's strings escaped; kernel
sources that reach a file through a directive written another way (a comment, a continuation,
a digraph, ...) or without one; a source model recorded as a path."""

from __future__ import annotations

from pathlib import Path

import pytest
from hostile_helpers import fails, relu_model, save
from test_hostile_plans import _refused, _tampered

import fusec
from fusec.planfile import read_plan


def _read(path: Path) -> tuple[dict, dict]:
    pf = read_plan(path)
    return pf.manifest, {n: bytes(pf.blob(n)) for n in pf.names()}


# 2 x 32 tokens: products of M = 64 rows, cuBLAS launches with FUSEC_GEMM_STREAM=0 (M <= 16 would be GEMVs)
SHAPES = {"input_ids": (2, 32), "attention_mask": (2, 32)}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[dict, dict]:
    """(manifest, blobs) of a compiled gpt2-tiny plan (sm_90, no GPU needed), its products on cuBLAS (the gemm records
    these tests tamper with; by default sm_90 runs products of at most 128 rows on fusec's GEMM)."""
    d = tmp_path_factory.mktemp("plans")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEC_GEMM_STREAM", "0")
        fusec.compile("gpt2-tiny", shapes=SHAPES).save(d / "g.fplan")
    return _read(d / "g.fplan")


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> tuple[dict, dict]:
    """(manifest, blobs) of a llama-tiny generation plan (entries prefill and decode)."""
    from fusec.compiler import compile_generation

    d = tmp_path_factory.mktemp("plans")
    compile_generation("llama-tiny", batch=1, max_seq_len=16, dtype="fp16", arch="sm_90").save(d / "gen.fplan")
    return _read(d / "gen.fplan")


def _first(m: dict, kind: str) -> dict:
    return next(L for L in m["launches"] if L["type"] == kind)


def _state(m: dict, name: str) -> dict:
    return next(r for r in m["state"] if r["name"] == name)


# ---- 1. types checked before they are used as keys ------------------------------------------------

DTYPE_CASES = {
    "input dtype a list": (lambda m, b: m["inputs"][0].__setitem__("dtype", ["f32"]), "inputs[0].dtype"),
    "input dtype an object": (lambda m, b: m["inputs"][0].__setitem__("dtype", {}), "inputs[0].dtype"),
    "output dtype a list": (lambda m, b: m["outputs"][0].__setitem__("dtype", ["f32"]), "outputs[0].dtype"),
    "gemm dtype a list": (lambda m, b: _first(m, "gemm").__setitem__("dtype", ["f16"]), ".dtype"),
    "kernel module a list": (lambda m, b: m["kernels"][0].__setitem__("module", ["m0"]), "kernels[0].module"),
}


@pytest.mark.parametrize("case", list(DTYPE_CASES))
def test_a_list_or_an_object_where_a_name_belongs_is_refused(tmp_path, base, case) -> None:
    edit, field = DTYPE_CASES[case]
    _refused(_tampered(tmp_path, base, edit), field)


@pytest.mark.parametrize("cmd", [["inspect"], ["run"], ["compile", "--arch", "sm_80", "-o", "{out}/x.fplan"],
                                 ["export-graph", "-o", "{out}/x.onnx"], ["memory", "-o", "{out}/m.html"]])
def test_every_command_refuses_a_list_dtype_in_one_line(capsys, tmp_path, base, cmd) -> None:
    path = _tampered(tmp_path, base, DTYPE_CASES["input dtype a list"][0])
    argv = [cmd[0], str(path)] + [a.format(out=tmp_path) for a in cmd[1:]]
    fails(capsys, argv, needles=["t.fplan", "inputs[0].dtype"])


def test_a_generation_state_dtype_a_list_is_refused(tmp_path, gen) -> None:
    _refused(_tampered(tmp_path, gen, lambda m, b: _state(m, "pos").__setitem__("dtype", ["i64"])), "dtype")


# ---- 2. entry points ------------------------------------------------------------------------------

def test_a_generation_plan_without_its_decode_entry_is_refused(capsys, tmp_path, gen) -> None:
    path = _tampered(tmp_path, gen, lambda m, b: m["entries"].pop("decode"))
    _refused(path, "'entries'", "prefill and decode")
    fails(capsys, ["inspect", str(path)], needles=["'entries'"])
    fails(capsys, ["generate", str(path), "--prompt-ids", "1,2"], needles=["'entries'"])


def test_a_generation_plan_with_a_renamed_entry_is_refused(tmp_path, gen) -> None:
    _refused(_tampered(tmp_path, gen, lambda m, b: m["entries"].__setitem__("x", m["entries"].pop("decode"))),
             "'entries'", "'x'")


def test_a_plan_with_one_named_entry_is_inspected(capsys, tmp_path, gen) -> None:
    """A plan with one entry point not named "main" (compile_entries({"decode": graph}) writes one)."""
    def one(m, b):
        del m["entries"]["decode"], m["generation"]

    path = _tampered(tmp_path, gen, one)
    info = fusec.load(path).info()
    assert list(info["entries"]) == ["prefill"]
    from fusec.cli import main

    assert main(["inspect", str(path)]) == 0
    assert "entry prefill:" in capsys.readouterr().out
    assert main(["inspect", str(path), "--json"]) == 0


# ---- 3. the generation record ---------------------------------------------------------------------

def _gen(key, value):
    return lambda m, b: m["generation"].__setitem__(key, value)


GEN_CASES = {
    "no record": (lambda m, b: m.__setitem__("generation", {}), "'generation'"),
    # an older plan compiled its sampling settings in; they are per-row state now
    "sampling compiled in": (_gen("sampling", {"temperature": 0.0, "top_k": 0, "top_p": 1.0}), "generation.sampling"),
    "sampling a string": (_gen("sampling", "x"), "generation.sampling"),
    "batch a string": (_gen("batch", "1"), "generation.batch"),
    "batch zero": (_gen("batch", 0), "generation.batch"),
    "vocab a list": (_gen("vocab_size", [1000]), "generation.vocab_size"),
    "prefill longer than the cache": (_gen("prefill_len", 17), "generation.prefill_len"),
    "eos ids a string": (_gen("eos_ids", "2"), "generation.eos_ids"),
    "eos id negative": (_gen("eos_ids", [-1]), "generation.eos_ids[0]"),
    "entry unknown": (_gen("entry", "main"), "generation.entry"),
    "source a path": (_gen("source", "/etc/passwd"), "generation.source"),
    "unknown key": (_gen("run_this", 1), "generation"),
    "tokenizer without its part": (_gen("tokenizer", {"bos_id": 1}), "generation.tokenizer"),
    "tokenizer add_bos a string": (lambda m, b: (m["generation"].__setitem__("tokenizer", {"add_bos": "yes"}),
                                                 b.__setitem__("tokenizer", b"{}")), "generation.tokenizer.add_bos"),
    "state pos for another batch": (lambda m, b: _state(m, "pos").__setitem__("shape", [2]), "'pos'"),
    "state tokens missing": (lambda m, b: m.__setitem__("state", [r for r in m["state"] if r["name"] != "tokens"]),
                             "'tokens'"),
    "state seed of two rows": (lambda m, b: _state(m, "seed").__setitem__("shape", [2]), "'seed'"),
    "state temperature in bf16": (lambda m, b: _state(m, "temperature").__setitem__("dtype", "bf16"), "'temperature'"),
    "state top_p missing": (lambda m, b: m.__setitem__("state", [r for r in m["state"] if r["name"] != "top_p"]),
                            "'top_p'"),
}


@pytest.mark.parametrize("case", list(GEN_CASES))
def test_a_malformed_generation_record_is_refused(tmp_path, gen, case) -> None:
    edit, field = GEN_CASES[case]
    _refused(_tampered(tmp_path, gen, edit), field)


@pytest.mark.parametrize("case", ["no record", "sampling compiled in", "sampling a string", "state seed of two rows"])
def test_generate_refuses_a_malformed_generation_record_in_one_line(capsys, tmp_path, gen, case) -> None:
    edit, field = GEN_CASES[case]
    fails(capsys, ["generate", str(_tampered(tmp_path, gen, edit)), "--prompt-ids", "1,2"], needles=[field])


# ---- 4. the report that inspect prints --------------------------------------------------------------

def _report(key, value):
    return lambda m, b: m["report"].__setitem__(key, value)


REPORT_CASES = {
    "patterns a list": (_report("patterns", []), "report.patterns"),
    "pattern count a string": (lambda m, b: m["report"]["patterns"].__setitem__("attention", "\x1b[31mRED"),
                               "report.patterns.attention"),
    "fusions a string": (_report("fusions", "x"), "report.fusions"),
    "fusion a number": (_report("fusions", [1]), "report.fusions[0]"),
    "fusion reason a number": (lambda m, b: m["report"]["fusions"][0].__setitem__("reason", 5),
                               "report.fusions[0].reason"),
    "ops a list": (_report("ops", [1]), "report.ops"),
    "op count a float": (lambda m, b: m["report"]["ops"].__setitem__("fused", 1.5), "report.ops.fused"),
    "nodes a string": (_report("nodes", "\x1b[2J"), "report.nodes"),
    "lowering a number": (_report("lowering", 1.5), "report.lowering"),
    "kernels compiled a string": (lambda m, b: m["report"]["lowering"].__setitem__("kernels_compiled", "5"),
                                  "report.lowering.kernels_compiled"),
    "by template a list": (lambda m, b: m["report"]["lowering"].__setitem__("by_template", [1]),
                           "report.lowering.by_template"),
    "launch bytes strings": (lambda m, b: m["report"]["lowering"].__setitem__("launch_bytes", ["x"]),
                             "report.lowering.launch_bytes[0]"),
}


@pytest.mark.parametrize("case", list(REPORT_CASES))
def test_a_malformed_report_is_refused(capsys, tmp_path, base, case) -> None:
    edit, field = REPORT_CASES[case]
    path = _tampered(tmp_path, base, edit)
    _refused(path, field)
    fails(capsys, ["inspect", str(path)], needles=[field])


def test_a_malformed_entry_report_is_refused(tmp_path, gen) -> None:
    _refused(_tampered(tmp_path, gen, lambda m, b: m["reports"].__setitem__("decode", "x")), "reports.decode")
    _refused(_tampered(tmp_path, gen, lambda m, b: m["reports"]["decode"].__setitem__("lowering", 1.5)),
             "reports.decode.lowering")


def test_inspect_prints_the_report_strings_escaped(capsys, tmp_path, base) -> None:
    def escapes(m, b):
        m["report"]["fusions"][0].update(reason="\x1b[2J cleared", rule="\x1b]0;title\x07")
        m["report"]["fusions"][1]["decision"] = "\x9b31mred"
        m["report"]["fusions"][2]["layer"] = "\x1b[1mbold"

    from fusec.cli import main

    path = _tampered(tmp_path, base, escapes)
    for argv in (["inspect", str(path)], ["inspect", str(path), "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert not any(ch in out for ch in "\x1b\x07\x9b"), out
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\\x1b[2J cleared" in out and "\\x9b31mred" in out, out


# ---- 5. kernel sources: directives however written ---------------------------------------------------

SOURCE_CASES = {
    "a comment in the directive": ('#/**/include "/etc/hostname"\n', "includes a file"),
    "a continuation in the directive": ('#\\\ninclude "/etc/hostname"\n', "includes a file"),
    "the digraph %:": ('%:include "/etc/hostname"\n', "includes a file"),
    "a digraph and a comment": ('%:  /**/ include "/etc/hostname"\n', "includes a file"),
    "a comment across lines in the directive": ('# /*\n*/ include "/etc/hostname"\n', "includes a file"),
    "a comment across lines before it": ('/*\n*/ # include "/etc/hostname"\n', "includes a file"),
    # a check that took the "/*" for a comment would not see the directive
    "a comment opened inside a string": ('const char* s = "/*";\n#/**/include "/etc/hostname"\n// */\n',
                                         "includes a file"),
    "a comment opened after a digit separator": ("int a = 1'0'/*';\n#/**/include \"/etc/hostname\"\n// */\n",
                                                 "includes a file"),
    "include_next": ('#include_next "/etc/hostname"\n', "includes a file"),
    "import": ('#import "/etc/hostname"\n', "directive"),
    "embed": ('#embed "/etc/hostname"\n', "directive"),
    "a line marker": ('# 1 "/etc/hostname"\n', "directive"),
    "a foreign pragma": ('#pragma GCC dependency "/etc/hostname"\n', "directive"),
    "__has_include across a continuation": ('#if __has_\\\ninclude("/etc/hostname")\n#endif\n', "__has_include"),
    "_Pragma": ('_Pragma("GCC dependency \\"/etc/hostname\\"")\n', "_Pragma"),
    "token pasting": ("#define P(a, b) a##b\n", "##"),
    "a trigraph": ('??=include "/etc/hostname"\n', "trigraph"),
    "a raw string": ('const char* s = R"(/*)";\n', "raw string"),
    "a backslash before spaces": ('#\\  \ninclude "/etc/hostname"\n', "backslash"),  # a continuation to gcc
    "a carriage return": ('int x;\r#include "/etc/hostname"\n', "control"),
    "a byte order mark": ('\ufeff#include "/etc/hostname"\n', "format"),
}


def _prepend(text: str):
    def edit(m, b):
        name = m["modules"][0]["source"]
        b[name] = text.encode("utf-8") + b[name]
    return edit


@pytest.mark.parametrize("case", list(SOURCE_CASES))
def test_a_kernel_source_reaching_a_file_is_refused(tmp_path, base, case) -> None:
    text, needle = SOURCE_CASES[case]
    _refused(_tampered(tmp_path, base, _prepend(text)), "module 'm0'", needle)


@pytest.mark.parametrize("case", ["a comment in the directive", "a continuation in the directive", "the digraph %:"])
def test_retargeting_refuses_the_source_before_nvrtc_reads_a_file(capsys, tmp_path, base, case) -> None:
    path = _tampered(tmp_path, base, _prepend(SOURCE_CASES[case][0]))
    msg = fails(capsys, ["compile", str(path), "--arch", "sm_80", "-o", str(tmp_path / "x.fplan")],
                needles=["module 'm0'", "includes a file"])
    assert "NVRTC" not in msg
    assert not (tmp_path / "x.fplan").exists()


def test_only_the_directives_fusec_writes_pass(tmp_path, base) -> None:
    """What fusec's templates hold, and code that only looks like a directive, still loads; the
    same with any other pragma or directive is refused."""
    text = ("#define X 1\n#undef X\n#pragma unroll\n#pragma unroll 4\n#pragma once\n#if 0\n#endif\n#\n"
            "int sep = 1'000'000;\nconst char* s = \"#include\";\n// #include \"x\"\n/* #include \"x\" */\n")
    assert fusec.load(_tampered(tmp_path, base, _prepend(text))).arch == "sm_90"
    for other in ("#pragma unroll \"x\"\n", "#pragma once more\n", "#pragma nv_diag_suppress 177\n", "#error x\n",
                  "#line 7\n", "#ident \"x\"\n", "#assert x\n"):
        _refused(_tampered(tmp_path, base, _prepend(text + other)), "module 'm0'", "directive")


# ---- 6. the source model: a name, never a path ----------------------------------------------------

@pytest.mark.parametrize("kind", ["file", "builtin"])
@pytest.mark.parametrize("name", ["/etc/shadow", "../../etc/shadow", "a/b.onnx", "a\\b.onnx", "x\0.onnx", "x\n.onnx"])
def test_a_source_model_that_is_a_path_is_refused(tmp_path, base, kind, name) -> None:
    def edit(m, b):
        m["source"].update(model=name, kind=kind)

    _refused(_tampered(tmp_path, base, edit), "source.model")


@pytest.mark.parametrize("cmd", [["run"], ["memory", "-o", "{out}/m.html"], ["export-graph", "-o", "{out}/x.onnx"]])
def test_commands_refuse_a_source_path_without_touching_it(capsys, tmp_path, base, cmd) -> None:
    path = _tampered(tmp_path, base, lambda m, b: m["source"].update(model="/etc/shadow", kind="file"))
    argv = [cmd[0], str(path)] + [a.format(out=tmp_path) for a in cmd[1:]]
    msg = fails(capsys, argv, needles=["source.model"])
    assert "reference" not in msg and "sha256" not in msg


def test_a_plan_records_its_source_file_by_base_name_never_by_path(tmp_path) -> None:
    """fusec records the base name (loader.source_record) and loads it; the file's path is refused."""
    src = save(relu_model(), tmp_path / "relu.onnx")
    fusec.compile(str(src)).save(tmp_path / "r.fplan")
    plan = _read(tmp_path / "r.fplan")
    assert plan[0]["source"]["model"] == "relu.onnx" and plan[0]["source"]["kind"] == "file"
    assert fusec.load(tmp_path / "r.fplan").arch
    _refused(_tampered(tmp_path, plan, lambda m, b: m["source"].__setitem__("model", str(src))), "source.model")
