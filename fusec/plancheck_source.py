"""Kernel sources in a plan are compiled by ``recompile=True`` (``fusec.plancheck`` calls
``check_source`` on each): they must be self-contained, and their preprocessor directives fusec's
own, found as the preprocessor finds them."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from fusec.planfile import PlanFileError
from fusec.plancheck_fields import DIRECTIVES, PRAGMA_RE, SOURCE_REFUSED, _shown


def check_source(blob: Any, entry: str, what: str) -> None:
    """Bundled sources are compiled by ``recompile=True``: they are self-contained (fusec's
    templates inline their helpers), so a source that includes a file or lacks its entry point is
    refused. Directives are found as the preprocessor finds them: continuations joined, comments
    made spaces (``#/**/include``), the digraph ``%:`` read as ``#``; each one must be one of
    fusec's own (DIRECTIVES: ``#define``, ``#pragma unroll``/``once``, ...). Nothing that could
    reach a file without a directive passes (``__has_include``, ``_Pragma``, token pasting), nor
    what the preprocessor might read otherwise than this check does (trigraphs, raw strings,
    control and format characters)."""
    try:
        text = bytes(blob).decode("utf-8")
    except UnicodeDecodeError:
        raise PlanFileError(f"{what}: kernel source is not UTF-8 text") from None
    found = _ASCII_CONTROL.search(text)
    bad = found.group(0) if found else None
    if bad is None and not text.isascii():
        bad = next((ch for ch in text if ch not in "\t\n" and unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp")),
                   None)
    if bad is not None:
        raise PlanFileError(f"{what}: kernel source holds the control or format character {bad!r}")
    odd = _ODD.search(text)
    if odd:  # each read otherwise by some preprocessors, or otherwise than this check reads it
        raise PlanFileError(f"{what}: kernel source holds {_shown(odd.group(0))} (a trigraph, a raw string literal "
                            "or a backslash before spaces at a line end); fusec's sources hold none")
    joined = _SPLICE.sub("", text)
    for view in _source_views(joined):
        for word in SOURCE_REFUSED:
            if word in view:
                raise PlanFileError(f"{what}: kernel source uses {word!r}; fusec's sources are self-contained "
                                    "and paste no tokens")
        for m in _DIRECTIVE.finditer(view):
            rest = m.group(1).strip()
            name = re.match(r"[A-Za-z_]\w*", rest)
            if not rest or (name and name.group(0) in DIRECTIVES and
                            (name.group(0) != "pragma" or PRAGMA_RE.fullmatch(rest[6:].strip()))):
                continue
            shown = _shown("#" + rest[:40])
            if name and name.group(0).startswith("include"):
                raise PlanFileError(f"{what}: kernel source includes a file ({shown}); fusec's sources are "
                                    "self-contained")
            raise PlanFileError(f"{what}: kernel source has the directive {shown}, not one fusec writes "
                                f"(#{', #'.join(DIRECTIVES)} and #pragma unroll/once)")
    if not re.search(r"\b" + re.escape(entry) + r"\s*\(", text):
        raise PlanFileError(f"{what}: kernel source does not define its entry {entry!r}")


# C/C++ lexing for _check_source (after continuations are joined): comments, string and character
# literals (ending at the end of their line, as an unterminated one does) and pp-numbers with a digit
# separator (1'000: no character literal); a number starts where no identifier goes on
_IDCHAR = r"(?:[A-Za-z0-9_$]|[^\x00-\x7f]|\\u[0-9A-Fa-f]{4}|\\U[0-9A-Fa-f]{8})"
_PART = rf"(?:[eEpP][+-]|\.|{_IDCHAR})"
_TOKEN = re.compile(
    r"(?=[/\"'.0-9])"  # (only where a token can start: quicker)
    r"(?:(?P<c>//[^\n]*|/\*.*?(?:\*/|\Z))"
    r"|\"(?:[^\"\\\n]|\\[^\n])*\"?|'(?:[^'\\\n]|\\[^\n])*'?"
    rf"|(?<![A-Za-z0-9_$\x80-\U0010ffff])\.?[0-9]{_PART}*'{_IDCHAR}(?:'{_IDCHAR}|{_PART})*)", re.S)
_COMMENT = re.compile(r"(?P<c>//[^\n]*|/\*.*?(?:\*/|\Z))", re.S)  # literals not seen: a "/*" in one opens a comment
_ASCII_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_SPLICE = re.compile(r"\\\n")
_ODD = re.compile(r"\?\?[=/'()!<>-]|R\"|\\[ \t]+\n")
# a directive: "#" or "%:" first on a line (after spaces, or what may read as them), then its name
_DIRECTIVE = re.compile(r"^(?:[^\S\n]|[\u200b-\u200d\u2060\ufeff])*(?:#|%:)(.*)$", re.M)


def _source_views(text: str) -> list[str]:
    """``text`` with its comments made spaces, four ways, so that a directive any one of them shows
    is checked: comments found by a lexer that knows literals, and by a plain search for ``//`` and
    ``/*`` (a lexer this check got wrong cannot hide a line); a comment made one space (a directive
    may span a multi-line comment) and the same keeping its line breaks (what follows it may start
    a line)."""
    def one_space(m: re.Match[str]) -> str:
        return " " if m.lastgroup == "c" else m.group(0)  # a literal or a number, as it is

    def spaces(m: re.Match[str]) -> str:
        return " " + "\n" * m.group(0).count("\n") if m.lastgroup == "c" else m.group(0)

    ways = (one_space, spaces) if "/*" in text else (one_space,)  # no block comment: the two ways are one
    return [rx.sub(way, text) for rx in (_TOKEN, _COMMENT) for way in ways]
