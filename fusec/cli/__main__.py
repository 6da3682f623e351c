"""``python -m fusec.cli``: the same as the ``fusec`` executable."""

from __future__ import annotations

import sys

from fusec.cli import main

sys.exit(main())
