"""fusec: a kernel-fusion compiler for transformer models."""

from __future__ import annotations

__version__ = "0.1.0"

from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op


def compile(model, shapes=None, dtype="fp16", cuda_graph=False, arch=None, **kw):  # noqa: A001
    """Compile a model into a runnable ``Plan``; see ``fusec.compiler.compile``."""
    from fusec.compiler import compile as _compile

    _check_fusion_names(kw.get("disabled_fusions", ()), "disabled_fusions")
    _check_fusion_names(kw.get("enabled_fusions", ()), "enabled_fusions")
    return _compile(model, shapes=shapes, dtype=dtype, cuda_graph=cuda_graph, arch=arch, **kw)


def _check_fusion_names(names, what):
    """A misspelled fusion rule name is an error listing the known ones, never ignored."""
    from fusec.errors import InputError
    from fusec.passes.fusion_rules import RULES

    if isinstance(names, str):
        raise InputError(f"{what} must be a list of fusion rule names, got the string {names!r}")
    unknown = [n for n in names if n not in RULES]
    if unknown:
        raise InputError(f"{what}: unknown fusion rule(s) {', '.join(repr(n) for n in unknown)} "
                         f"(known: {', '.join(RULES)})")


def load(path, recompile=False, cuda_graph=None):
    """Load and validate a ``.fplan`` file; see ``fusec.plan.Plan.load``.

    A plan is executable code (CUDA binaries run on the GPU with the process's rights; with
    ``recompile=True`` its bundled sources are compiled). ``load`` checks the file's integrity and
    every manifest field (types, ranges, pointers inside their regions, launch limits, cubin
    headers and arch), but a checksum proves nothing about who wrote it: load plans only from
    trusted sources."""
    from fusec.plan import Plan

    return Plan.load(path, recompile=recompile, cuda_graph=cuda_graph)


def generate(model, prompts, **kw):
    """Generate text with a decoder on any machine: a compiled plan on a GPU, the numpy reference
    backend elsewhere. Returns ``fusec.generation.Generated``; see ``fusec.textgen.generate`` for
    the arguments (max_new_tokens, chat, system, temperature/top_k/top_p/seed, on_text/on_tokens,
    stream_every, batch, max_seq_len, dtype, arch, backend...)."""
    from fusec.textgen import generate as _generate

    return _generate(model, prompts, **kw)


def compile_training(model, batch=32, dtype="fp32", optim=None, backend="auto", arch=None, cuda_graph=True, progress=None):
    """Compile a training plan for ``model`` (a ``fusec.models.train_tasks`` model: the built-in
    intent/slot encoder or a BERT sequence classifier); see ``fusec.train.plan.TrainingPlan``:
    ``step(batch)``, ``evaluate(batches)``, ``save(path)``. ``backend``: "cuda", "reference" (numpy,
    any machine) or "auto" (the GPU when there is one)."""
    from fusec.train.plan import TrainingPlan

    return TrainingPlan(model, batch, dtype=dtype, optim=optim, backend=backend, arch=arch, cuda_graph=cuda_graph,
                        progress=progress)


__all__ = ["DType", "Graph", "Node", "Op", "Value", "compile", "compile_training", "generate", "load", "verify",
           "__version__"]
