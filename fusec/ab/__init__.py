"""Fusion A/B experiments: measure every fusion candidate and kernel choice, keep what is faster.

    ledger = fusec.ab.run("gpt2-small", shapes={"input_ids": (8, 128)}, dtype="fp16")
    print(ledger.to_table())
    plan = fusec.compile("gpt2-small", ..., fusion_overrides=ledger.overrides(), choices=ledger.choices())

Modules: ``regions`` (candidates and their standalone region graphs), ``decide`` (numerical gate
and timing rule), ``runner`` (build/run/time, injectable), ``experiment`` (``run``), ``ledger``
(JSON/table), ``cache`` (on-disk results).
"""

from __future__ import annotations

from fusec.ab.decide import MARGIN, TOLERANCE, decide, rel_error
from fusec.ab.experiment import run
from fusec.ab.ledger import Entry, Ledger, LedgerError

__all__ = ["MARGIN", "TOLERANCE", "Entry", "Ledger", "LedgerError", "decide", "rel_error", "run", "attach"]


def attach(plan, ledger: Ledger) -> None:  # noqa: ANN001 (fusec.Plan; imported lazily by callers)
    """Store ``ledger`` in ``plan``'s manifest (key "ab"), with the decisions the compile did not
    find among its candidates (``unmatched``: a ledger from another model or shape)."""
    rep = plan.manifest.get("report", {})
    found = {r.get("key") for r in rep.get("fusions", [])}
    applied = set(rep.get("lowering", {}).get("choices", {}).get("applied", {}))
    data = ledger.to_dict()
    data["unmatched"] = sorted([k for k in ledger.overrides() if k not in found]
                               + [k for k in ledger.choices() if k not in applied])
    plan.manifest["ab"] = data
