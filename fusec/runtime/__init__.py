"""The runtime executes a compiled plan; it knows nothing of the IR. Imports CuPy lazily."""

from __future__ import annotations

__all__ = ["Plan"]


def __getattr__(name: str):
    if name == "Plan":
        from fusec.runtime.plan import Plan

        return Plan
    raise AttributeError(name)
