"""Model inputs and outputs on the host: random inputs that are valid for a model, and the
``.npz`` files ``fusec run --inputs/--save-outputs`` read and write (never pickles).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from fusec.dtypes import DType
from fusec.errors import InputError
from fusec.fsutil import atomic_write
from fusec.ir import Graph, Value
from fusec.ops import Op
from fusec.reference import check_inputs

# Ops through which an integer input keeps its meaning as an index (token ids cast to i32, an
# unsqueeze/reshape, a transpose or broadcast) before it reaches a gather.
_INDEX_PRESERVING = frozenset({Op.CAST, Op.RESHAPE, Op.TRANSPOSE, Op.EXPAND, Op.SLICE, Op.TILE})


def index_bound(graph: Graph, value: Value) -> int | None:
    """The smallest gather data dim that ``value`` (through casts/reshapes) indexes, or None.

    A token id must be valid for every table it indexes, so the minimum over all of them.
    """
    users = graph.users()
    bound: int | None = None
    stack, seen = [value], {value}
    while stack:
        v = stack.pop()
        for node in users.get(v, []):
            if node.op == Op.GATHER and len(node.inputs) == 2 and node.inputs[1] is v:
                dim = node.inputs[0].shape[node.attrs.axis]
                bound = dim if bound is None else min(bound, dim)
            elif node.op in _INDEX_PRESERVING and node.inputs[0] is v:
                out = node.outputs[0]
                if out.dtype.is_int and out not in seen:
                    seen.add(out)
                    stack.append(out)
    return bound


def input_signature(graph: Graph) -> list[dict[str, Any]]:
    """Each graph input as {"name", "shape", "dtype", "bound"}; ``bound`` is the index bound of
    integer inputs used as gather indices (None otherwise). Plans store this signature, so that
    random inputs for a compiled plan follow the same rules as for its graph."""
    return [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype.value,
             "bound": index_bound(graph, v) if v.dtype.is_int else None} for v in graph.inputs]


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs (per ``seed``) that are valid for ``graph``; see ``random_inputs_for``."""
    return random_inputs_for(input_signature(graph), seed)


def random_inputs_for(signature: list[dict[str, Any]], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs (per ``seed``) for a signature as made by ``input_signature``.

    Integer inputs used as gather indices get ids uniform in [0, table size); other integer
    inputs (attention masks, say) get ones, so that nothing is masked out; floats are standard
    normal; bools are True.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for sig in signature:
        dt, shape = DType(sig["dtype"]), tuple(sig["shape"])
        if dt.is_float:
            arr = rng.standard_normal(shape, dtype=np.float32).astype(dt.np)
        elif dt.is_int:
            bound = sig.get("bound")
            if bound is not None and bound > 0:
                arr = rng.integers(0, bound, size=shape, dtype=dt.np)
            else:
                arr = np.ones(shape, dtype=dt.np)
        elif dt == DType.BOOL:
            arr = np.ones(shape, dtype=np.bool_)
        else:  # a new DType must decide what a valid random input is
            raise NotImplementedError(f"random_inputs: no rule for dtype {dt.value}")
        out[sig["name"]] = arr
    return out


def load_inputs_npz(path: str | os.PathLike[str], graph: Graph) -> dict[str, np.ndarray]:
    """Read the inputs of ``graph`` from an ``.npz`` file, keyed by input name.

    Raises InputError naming the file when it cannot be read (missing, not an npz, holds pickled
    objects), and naming the input when one is missing, extra, or of the wrong dtype or shape.
    """
    where = repr(os.fspath(path))
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except FileNotFoundError:
        raise InputError(f"inputs file {where} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"inputs file {where} is a directory") from None
    except OSError as e:
        raise InputError(f"cannot read inputs file {where}: {e.strerror or e}") from None
    # Check the magic first: numpy reports any non-npy/npz file as "pickled data".
    if magic.startswith(b"\x93NUMPY"):
        raise InputError(f"inputs file {where} is a single .npy array, not an .npz archive of named inputs")
    if not magic.startswith(b"PK"):
        raise InputError(f"inputs file {where} is not an .npz file (save inputs with np.savez)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except ValueError as e:
        if "pickle" in str(e):
            raise InputError(f"inputs file {where} holds pickled objects, which fusec does not load; "
                             "save plain numeric arrays (np.savez)") from None
        raise InputError(f"inputs file {where} is not a readable .npz file ({_one_line(e)})") from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise InputError(f"inputs file {where} is not a readable .npz file ({_one_line(e)})") from None
    # bf16 has no numpy dtype of its own; np.savez stores ml_dtypes.bfloat16 arrays as raw 2-byte voids
    for v in graph.inputs:
        arr = arrays.get(v.name)
        if v.dtype == DType.BF16 and arr is not None and arr.dtype == np.dtype("V2"):
            arrays[v.name] = arr.view(DType.BF16.np)
    try:
        return check_inputs(graph, arrays)
    except InputError as e:
        raise InputError(f"inputs file {where}: {e}") from None


def save_outputs_npz(path: str | os.PathLike[str], outputs: Mapping[str, np.ndarray]) -> None:
    """Write ``outputs`` to ``path`` as an ``.npz`` keyed by output name, atomically.

    The archive is written to a temporary file in the same directory and renamed over ``path``,
    so a reader never sees a half-written file. Written member by member (not ``np.savez(**kw)``)
    because an output may be named anything, including ``file``.
    """
    target = os.fspath(path)
    try:
        with atomic_write(target) as f, zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for name, arr in outputs.items():
                with zf.open(name + ".npy", "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, np.asarray(arr), allow_pickle=False)
    except OSError as e:
        raise InputError(f"cannot write outputs file {target!r}: {e.strerror or e}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
