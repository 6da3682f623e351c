"""The runtime executes a compiled plan; it knows nothing of the IR. Imports CuPy lazily."""

from __future__ import annotations

__all__ = ["Executor"]


def __getattr__(name: str):
    if name == "Executor":
        from fusec.runtime.executor import Executor

        return Executor
    raise AttributeError(name)
