"""Every FUSEC_* environment knob is declared in fusec/knobs.py and read through it when used
(issue 19, point 7): a knob named anywhere in the package is declared, no module reads one from
os.environ itself, and a value of the wrong kind is a one-line error naming the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fusec import knobs
from fusec.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("fusec", "passes", "models") for p in (ROOT / d).rglob("*.py")]


def test_every_knob_named_in_the_package_is_declared() -> None:
    named = {m for p in SOURCES for m in re.findall(r"\bFUSEC_[A-Z][A-Z0-9_]*\b", p.read_text())}
    assert named and named <= set(knobs.KNOBS), sorted(named - set(knobs.KNOBS))


def test_no_module_reads_a_knob_from_the_environment_itself() -> None:
    reads = re.compile(r"(environ\.get|getenv)\(\s*[\"']FUSEC_|environ\[[\"']FUSEC_[A-Z_]+[\"']\](?!\s*=)")
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in SOURCES if p.name != "knobs.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert not offenders


@pytest.mark.parametrize("name,text,want", [("FUSEC_PDL", "0", False), ("FUSEC_PDL", "on", True),
                                            ("FUSEC_PDL", None, True), ("FUSEC_COMPILE_THREADS", "3", 3),
                                            ("FUSEC_CUPTI_MODE", "Lazy", "lazy"), ("FUSEC_CACHE_DIR", "/x", "/x")])
def test_values_parse_by_kind(monkeypatch: pytest.MonkeyPatch, name: str, text: str | None, want: object) -> None:
    if text is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, text)
    assert knobs.get(name) == want


@pytest.mark.parametrize("name,text", [("FUSEC_PDL", "maybe"), ("FUSEC_COMPILE_THREADS", "many"),
                                       ("FUSEC_CUPTI_MODE", "sometimes")])
def test_a_value_of_the_wrong_kind_names_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> None:
    monkeypatch.setenv(name, text)
    with pytest.raises(InputError, match=name):
        knobs.get(name)


@pytest.mark.parametrize("name,text,ok", [("FUSEC_KV_SOLO_KEYS", "-1", False), ("FUSEC_KV_SOLO_KEYS", "0", True),
                                          ("FUSEC_KV_SPLIT_KEYS", "0", False), ("FUSEC_QGEMV_MAX_ROWS", "17", False),
                                          ("FUSEC_QGEMV_MAX_ROWS", "16", True)])
def test_an_int_knob_outside_its_bounds_names_the_variable(monkeypatch: pytest.MonkeyPatch, name: str, text: str,
                                                           ok: bool) -> None:
    """Bounded int knobs are checked where they are parsed, one mechanism for all of them."""
    monkeypatch.setenv(name, text)
    if ok:
        assert knobs.get(name) == int(text)
    else:
        with pytest.raises(InputError, match=f"{name}={text!r}"):
            knobs.get(name)


def test_the_quantized_gemv_rows_knob_is_bounded_by_the_kernel() -> None:
    from fusec.codegen.specs_quant import QGEMV_MAX_M

    assert knobs.KNOBS["FUSEC_QGEMV_MAX_ROWS"].bounds == (0, QGEMV_MAX_M)


def test_an_undeclared_knob_is_a_bug() -> None:
    with pytest.raises(KeyError, match="undeclared"):
        knobs.get("FUSEC_NOT_A_KNOB")


def test_fusec_help_lists_every_knob(capsys: pytest.CaptureFixture[str]) -> None:
    from fusec.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in knobs.KNOBS)


def test_benchmark_ab_variants_name_declared_knobs() -> None:
    """benchmarks/decode_step.py's --ab (also block_trace.py's and prefill_step.py's) takes declared knobs with valid
    values and fusion rules to disable; an undeclared knob (one removed, say) or a bad value stops it, instead of
    timing the default plan under the variant's name."""
    import sys
    from pathlib import Path

    from fusec.errors import InputError

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    try:
        from decode_step import parse_ab
    finally:
        sys.path.pop(0)
    assert parse_ab("FUSEC_QGEMV_DP4A_FILL=0+disable=norm_copies,mlp") == ({"FUSEC_QGEMV_DP4A_FILL": "0"},
                                                                              ("norm_copies", "mlp"))
    with pytest.raises(SystemExit, match="FUSEC_NO_SUCH_KNOB is not a fusec knob"):
        parse_ab("FUSEC_NO_SUCH_KNOB=1")
    with pytest.raises(InputError, match="FUSEC_QGEMV_DP4A_WIDE_ROWS"):
        parse_ab("FUSEC_QGEMV_DP4A_WIDE_ROWS=3")
