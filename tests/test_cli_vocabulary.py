"""One CLI vocabulary (issue 11 item 4): the same fusion flags on every command that compiles,
unknown rule names refused with the known ones, --json a switch everywhere, no GPU-only flag
silently ignored on the reference backend, plans never send the user in a circle, -q/-v."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from test_cli import call, no_gpu  # noqa: F401 -- no_gpu: a fixture used by pytestmark

import fusec
from fusec.cli import COMMANDS, build_parser
from fusec.passes.fusion_rules import RULES

COMPILING = ("compile", "run", "bench", "explain")

pytestmark = pytest.mark.usefixtures("no_gpu")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_every_compiling_command_takes_the_same_fusion_flags() -> None:
    subs = _subparsers()
    for name in COMPILING:
        opts = _options(subs[name])
        for flag in ("--disable-fusion", "--enable-fusion"):
            assert flag in opts, (name, flag)
            assert opts[flag].dest == flag[2:].replace("-", "_") and isinstance(opts[flag], argparse._AppendAction)


def test_explain_keeps_the_old_flags_as_hidden_aliases(capsys) -> None:
    help_text = call(capsys, ["explain", "--help"])[1]
    assert "--disable-fusion" in help_text and "--disable " not in help_text and "--enable " not in help_text
    new = json.loads(call(capsys, ["explain", "gpt2-tiny", "--json", "--disable-fusion", "gemm_epilogue"])[1])
    old = json.loads(call(capsys, ["explain", "gpt2-tiny", "--json", "--disable", "gemm_epilogue"])[1])
    default = json.loads(call(capsys, ["explain", "gpt2-tiny", "--json"])[1])
    assert new == old and new["launches"] != default["launches"]


@pytest.mark.parametrize("argv", [
    ["compile", "gpt2-tiny", "-o", "{tmp}/g.fplan", "--disable-fusion", "bogus"],
    ["run", "gpt2-tiny", "--enable-fusion", "bogus"],
    ["run", "gpt2-tiny", "--backend", "reference", "--disable-fusion", "bogus"],
    ["explain", "gpt2-tiny", "--enable-fusion", "bogus"],
    ["explain", "gpt2-tiny", "--disable", "bogus"],
])
def test_unknown_fusion_names_are_refused_with_the_known_ones(capsys, tmp_path, argv) -> None:
    code, out, err = call(capsys, [a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("fusec: error: --") and "unknown fusion rule 'bogus'" in err
    assert err.rstrip().endswith(f"(known: {', '.join(RULES)})")
    assert list(tmp_path.iterdir()) == []


def test_json_is_a_switch_on_every_command() -> None:
    seen = []
    for name, p in _subparsers().items():
        opts = _options(p)
        if "--json" in opts:
            seen.append(name)
            assert opts["--json"].nargs == 0 and opts["--json"].default is False, name
    assert {"models", "inspect", "explain", "generate", "ab", "doctor", "bench"} <= set(seen)
    assert "--json-out" in _options(_subparsers()["ab"])  # the ledger file is its own flag


def test_global_flags_are_on_every_command() -> None:
    subs = _subparsers()
    for name in COMMANDS:
        opts = _options(subs[name.replace("_", "-")])
        assert {"--debug", "-q", "--quiet", "-v", "--verbose"} <= set(opts), name


def test_quiet_prints_only_results(capsys, tmp_path) -> None:
    code, out, err = call(capsys, ["-q", "run", "gpt2-tiny"])
    assert code == 0 and err == "" and out.startswith("model gpt2-tiny  backend reference")
    code, out, err = call(capsys, ["compile", "gpt2-tiny", "--dtype", "fp32", "-o", str(tmp_path / "g.fplan"), "-q"])
    assert code == 0 and err == "" and out.startswith("compiled gpt2-tiny")


def test_verbose_prints_every_step_and_timings(capsys, tmp_path) -> None:
    code, out, err = call(capsys, ["-v", "compile", "gpt2-tiny", "--dtype", "fp32", "-o", str(tmp_path / "g.fplan")])
    assert code == 0
    lines = err.splitlines()
    passes = [ln for ln in lines if "] pass " in ln]
    assert len(passes) == int(out.split(" passes,")[0].rsplit("(", 1)[1])  # one line per pass, as counted
    timing = next(ln for ln in lines if ln.startswith("timings: "))
    assert "passes " in timing and "kernels " in timing


def test_progress_says_passes_not_passs(capsys, tmp_path) -> None:
    code, out, err = call(capsys, ["compile", "gpt2-tiny", "--dtype", "fp32", "-o", str(tmp_path / "g.fplan")])
    assert code == 0 and "passs" not in err + out
    assert "] passes ..." in err and " passes, " in out


def test_quiet_and_verbose_exclude_each_other(capsys) -> None:
    code, _, err = call(capsys, ["-q", "-v", "models"])
    assert code == 2 and "not allowed with argument" in err
    code, _, err = call(capsys, ["-q", "models", "-v"])
    assert code == 1 and err == "fusec: error: -q/--quiet and -v/--verbose exclude each other\n"


def test_stats_on_the_reference_backend_is_refused(capsys) -> None:
    for argv in (["run", "gpt2-tiny", "--stats"], ["run", "gpt2-tiny", "--backend", "reference", "--stats"]):
        code, out, err = call(capsys, argv)
        assert code == 1 and out == "" and err.count("\n") == 1
        assert err.startswith("fusec: error: --stats counts what the GPU did")


@pytest.mark.parametrize("flag", [["--cuda-graph"], ["--arch", "sm_80"]])
def test_gpu_only_flags_with_an_explicit_reference_backend_are_refused(capsys, flag) -> None:
    code, _, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", *flag])
    assert code == 1 and err == (f"fusec: error: {flag[0]} applies to compiling for the GPU; --backend reference "
                                 f"compiles nothing: drop {flag[0]}\n")


def test_dtype_on_the_reference_backend_is_applied(capsys, tmp_path) -> None:
    outs = {}
    for dtype in ("fp32", "fp16"):
        code, out, err = call(capsys, ["run", "gpt2-tiny", "--backend", "reference", "--dtype", dtype,
                                       "--save-outputs", str(tmp_path / f"{dtype}.npz")])
        assert code == 0, err
        assert f"dtype {dtype}" in out.splitlines()[0]
        assert any(ln.startswith(f"output logits  {'f32' if dtype == 'fp32' else 'f16'}[1,16,1000]") for ln in out.splitlines())
        with np.load(tmp_path / f"{dtype}.npz") as z:
            outs[dtype] = z["logits"].astype(np.float64)
    diff = np.abs(outs["fp16"] - outs["fp32"]).max()
    assert 0 < diff < 0.05  # fp16 storage rounds, but it is the same model


def test_a_plan_says_what_to_run_instead(capsys, tmp_path) -> None:
    path = tmp_path / "g.fplan"
    fusec.compile("bert-tiny", dtype="fp32", arch="sm_90").save(path)
    for extra in ([], ["--backend", "reference"]):
        code, _, err = call(capsys, ["run", str(path), *extra])
        assert code == 1 and err.count("\n") == 1
        assert "`fusec run bert-tiny --backend reference" in err
        assert "use --backend reference" not in err  # what the model-less plan cannot do is never suggested


def test_generation_compile_takes_fusion_flags(capsys, tmp_path) -> None:
    """--disable-fusion on a generation plan turns the rule off in every entry (the head_dim-64 Qwen3's
    decode attention gets its head_rope launch back) and is recorded; a misspelled rule is one line
    and writes nothing."""
    import dataclasses

    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    code, _, err = call(capsys, ["compile", "qwen3-tiny", "--generate", "--disable-fusion", "rope_atention",
                                 "-o", str(tmp_path / "q.fplan")])
    assert code == 1 and "rope_atention" in err and err.count("\n") == 1 and list(tmp_path.iterdir()) == []
    cfg = dataclasses.replace(get_config("qwen3-tiny"), head_dim=64, name="qwen3-d64")

    def labels(**kw) -> list[str]:  # noqa: ANN003
        from fusec.compiler import compile_generation

        gm = GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)
        plan = compile_generation(gm, batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90", eos_ids=[], **kw)
        assert plan.manifest["source"].get("options", {}) == {k: sorted(v) for k, v in kw.items()}
        return [L["label"] for L in plan.manifest["entries"]["decode"]["launches"]]

    on, off = labels(), labels(disabled_fusions=("rope_attention",))
    assert sum("rope_attention" in x for x in on) == cfg.num_layers and not any("rope_attention" in x for x in off)
    assert len(off) == len(on) + cfg.num_layers
    code, out, err = call(capsys, ["compile", "qwen3-tiny", "--generate", "--disable-fusion", "rope_attention",
                                   "--arch", "sm_90", "-o", str(tmp_path / "q.fplan")])
    assert code == 0, err
    assert fusec.load(tmp_path / "q.fplan").manifest["source"]["options"] == {"disabled_fusions": ["rope_attention"]}


def test_recompile_a_plan_for_another_arch(capsys, tmp_path) -> None:
    src, dst = tmp_path / "g.fplan", tmp_path / "g80.fplan"
    assert call(capsys, ["compile", "gpt2-tiny", "--dtype", "fp32", "--arch", "sm_90", "-o", str(src)])[0] == 0
    code, out, err = call(capsys, ["compile", str(src), "--arch", "sm_80", "-o", str(dst)])
    assert code == 0, err
    assert out.startswith(f"re-targeted {src} -> {dst} for sm_80")
    assert fusec.plan.Plan.open(dst).arch == "sm_80"
    code, _, err = call(capsys, ["compile", str(src), "--arch", "sm_80", "--dtype", "fp16", "-o", str(tmp_path / "x.fplan")])
    assert code == 1 and err.startswith("fusec: error: --dtype: re-targeting a plan keeps what it was compiled with")
    code, _, err = call(capsys, ["compile", str(src), "-o", str(tmp_path / "x.fplan")])
    assert code == 1 and "give --arch sm_XX to re-target it" in err


def test_no_internal_wording_reaches_users(capsys) -> None:
    import re

    internal = re.compile(r"\bseed \d{3}\b|\bissue \d+\b|\bhelper\b")  # the project's session/issue names
    for rule in RULES.values():
        assert not internal.search(rule.why), rule
    code, out, _ = call(capsys, ["explain", "llama-tiny", "--all", "--json"])
    assert code == 0 and not internal.search(out)
    code, out, _ = call(capsys, ["inspect", "llama-tiny", "--json"])
    assert code == 0 and not internal.search(out)
