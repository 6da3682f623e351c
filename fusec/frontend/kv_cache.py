"""ONNX decoders exported with a KV cache -> fusec's prefill and decode generation graphs.

Entry point: ``onnx_generation_model(path) -> (config, builder)`` (``fusec.genmodel`` wraps them;
the ``builder`` makes the graphs). The file must look like an Optimum / ``torch.onnx`` export of a causal LM with a cache:

- inputs ``input_ids`` [batch, seq], ``attention_mask`` [batch, past + seq], ``position_ids``
  [batch, seq] and, per layer i, ``past_key_values.i.key`` / ``past_key_values.i.value``
  [batch, kv_heads, past, head_dim] (heads and head_dim static, past symbolic);
- outputs ``logits`` [batch, seq, vocab] and ``present.i.key`` / ``present.i.value``, each the
  ``Concat(past, new, axis=2)`` that appends the step's keys/values to the cache.

The file is imported twice with static shapes and each import is rebuilt into the generation form
of ``models/generate.py`` (the same states ``k.i``/``v.i`` [B, Hkv, T, D], ``pos``, ``cur``,
``done``, ``tokens``, the sampling settings, the same updates and ``meta["generation"]``; the sampling tail is
``models.generate.finish_step``):

- **prefill** (inputs ``input_ids`` [B, S] and ``lengths`` [B], 0 for a row not admitted; past
  length 0: the past inputs become empty constants, so the importer drops the concats and
  ``present.i.*`` is the step's new K/V): each layer's new K/V is written at position 0 by
  ``cache_write`` (T for a row not admitted: dropped); ``attention_mask[b, j] = j < lengths[b]``
  and ``position_ids = arange(S)`` are computed in the graph; the hidden state of each row's last
  real token (row ``b*S + lengths[b] - 1``) goes through the LM head.
- **decode** (no inputs; past length T - 1, so that past + 1 = T, the cache length): ``input_ids``
  is ``cur``, ``position_ids`` is ``pos``, ``attention_mask[b, j] = j <= pos[b]`` over T; each
  ``Concat(past, new)`` becomes ``cache_write(state, new, pos)`` and whatever read the concat reads
  the written cache: attention runs over all T positions, the mask hiding keys after ``pos``.

The ``present.*`` outputs are dropped (they are the state updates) and so is ``logits``. Anything
else (no past inputs, a cache layout other than [B, H, past, D], names that do not pair up, a
present that is not a concat of its past) is a one-line ``ModelError`` naming the input or node.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from fusec.dtypes import DType
from fusec.errors import ModelError
from fusec.frontend.kv_attention import use_kv_attention
from fusec.frontend.onnx_import import _check_opsets, _check_supported, _Importer
from fusec.frontend.onnx_load import ONNX_TO_DTYPE, LoadedModel, load_model, onnx_type_name
from fusec.ir import Graph, Node, Value
from fusec.ops import Op

_PAST = re.compile(r"past_key_values\.(\d+)\.(key|value)")
_PRESENT = re.compile(r"present\.(\d+)\.(key|value)")
_INT = (DType.I64, DType.I32)


@dataclasses.dataclass(frozen=True)
class OnnxDecoderConfig:
    """What the generation code reads of a model config, taken from the ONNX graph."""

    name: str
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_dtype: DType
    logits: str  # the logits output's name
    family: str = "onnx"


def onnx_generation_model(path: str | os.PathLike[str]) -> tuple[Any, Any]:
    """(config, builder) of an ONNX decoder exported with a KV cache (see the module docstring):
    ``builder(shape, eos_ids)`` makes the prefill and decode graphs. ``fusec.genmodel`` wraps
    them into its ``GenModel`` (no tokenizer: token ids only); this frontend imports nothing of
    the generation-model loader."""
    text = os.fspath(path)
    loaded = load_model(text)  # ModelError: missing, unreadable, fails the checker
    opset = _check_opsets(loaded)
    _check_supported(loaded, opset)
    cfg = _probe(loaded, Path(text).stem)

    def builder(shape: Any, eos_ids: tuple[int, ...]) -> dict[str, Graph]:
        return build_onnx_generation(loaded, opset, cfg, shape, eos_ids)

    return cfg, builder


# ---- what the file declares -------------------------------------------------------------------

def _dims(vi: onnx.ValueInfoProto) -> list[int | str] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim]


def _probe(loaded: LoadedModel, name: str) -> OnnxDecoderConfig:
    label, g = loaded.label, loaded.model.graph
    inits = {t.name for t in g.initializer}
    inputs = {vi.name: vi for vi in g.input if vi.name not in inits}
    outputs = {vi.name: vi for vi in g.output}
    past = {n: _PAST.fullmatch(n) for n in inputs}
    past = {n: m for n, m in past.items() if m}
    if not past:
        raise ModelError(f"{label} has no past_key_values.* inputs: generation needs a decoder exported with a "
                         f"KV cache (inputs: {', '.join(repr(n) for n in inputs) or 'none'})")
    for need in ("input_ids", "attention_mask", "position_ids"):
        if need not in inputs:
            raise ModelError(f"{label}: a decoder exported with a KV cache must take {need!r} "
                             f"(inputs: {', '.join(repr(n) for n in inputs)})")
    other = [n for n in inputs if n not in past and n not in ("input_ids", "attention_mask", "position_ids")]
    if other:
        raise ModelError(f"{label}: input {other[0]!r} is not one a KV-cache decoder takes "
                         f"(input_ids, attention_mask, position_ids, past_key_values.<layer>.key/value)")
    layers = 1 + max(int(m.group(1)) for m in past.values())
    cache: tuple[int, int] | None = None
    cache_dt: int | None = None
    for i in range(layers):
        for kv in ("key", "value"):
            pin, pout = f"past_key_values.{i}.{kv}", f"present.{i}.{kv}"
            if pin not in inputs:
                raise ModelError(f"{label}: input {pin!r} is missing (the past inputs must pair up per layer, "
                                 f"0..{layers - 1}, key and value)")
            if pout not in outputs:
                raise ModelError(f"{label}: input {pin!r} has no matching output {pout!r}")
            dims = _dims(inputs[pin])
            ok = (dims is not None and len(dims) == 4 and isinstance(dims[1], int) and isinstance(dims[3], int)
                  and dims[1] > 0 and dims[3] > 0 and not isinstance(dims[2], int))
            if not ok:
                shown = "unknown" if dims is None else "[" + ", ".join(map(str, dims)) + "]"
                raise ModelError(f"{label}: input {pin!r} has shape {shown}; fusec needs the cache as [batch, "
                                 f"kv_heads, past, head_dim] (heads and head_dim fixed, past length symbolic)")
            heads, head_dim = int(dims[1]), int(dims[3])  # type: ignore[index]
            if cache is not None and (heads, head_dim) != cache:
                raise ModelError(f"{label}: input {pin!r} has {heads} heads of {head_dim}, the other caches "
                                 f"{cache[0]} of {cache[1]}")
            cache = (heads, head_dim)
            et = inputs[pin].type.tensor_type.elem_type
            if et not in ONNX_TO_DTYPE or not ONNX_TO_DTYPE[et].is_float:
                raise ModelError(f"{label}: input {pin!r} has dtype {onnx_type_name(et)}; caches must be float")
            cache_dt = et
    extra = [n for n in outputs if _PRESENT.fullmatch(n) and f"past_key_values.{n[len('present.'):]}" not in inputs]
    if extra:
        raise ModelError(f"{label}: output {extra[0]!r} has no matching input 'past_key_values.{extra[0][8:]}'")
    for n in ("input_ids", "position_ids"):
        et = inputs[n].type.tensor_type.elem_type
        if ONNX_TO_DTYPE.get(et) not in _INT:
            raise ModelError(f"{label}: input {n!r} has dtype {onnx_type_name(et)}, not int64 or int32")
    rest = [n for n in outputs if not _PRESENT.fullmatch(n)]
    logits = "logits" if "logits" in outputs else (rest[0] if len(rest) == 1 else None)
    if logits is None:
        raise ModelError(f"{label}: no 'logits' output (outputs: {', '.join(repr(n) for n in outputs)})")
    dims = _dims(outputs[logits])
    if not dims or len(dims) != 3 or not isinstance(dims[2], int) or dims[2] < 1:
        shown = "unknown" if dims is None else "[" + ", ".join(map(str, dims)) + "]"
        raise ModelError(f"{label}: output {logits!r} has shape {shown}; fusec needs [batch, seq, vocab] "
                         f"with a fixed vocabulary size")
    assert cache is not None and cache_dt is not None
    return OnnxDecoderConfig(name=name, vocab_size=int(dims[2]), num_layers=layers, num_kv_heads=cache[0],
                             head_dim=cache[1], cache_dtype=ONNX_TO_DTYPE[cache_dt], logits=logits)


# ---- the two imports ----------------------------------------------------------------------------

def _past_names(cfg: OnnxDecoderConfig) -> list[tuple[str, str]]:
    return [(f"past_key_values.{i}.{kv}", f"present.{i}.{kv}")
            for i in range(cfg.num_layers) for kv in ("key", "value")]


def _import(loaded: LoadedModel, opset: int, cfg: OnnxDecoderConfig, batch: int, seq: int, past: int) -> Graph:
    """The file with static shapes; past length 0 makes the past inputs empty constants."""
    total = past + seq
    shapes: dict[str, tuple[int, ...]] = {"input_ids": (batch, seq), "attention_mask": (batch, total),
                                          "position_ids": (batch, seq)}
    g = loaded.model.graph
    empty = []
    for pin, _ in _past_names(cfg):
        if past:
            shapes[pin] = (batch, cfg.num_kv_heads, past, cfg.head_dim)
        else:
            arr = np.zeros((batch, cfg.num_kv_heads, 0, cfg.head_dim), cfg.cache_dtype.np)
            empty.append(numpy_helper.from_array(arr, pin))
    g.initializer.extend(empty)  # initializers shadow the inputs of the same name (removed below)
    try:
        return _Importer(loaded, opset).run(shapes)
    finally:
        if empty:
            del g.initializer[len(g.initializer) - len(empty):]


def build_onnx_generation(loaded: LoadedModel, opset: int, cfg: OnnxDecoderConfig, shape: Any,
                          eos_ids: tuple[int, ...]) -> dict[str, Graph]:
    """{"prefill": Graph, "decode": Graph} in models/generate.py's form (see the module docstring)."""
    from fusec.errors import InputError

    if any(not 0 <= e < cfg.vocab_size for e in eos_ids):
        raise InputError(f"end-of-sequence ids {list(eos_ids)} must lie within the vocabulary ({cfg.vocab_size})")
    b, s, t = shape.batch, shape.prefill_len, shape.max_seq_len
    if t < 2:
        raise InputError(f"--max-seq-len must be at least 2 to generate from {loaded.label}, got {t}")
    prefill = _Rewrite(loaded.label, cfg, shape, eos_ids, True).run(_import(loaded, opset, cfg, b, s, 0))
    decode = _Rewrite(loaded.label, cfg, shape, eos_ids, False).run(_import(loaded, opset, cfg, b, 1, t - 1))
    decode = use_kv_attention(decode)
    return {"prefill": prefill, "decode": decode}


# ---- the rewrite into generation form -----------------------------------------------------------

def _peel(v: Value, producers: dict[Value, Node]) -> Value:
    """The value an output aliases (the importer copies an aliased output with a same-shape reshape)."""
    n = producers.get(v)
    while n is not None and n.op == Op.RESHAPE and n.inputs[0].shape == v.shape:
        v = n.inputs[0]
        n = producers.get(v)
    return v


class _Rewrite:
    def __init__(self, label: str, cfg: OnnxDecoderConfig, shape: Any, eos_ids: tuple[int, ...], prefill: bool):
        self.label, self.cfg, self.shape, self.eos_ids = label, cfg, shape, eos_ids
        self.prefill = prefill
        self.entry = "prefill" if prefill else "decode"

    def fail(self, msg: str) -> ModelError:
        return ModelError(f"{self.label} ({self.entry} import): {msg}")

    def run(self, g: Graph) -> Graph:
        from fusec.models.generate import _State, finish_step
        from fusec.models.layers import Blocks

        cfg, shape, prefill = self.cfg, self.shape, self.prefill
        bsz, t_max = shape.batch, shape.max_seq_len
        seq = shape.prefill_len if prefill else 1
        i64 = DType.I64
        m = Blocks(f"{cfg.name}.{self.entry}", None)  # type: ignore[arg-type]
        st = _State(m, cfg, shape)  # type: ignore[arg-type]
        producers, users = g.producers(), g.users()
        ins = {v.name: v for v in g.inputs}
        outs = {v.name: v for v in g.outputs}
        env: dict[Value, Value] = {}

        def cast(v: Value, dt: DType) -> Value:
            return v if v.dtype == dt else m.op(Op.CAST, v, to=dt)

        # user inputs: input_ids, attention_mask, position_ids
        if prefill:
            ids, length, write_at = st.prefill_inputs(seq)
            pos_col = m.op(Op.RESHAPE, length, shape=(bsz, 1))
            cols = m.b.const(np.arange(seq, dtype=np.int64)[None, :], name="columns")
            keep = m.op(Op.LESS, cols, pos_col)  # j < length[b]: right-padded prompts
            positions = m.b.const(np.tile(np.arange(seq, dtype=np.int64), (bsz, 1)), name="position_ids")
        else:
            pos_col = m.op(Op.RESHAPE, st.pos, shape=(bsz, 1))
            ids = m.op(Op.RESHAPE, st.cur, shape=(bsz, 1))
            cols = m.b.const(np.arange(t_max, dtype=np.int64)[None, :], name="columns")
            keep = m.op(Op.LESS_EQUAL, cols, pos_col)  # j <= pos[b]: the cache up to the new token
            positions = pos_col
        mask = ins["attention_mask"]
        env[ins["input_ids"]] = cast(ids, ins["input_ids"].dtype)
        env[mask] = keep if mask.dtype == DType.BOOL else cast(keep, mask.dtype)
        env[ins["position_ids"]] = cast(positions, ins["position_ids"].dtype)

        # the caches: which node appends to which state, and what the step's new K/V is
        states = {f"past_key_values.{i}.{kv}": st.caches[i][j] for i in range(cfg.num_layers)
                  for j, kv in enumerate(("key", "value"))}
        concat_of: dict[Node, str] = {}  # decode: Concat(past, new) -> its past input's name
        new_kv: dict[str, Value] = {}  # prefill: the step's new K/V per past name
        for pin, pout in _past_names(cfg):
            present = _peel(outs[pout], producers)
            node = producers.get(present)
            want = (bsz, cfg.num_kv_heads, seq, cfg.head_dim)
            if prefill:
                if node is not None and node.op == Op.CONCAT and len(node.inputs) == 2 \
                        and node.inputs[0].is_const and node.inputs[0].numel == 0:
                    present = node.inputs[1]  # (the importer usually drops the empty part itself)
                if present.shape != want:
                    raise self.fail(f"output {pout!r} is not Concat({pin!r}, new, axis=2): with an empty past "
                                    f"it is {present.type_str}, not the new keys/values "
                                    f"[{', '.join(map(str, want))}]")
                new_kv[pin] = present
                continue
            past = ins[pin]
            if node is None or node.op != Op.CONCAT or len(node.inputs) != 2 or node.attrs.axis != 2 \
                    or node.inputs[0] is not past:
                what = "an input" if node is None else f"node {node.describe()}"
                raise self.fail(f"output {pout!r} comes from {what}, not Concat({pin!r}, new, axis=2): "
                                f"fusec needs the cache appended along the past axis")
            if node.inputs[1].shape != want:
                raise self.fail(f"node {node.describe()} appends {node.inputs[1].type_str} to {pin!r}; expected "
                                f"one step [{', '.join(map(str, want))}]")
            readers = [n for n in users.get(past, []) if n is not node]
            if readers:
                raise self.fail(f"node {readers[0].describe()} reads {pin!r} other than by appending to it")
            concat_of[node] = pin

        # logits: find the LM head's MatMul, so that only the rows that are sampled go through it
        logits_v = _peel(outs[cfg.logits], producers)
        head = producers.get(logits_v)
        hidden_in = None
        if head is not None and head.op == Op.MATMUL and len(head.inputs[0].shape) == 3 \
                and len(head.inputs[1].shape) == 2 and logits_v.shape == (bsz, seq, cfg.vocab_size) \
                and len(users.get(logits_v, [])) <= 1:
            hidden_in = head.inputs[0]
        elif logits_v.shape != (bsz, seq, cfg.vocab_size):
            raise self.fail(f"output {cfg.logits!r} is {logits_v.type_str}, expected "
                            f"[{bsz}, {seq}, {cfg.vocab_size}]")

        def last_rows(x: Value) -> Value:
            """[B, S, N] -> [B, N]: row b's last real token (prefill) or the one step (decode)."""
            n = x.shape[-1]
            flat = m.op(Op.RESHAPE, x, shape=(bsz * seq, n))
            if not prefill:
                return flat
            starts = m.b.const(np.arange(bsz, dtype=np.int64) * seq - 1, name="row_starts")
            return m.op(Op.GATHER, flat, m.op(Op.ADD, starts, length), axis=0)

        # only what the logits and the caches need, in the file's order
        roots: set[Value] = {logits_v, *new_kv.values()} | {n.outputs[0] for n in concat_of}
        live = _live(g.nodes, roots)
        const_map: dict[Value, Value] = {}

        def get(v: Value) -> Value:
            if v in env:
                return env[v]
            if v.is_const:
                if v not in const_map:
                    const_map[v] = m.b.const(v.data, name=v.name)
                return const_map[v]
            if v in ins.values():  # a past input read by anything but its concat (checked above)
                raise self.fail(f"input {v.name!r} is read where fusec cannot follow it")
            raise self.fail(f"value {v.name!r} is used before it is defined")

        new_caches: dict[str, Value] = {}
        logits: Value | None = None
        for n in g.nodes:
            if n not in live:
                continue
            if n in concat_of:
                pin = concat_of[n]
                state = states[pin]
                new = cast(get(n.inputs[1]), state.dtype)
                cw = m.op(Op.CACHE_WRITE, state, new, st.pos, axis=2)
                new_caches[pin] = cw
                env[n.outputs[0]] = cast(cw, n.outputs[0].dtype)
                continue
            if n is head and hidden_in is not None:
                logits = m.b.emit(n.op, last_rows(get(hidden_in)), get(n.inputs[1]), name="logits",
                                  node_name=n.name, attrs_record=n.attrs)
                continue
            got = m.b.emit(n.op, *(get(v) for v in n.inputs), name=n.outputs[0].name, node_name=n.name,
                           attrs_record=n.attrs)
            for o, v in zip(n.outputs, got if isinstance(got, tuple) else (got,)):
                env[o] = v
        if logits is None:
            logits = last_rows(get(logits_v))
        if prefill:
            for pin in new_kv:
                state = states[pin]
                new_caches[pin] = m.op(Op.CACHE_WRITE, state, cast(get(new_kv[pin]), state.dtype), write_at, axis=2)
            counter = length  # the new token's position
        else:
            counter = m.op(Op.ADD, st.pos, m.scalar(1, i64))
        pairs = [(new_caches[f"past_key_values.{i}.key"], new_caches[f"past_key_values.{i}.value"])
                 for i in range(cfg.num_layers)]
        if not logits.dtype.is_float:
            raise self.fail(f"output {cfg.logits!r} is {logits.type_str}, not floating point")
        return finish_step(m, st, logits, counter, pairs, shape, self.eos_ids, prefill)


def _live(nodes: list[Node], roots: set[Value]) -> set[Node]:
    need = set(roots)
    keep: set[Node] = set()
    for n in reversed(nodes):
        if any(o in need for o in n.outputs):
            keep.add(n)
            need.update(n.inputs)
    return keep
