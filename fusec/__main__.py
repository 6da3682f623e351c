"""``python -m fusec``: the same as the ``fusec`` executable."""

from __future__ import annotations

from fusec.cli import entry

if __name__ == "__main__":
    entry()
