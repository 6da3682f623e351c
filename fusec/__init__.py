"""fusec: a kernel-fusion compiler for transformer models."""

from __future__ import annotations

__version__ = "0.1.0"

from fusec.dtypes import DType
from fusec.ir import Graph, Node, Value, verify
from fusec.ops import Op

__all__ = ["DType", "Graph", "Node", "Op", "Value", "verify", "__version__"]
