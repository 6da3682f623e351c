"""The one pass signature: ``run(graph, options) -> PassResult(graph, changed)``.

A pass module exposes ``NAME`` (used in dumps and on the command line), optionally ``REQUIRES``
(names of passes that must have run before it; checked by the pipeline, not a comment) and
``run``. Passes never mutate the graph they are given in a way the caller can observe through
the old ``Graph`` object's lists; they return a new Graph (Value/Node objects may be shared).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fusec.ir import Graph


@dataclasses.dataclass
class PassResult:
    graph: Graph
    changed: bool


@dataclasses.dataclass
class PassOptions:
    """Knobs shared by all passes. ``disabled_fusions``/``enabled_fusions`` name fusion rules."""

    disabled_fusions: frozenset[str] = frozenset()
    enabled_fusions: frozenset[str] = frozenset()
    # Per-candidate decisions keyed by the stable candidate key (``fusion.candidate_key``, the
    # "key" of each ``graph.meta["fusions"]`` record): True fuses, False keeps the members apart.
    # Set from an A/B ledger; wins over the rule flags. Empty: the rule-based defaults.
    fusion_overrides: dict[str, bool] = dataclasses.field(default_factory=dict)
    # Storage dtype of floating-point tensors in the compiled plan ("f32", "f16" or "bf16");
    # arithmetic inside kernels stays fp32. Applied by passes/precision.py.
    storage_dtype: str = "f32"
    # Kernel choices {choice key: variant} (``fusec.lower.choices``) whose weight layout
    # passes/weight_layout.py materializes in the IR; the lowering then emits the variant.
    choices: dict[str, str] = dataclasses.field(default_factory=dict)
    # Read every constant 2-D weight [N, K] through the transpose flag instead of caching its
    # transpose (passes/transpose_cache.py): a generation plan's prefill (cuBLAS) and decode (GEMV,
    # which reads [N, K]) then share one copy of each weight.
    weights_nk: bool = False
    # How fp32 products with a constant weight run: "3xtf32" (passes/split_tf32.py: one tf32
    # tensor-core GEMM over 3K, fp32-accurate) or "sgemm" (cuBLAS's exact-fp32 SIMT path). Plain
    # ``optimize`` keeps "sgemm"; ``fusec.compiler.stage`` picks "3xtf32" for fp32 plans on sm_80+.
    fp32_gemm: str = "sgemm"
    # Weight-only quantization of products with constant weights (passes/quantize.py): None, "int8"
    # (per-channel) or "int4" (group-wise, ``quantize_group`` 32 or 128); ``quantize_head`` also
    # quantizes the output projections (the LM head), which stay in higher precision by default.
    quantize: str | None = None
    quantize_group: int = 128
    quantize_head: bool = False
    # The target has thread-block clusters (sm_90+): kernel selection may record a K split over a cluster
    # (fusec's GEMM in its stream form, ``build_gemm.stream_splits``).
    clusters: bool = False
    # The target is sm_90, whose GPUs run wgmma (sm_90a; not sm_100 and later): fusec's GEMM takes its wgmma form.
    wgmma: bool = False
    # Why each matcher declined a near match: list of (pattern, where, reason). Filled by passes.
    declines: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    # Facts passes record for reports (`inspect`): counters such as transposes_cached.
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def decline(self, pattern: str, where: str, reason: str) -> None:
        """Record that matcher ``pattern`` declined a near match at ``where`` (one line)."""
        self.declines.append((pattern, where, reason))

    def bump(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n
