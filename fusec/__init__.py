"""fusec: a kernel-fusion compiler for transformer models."""

from __future__ import annotations

__version__ = "0.1.0"

from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op


def compile(model, shapes=None, dtype="fp16", cuda_graph=False, arch=None, **kw):  # noqa: A001
    """Compile a model into a runnable ``Plan``; see ``fusec.compiler.compile``."""
    from fusec.compiler import compile as _compile

    return _compile(model, shapes=shapes, dtype=dtype, cuda_graph=cuda_graph, arch=arch, **kw)


def load(path, recompile=False, cuda_graph=None):
    """Load and validate a ``.fplan`` file; see ``fusec.plan.Plan.load``."""
    from fusec.plan import Plan

    return Plan.load(path, recompile=recompile, cuda_graph=cuda_graph)


__all__ = ["DType", "Graph", "Node", "Op", "Value", "compile", "load", "verify", "__version__"]
