"""The test suite's own rules: no test touches the user's kernel cache, tests are named after the
area they test, and every IR op has its numpy reference, a GPU lowering and its docs row."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fusec.ops import OP_INFO, FusionKind, Op

TESTS = Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "OPS.md"


def test_the_kernel_cache_of_a_test_run_is_its_own_private_temporary_directory() -> None:
    from fusec.codegen.kernel_cache import cache_dir

    d = cache_dir()
    assert os.environ.get("FUSEC_CACHE_DIR") == str(d)
    home = Path.home() / ".cache" / "fusec"
    assert not d.resolve().is_relative_to(home.resolve()), d
    assert Path(d).name.startswith("fusec-test-cache-")  # made by conftest.py for this run
    assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0  # private: the cache refuses others' dirs


def test_test_files_are_named_after_what_they_test() -> None:
    review = sorted(p.name for p in TESTS.glob("test_review*.py"))
    assert review == [], f"name these after the area they test: {review}"


def _has_lowering(op: Op) -> bool:
    from fusec.codegen.elementwise import CUDA_EXPR
    from fusec.lower.nodes import LOWER

    if op in LOWER:
        return True
    # elementwise and broadcast ops lower through one generated kernel built from their CUDA expression
    return OP_INFO[op].kind in (FusionKind.ELEMENTWISE, FusionKind.BROADCAST) and op in CUDA_EXPR


@pytest.mark.parametrize("op", list(Op), ids=[o.value for o in Op])
def test_every_op_has_its_reference_lowering_and_docs_row(op: Op) -> None:
    from fusec.reference import IMPL

    assert op in OP_INFO, f"{op.value}: no OP_INFO entry (attrs record, shape/dtype rule, fusion kind)"
    assert op in IMPL, f"{op.value}: no numpy reference (fusec/reference.py IMPL)"
    assert _has_lowering(op), f"{op.value}: no GPU lowering (fusec/lower/nodes.py LOWER or a CUDA_EXPR entry)"
    rows = {line.split("|")[1].strip() for line in DOC.read_text(encoding="utf-8").splitlines()
            if line.startswith("| `")}
    assert f"`{op.value}`" in rows, f"{op.value}: no row in docs/OPS.md (python -m fusec.opsdoc > docs/OPS.md)"
