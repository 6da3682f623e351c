"""The per-node context handed to each ONNX op handler, and the handler registry.

A handler is ``fn(cx: NodeCtx) -> list[Sym | None]`` (one entry per ONNX output, ``None`` for an
output it does not produce). Handlers know ONNX semantics; everything they create goes through
``cx.emit`` (fold-or-emit, see ``emit.py``), so a handler never decides itself whether to fold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx

from fusec.errors import ModelError
from fusec.frontend.emit import Const, Emitter, Sym
from fusec.frontend.onnx_load import LoadedModel
from fusec.ops import Op

Handler = Callable[["NodeCtx"], Sequence["Sym | None"]]
HANDLERS: dict[str, Handler] = {}


# Handlers of ops outside the default domain, by (domain, op type): com.microsoft's MatMulNBits.
DOMAIN_HANDLERS: dict[tuple[str, str], Handler] = {}


def domain_handler(domain: str, *op_types: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for t in op_types:
            DOMAIN_HANDLERS[(domain, t)] = fn
        return fn

    return register


def handler_of(domain: str, op_type: str) -> Handler | None:
    """The handler of ``op_type`` in ``domain`` ("" or "ai.onnx": the default domain), or None."""
    if domain in ("", "ai.onnx"):
        return HANDLERS.get(op_type)
    return DOMAIN_HANDLERS.get((domain, op_type))


def handler(*op_types: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for t in op_types:
            HANDLERS[t] = fn
        return fn

    return register


class NodeCtx:
    def __init__(self, em: Emitter, loaded: LoadedModel, node: onnx.NodeProto, ins: list[Sym | None],
                 opset: int, used: set[str]):
        self.em = em
        self.loaded = loaded
        self.node = node
        self.ins = ins
        self.opset = opset
        self._used = used
        self._attrs = {a.name: a for a in node.attribute}

    # ---- messages -------------------------------------------------------------------------
    def fail(self, msg: str) -> ModelError:
        """A one-line ModelError naming the model, the node (repr: names may hold anything)."""
        return ModelError(f"{self.em.label}: node {self.node.name!r} ({self.node.op_type}): {msg}")

    # ---- inputs ---------------------------------------------------------------------------
    def has(self, i: int) -> bool:
        return i < len(self.ins) and self.ins[i] is not None

    def x(self, i: int) -> Sym:
        s = self.ins[i] if i < len(self.ins) else None
        if s is None:
            raise self.fail(f"required input {i} is missing")
        return s

    def const(self, i: int, default: Any = None) -> np.ndarray | None:
        """Input ``i`` as a numpy array; it must be known at import time (it decides a shape)."""
        if not self.has(i):
            return None if default is None else np.asarray(default)
        s = self.ins[i]
        if not isinstance(s, Const) and s is not None and 0 in s.shape:
            return np.zeros(s.shape, s.dtype.np)  # an empty tensor's value is known from its type
        if not isinstance(s, Const):
            raise self.fail(f"input {i} ({self.node.input[i]!r}) depends on run-time data, but it decides "
                            "a shape or an attribute and fusec compiles static shapes")
        return s.array

    def ints(self, i: int) -> list[int] | None:
        a = self.const(i)
        return None if a is None else [int(v) for v in np.asarray(a).reshape(-1)]

    def used(self, out_index: int) -> bool:
        return out_index < len(self.node.output) and self.node.output[out_index] in self._used

    # ---- attributes -----------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        a = self._attrs.get(name)
        if a is None:
            return default
        if a.type == onnx.AttributeProto.TENSOR:
            return self.loaded.to_array(a.t, a.t.name or f"{self.node.name}.{name}")
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            return v.decode("utf-8", errors="replace")
        if isinstance(v, list):
            return [x.decode("utf-8", errors="replace") if isinstance(x, bytes) else x for x in v]
        return v

    def axis(self, ax: int, rank: int, what: str = "axis") -> int:
        """Normalize an ONNX axis in [-rank, rank) to [0, rank)."""
        if not -rank <= ax < rank:
            raise self.fail(f"{what} {ax} out of range for rank {rank}")
        return ax + rank if ax < 0 else ax

    # ---- emitting -------------------------------------------------------------------------
    def emit(self, op: Op, *inputs: Sym, final: bool = False, name: str | None = None, **attrs: Any) -> Sym:
        """Fold or emit ``op``; ``final=True`` names the result after the node's first output."""
        if final and name is None:
            name = self.node.output[0] if self.node.output else None
        try:
            return self.em.op(op, inputs, name=name, node_name=self.node.name or self.node.op_type, **attrs)
        except (ValueError, TypeError) as e:  # an attrs record refused a value from the file
            raise self.fail(f"{op.value}: {e}") from None
