"""Re-targeting a plan file to another GPU architecture (``recompile``; ``fusec compile PLAN --arch``).

Two ways, both ending in a plan file for ``arch`` written atomically:

- **from the bundled kernel sources** (the default): a plan's launch list, memory plan, state
  layout and weights do not depend on the arch, only its cubins do, and every module's source is
  in the plan. Each is compiled for ``arch``; a kernel whose shared memory does not fit the arch,
  or whose source does not compile for it (fp16/bf16 tensor-core code below sm_80), is one error
  naming the module. Weights are streamed from the old file's mapping into the new file.
- **from the recorded source model** (``from_source=True``): the manifest's ``source`` record
  names a built-in model or a file by digest, not by path (``fusec.loader.source_record``). The
  model is compiled again with the recorded shapes, dtype, CUDA-graph flag and options; a file
  whose sha256 differs from the record, or a built-in model whose config changed since, is
  refused. Choices that were measured on the old GPU (A/B decisions) are recorded options and are
  kept.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from fusec.errors import FusecError

# the most dynamic shared memory one block may opt into, by compute capability (CUDA programming
# guide, "Technical specifications per compute capability")
MAX_SMEM = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448,
            100: 232448, 103: 232448, 110: 232448, 120: 101376, 121: 101376}


def recompile(plan_path: str | os.PathLike, arch: str, out_path: str | os.PathLike, *, from_source: bool = False,
              model: str | os.PathLike | None = None, progress: Callable[[str, str], None] | None = None) -> Any:
    """Re-target the plan file ``plan_path`` to GPU architecture ``arch`` and write it to
    ``out_path``; returns the new plan (see the module docstring for the two ways). Errors (no
    usable source, a digest that differs, a kernel that does not fit or compile for ``arch``) are
    one-line ``FusecError``s."""
    from fusec.codegen.compile import check_arch
    from fusec.fsutil import check_output_path
    from fusec.plan import Plan

    arch = check_arch(str(arch))
    out = check_output_path(out_path, "plan file", not_same_as=[plan_path])
    plan = Plan.open(plan_path)
    where = os.fspath(plan_path)
    if from_source:
        new = _from_source(plan, where, arch, model, progress)
    else:
        _check_smem(plan.manifest, where, arch)
        if progress:
            progress("kernel", f"{len(plan.manifest['modules'])} modules for {arch}")
        plan._recompile(arch)
        new = plan
    new.save(out)
    return new


def _check_smem(m: Mapping[str, Any], where: str, arch: str) -> None:
    limit = MAX_SMEM.get(int(arch[3:]))
    if limit is None:
        return  # an arch this table does not know: NVRTC and the driver decide
    for i, k in enumerate(m["kernels"]):
        if int(k.get("smem", 0)) > limit:
            raise FusecError(f"{where}: kernel #{i} ({k['entry']}) uses {k['smem']} bytes of shared memory, "
                             f"more than {arch} allows ({limit}); compile the model for {arch} instead")


def _from_source(plan: Any, where: str, arch: str, model: str | os.PathLike | None,
                 progress: Callable[[str, str], None] | None) -> Any:
    import fusec
    from fusec.loader import resolve_source

    m = plan.manifest
    src = m["source"]
    if "entries" in m:
        raise FusecError(f"{where}: a plan with several entry points (generation) is re-targeted from its kernel "
                         "sources (from_source=False)")
    try:
        path = resolve_source(src, where, model)
    except FusecError as e:
        raise FusecError(f"{e}; re-target from the kernel sources instead (from_source=False)") from None
    opts = dict(src.get("options") or {})
    shapes = {k: tuple(v) for k, v in src.get("shapes", {}).items()} or None
    return fusec.compile(path, shapes=shapes, dtype=m["dtype"], cuda_graph=bool(m.get("cuda_graph")), arch=arch,
                         progress=progress, **opts)
