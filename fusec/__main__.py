"""``python -m fusec``: the same as the ``fusec`` executable."""

from __future__ import annotations

import sys

from fusec.cli import main

if __name__ == "__main__":
    sys.exit(main())
