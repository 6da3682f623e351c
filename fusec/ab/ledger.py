"""The A/B ledger: every experiment, its timings, error and decision; JSON in, JSON out, a table.

JSON form (``Ledger.to_json``), version 1::

    {"format": "fusec-ab-ledger", "version": 1, "model", "dtype", "shapes", "cuda_graph",
     "margin", "environment": {...}, "entries": [ENTRY, ...], "whole_plan": {...} | null,
     "fp32_gemm": "3xtf32" | "sgemm"}
    ENTRY = {"candidate", "key", "rule", "kind": "fusion" | "kernel_choice", "members", "ops",
             "layer", "applies_to": [key, ...], "region": {"signature", "shape"}, "variant",
             "rule_default", "cost_estimate", "count", "requires", "fused": TIMING | null, "unfused": TIMING | null,
             "max_error", "tolerance", "decision": "fused" | "unfused" | "not measured",
             "reason", "cached"}
    TIMING = {"median_ms", "p10_ms", "p90_ms", ...}

``fp32_gemm``: how the measured plan ran fp32 products with constant weights (``fusec.compile``'s
option; A/B experiments measure the default, "3xtf32"; a ledger without the field is from before
it was recorded, when only that mode was measured). ``fusec compile --decisions`` refuses a ledger
whose mode differs from the compile's: the 3xTF32 products' choice keys would not exist.
``Ledger.overrides()``/``choices()`` turn the decisions into compile options; a ledger whose
whole-plan check kept the rule-based plan yields none (the rule-based plan is reproduced).
``from_json`` validates everything it uses and raises ``LedgerError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from fusec.ab.decide import FUSED, NOT_MEASURED, UNFUSED
from fusec.errors import FusecError

FORMAT, VERSION = "fusec-ab-ledger", 1
_DECISIONS = (FUSED, UNFUSED, NOT_MEASURED)
_KINDS = ("fusion", "kernel_choice")


class LedgerError(FusecError):
    """A ledger file is malformed; the message names the entry and field."""


@dataclasses.dataclass
class Entry:
    candidate: str
    key: str
    rule: str
    kind: str
    members: list[str]
    ops: list[str]
    layer: str | None
    applies_to: list[str]
    region: dict[str, Any]
    variant: str
    rule_default: str
    cost_estimate: float
    count: int = 1  # places of the model the decision covers (same region structure / choice key)
    requires: list[str] = dataclasses.field(default_factory=list)  # kernel choice: fusions it needs
    fused: dict[str, Any] | None = None
    unfused: dict[str, Any] | None = None
    max_error: float | None = None
    tolerance: float | None = None
    decision: str = NOT_MEASURED
    reason: str = ""
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["max_error"] is not None and not math.isfinite(d["max_error"]):
            d["max_error"] = str(d["max_error"])  # JSON has no inf/nan; "inf"/"nan" round-trip via float()
        return d


@dataclasses.dataclass
class Ledger:
    model: str
    dtype: str
    cuda_graph: bool
    shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    margin: float = 0.03
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    entries: list[Entry] = dataclasses.field(default_factory=list)
    whole_plan: dict[str, Any] | None = None
    fp32_gemm: str = "3xtf32"

    # ---- decisions as compile options -----------------------------------------------------
    @property
    def kept_rule_based(self) -> bool:
        return bool(self.whole_plan) and self.whole_plan.get("kept") == "rule_based"

    def overrides(self) -> dict[str, bool]:
        """{fusion candidate key: fuse?} for every measured fusion (see module doc). The fusions an
        accepted kernel choice lowers stay fused, whatever their own (tied) experiment said: the
        choice was measured on the fused group."""
        if self.kept_rule_based:
            return {}
        out = {k: e.decision == FUSED for e in self.entries if e.kind == "fusion" and e.decision != NOT_MEASURED
               for k in e.applies_to}
        chosen = self.choices()
        for e in self.entries:
            if e.kind == "kernel_choice" and chosen.get(e.key) == e.variant:
                out.update({k: True for k in e.requires})
        return out

    def choices(self) -> dict[str, str]:
        """{choice key: variant} for accepted kernel choices (the fastest where several won)."""
        if self.kept_rule_based:
            return {}
        best: dict[str, tuple[float, str]] = {}
        for e in self.entries:
            if e.kind == "kernel_choice" and e.decision == FUSED and e.fused is not None:
                ms = float(e.fused["median_ms"])
                for k in e.applies_to:
                    if k not in best or ms < best[k][0]:
                        best[k] = (ms, e.variant)
        return {k: v for k, (_, v) in best.items()}

    # ---- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "model": self.model, "dtype": self.dtype, "shapes": self.shapes,
                "cuda_graph": self.cuda_graph, "margin": self.margin, "environment": self.environment,
                "entries": [e.to_dict() for e in self.entries], "whole_plan": self.whole_plan,
                "fp32_gemm": self.fp32_gemm}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, ensure_ascii=True)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "ledger") -> Ledger:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise LedgerError(f"{where}: not valid JSON ({e})") from None
        return cls.from_dict(data, where)

    @classmethod
    def from_dict(cls, data: Any, where: str = "ledger") -> Ledger:
        if not isinstance(data, dict):
            raise LedgerError(f"{where}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise LedgerError(f"{where}: field 'format' must be {FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != VERSION:
            raise LedgerError(f"{where}: field 'version' is {data.get('version')!r}, this fusec reads {VERSION}")
        for field, typ in (("model", str), ("dtype", str), ("cuda_graph", bool), ("entries", list)):
            if not isinstance(data.get(field), typ):
                raise LedgerError(f"{where}: field {field!r} must be a {typ.__name__}")
        whole = data.get("whole_plan")
        if whole is not None and not isinstance(whole, dict):
            raise LedgerError(f"{where}: field 'whole_plan' must be an object or null")
        fp32_gemm = data.get("fp32_gemm", "3xtf32")
        if fp32_gemm not in ("3xtf32", "sgemm"):
            raise LedgerError(f"{where}: field 'fp32_gemm' must be '3xtf32' or 'sgemm', got {fp32_gemm!r}")
        entries = [_entry(e, f"{where}: entries[{i}]") for i, e in enumerate(data["entries"])]
        return cls(data["model"], data["dtype"], data["cuda_graph"], dict(data.get("shapes") or {}),
                   float(data.get("margin", 0.03)), dict(data.get("environment") or {}), entries, whole, fp32_gemm)

    @classmethod
    def load(cls, path: str) -> Ledger:
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as e:
            raise LedgerError(f"cannot read ledger {path!r}: {e.strerror or e}") from None
        return cls.from_json(text, path)

    # ---- table ------------------------------------------------------------------------------
    def to_table(self) -> str:
        """The ledger for people: one row per experiment, then the whole-plan timings."""
        head = ("candidate", "rule", "n", "fused ms", "unfused ms", "error", "decision", "reason")
        rows = [head]
        for e in self.entries:
            rows.append((_short(e.candidate, 44), e.rule, str(e.count), _ms(e.fused), _ms(e.unfused),
                         "-" if e.max_error is None else f"{float(e.max_error):.2g}", e.decision, _short(e.reason, 70)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        lines.append(f"({len(self.entries)} experiments; {self.dtype}, {'cuda graph' if self.cuda_graph else 'eager'}; "
                     f"fused accepted only when faster by more than the p10-p90 spread and {100 * self.margin:.0f}%)")
        if self.whole_plan:
            for name in ("rule_based", "unfused", "assembled"):
                t = self.whole_plan.get(name)
                if t:
                    lines.append(f"whole plan {name:<10} median {_ms(t)} ms  (p10 {t['p10_ms']:.4f}, p90 {t['p90_ms']:.4f})")
            if self.whole_plan.get("note"):
                lines.append(str(self.whole_plan["note"]))
        return "\n".join(lines)


def _ms(t: dict[str, Any] | None) -> str:
    return "-" if not t else f"{float(t['median_ms']):.4f}"


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _entry(e: Any, where: str) -> Entry:
    if not isinstance(e, dict):
        raise LedgerError(f"{where}: expected an object")
    fields = {f.name: f for f in dataclasses.fields(Entry)}
    missing = [n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in e]
    if missing:
        raise LedgerError(f"{where}: missing field {missing[0]!r}")
    if e["kind"] not in _KINDS:
        raise LedgerError(f"{where}: field 'kind' must be one of {_KINDS}, got {e['kind']!r}")
    if e.get("decision", NOT_MEASURED) not in _DECISIONS:
        raise LedgerError(f"{where}: field 'decision' must be one of {_DECISIONS}, got {e.get('decision')!r}")
    if not isinstance(e["applies_to"], list) or not all(isinstance(k, str) for k in e["applies_to"]):
        raise LedgerError(f"{where}: field 'applies_to' must be a list of candidate keys")
    if not isinstance(e.get("requires", []), list) or not all(isinstance(k, str) for k in e.get("requires", [])):
        raise LedgerError(f"{where}: field 'requires' must be a list of candidate keys")
    for name in ("candidate", "key", "variant"):
        if not isinstance(e[name], str):
            raise LedgerError(f"{where}: field {name!r} must be a string")
    for side in ("fused", "unfused"):
        t = e.get(side)
        if t is not None and not (isinstance(t, dict) and all(isinstance(t.get(k), (int, float)) for k in ("median_ms", "p10_ms", "p90_ms"))):
            raise LedgerError(f"{where}: field {side!r} must be null or hold numeric median_ms, p10_ms, p90_ms")
    if e.get("decision") == FUSED and e["kind"] == "kernel_choice" and e.get("fused") is None:
        raise LedgerError(f"{where}: an accepted kernel choice needs its 'fused' timing")
    kw = {n: e[n] for n in fields if n in e}
    if kw.get("max_error") is not None:
        try:
            kw["max_error"] = float(kw["max_error"])
        except (TypeError, ValueError):
            raise LedgerError(f"{where}: field 'max_error' must be a number") from None
    return Entry(**kw)
