"""One entry point from "what the user named" to a verified Graph: a built-in model name or an
ONNX file (path or in-memory ModelProto), with optional static input shapes.

Built-in names win over files of the same name in the working directory, so that
``fusec run gpt2-tiny`` means the same thing wherever it is typed; write ``./gpt2-tiny`` to mean
the file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from fusec.errors import InputError, ModelError
from fusec.ir import Graph

if TYPE_CHECKING:
    import onnx


def builtin_names() -> list[str]:
    """The built-in model names (``fusec.models.names()``)."""
    import fusec.models

    names = getattr(fusec.models, "names", None)
    # Until the model zoo lands, fusec.models is an empty package: no built-ins yet.
    return list(names()) if names is not None else []


def load_graph(model: str | os.PathLike[str] | onnx.ModelProto | Graph,
               shapes: Mapping[str, Sequence[int]] | None = None, storage: str | None = None) -> Graph:
    """Load ``model`` as a Graph; ``shapes`` fixes input shapes by input name. ``storage``
    ("f16"/"bf16"): a built-in or GGUF model's large weights are held in that dtype, each read
    through a CAST to fp32 (``fusec.models.weights.StoredWeights``; a compile passes its storage
    dtype so that the fp32 copy of the weights is never held).

    Raises ModelError when the model cannot be found or read, InputError when ``shapes`` does not
    fit the model (unknown input name, wrong rank, different dims).
    """
    from fusec.shapes import normalize_shapes

    # (1.5, 16) is an error, not (1, 16); a 0 dim only where an ONNX model fixes it (the importer checks)
    shapes = normalize_shapes(shapes, allow_zero=True) if shapes else None
    if isinstance(model, Graph):  # already built (e.g. by fusec.models.build with real weights)
        from fusec.ir import verify

        verify(model)
        graph = model
    elif isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        names = builtin_names() if isinstance(model, str) else []
        if text in names:
            import fusec.models

            graph = fusec.models.build(text, shapes=normalize_shapes(shapes) if shapes else None, storage=storage)
        else:
            graph = _import_file(text, names, shapes, storage)
    else:
        from fusec.frontend.onnx_import import import_onnx

        graph = import_onnx(model, shapes)
    if shapes:
        check_shapes_fit(graph, shapes)
    return graph


def _import_file(path: str, names: list[str], shapes: dict[str, tuple[int, ...]] | None,
                 storage: str | None = None) -> Graph:
    from fusec.hubcache import is_hub_id

    if is_hub_id(path):  # org/name: the local Hugging Face cache's copy (a GGUF file; a checkpoint generates)
        from fusec.hubcache import model_path

        found = model_path(path)
        if os.path.isdir(found):
            raise ModelError(f"{path!r} is a Hugging Face checkpoint ({found!r}): it runs as a decoder with "
                             f"`fusec generate {path}` or `fusec compile {path} --generate`")
        path = found
    if not os.path.exists(path):
        if path.endswith(".onnx") or os.sep in path or (os.altsep and os.altsep in path):
            raise ModelError(f"no such file: {path!r}")
        builtin = ", ".join(names) if names else "none"
        raise ModelError(f"no such file or built-in model {path!r} (built-in: {builtin})")
    if os.path.isdir(path):
        from fusec.train.tasks import TASK_FILE, build_trained

        if os.path.isfile(os.path.join(path, TASK_FILE)):  # a model `fusec train` wrote
            return build_trained(path, shapes)
        raise ModelError(f"{path!r} is a directory, not an ONNX file")
    if path.lower().endswith(".gguf"):
        from fusec.models.gguf import build_gguf
        from fusec.shapes import normalize_shapes

        return build_gguf(path, normalize_shapes(shapes) if shapes else None, storage)
    from fusec.frontend.onnx_import import import_onnx

    return import_onnx(path, shapes)


def check_shapes_fit(graph: Graph, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Every name in ``shapes`` is a graph input whose shape is the one asked for.

    The importer and the model builders apply ``shapes``; this re-checks the result so that a
    typo in ``--shapes`` is an error rather than silently ignored, whichever loader ran.
    """
    by_name = {v.name: v for v in graph.inputs}
    for name, shape in shapes.items():
        v = by_name.get(name)
        if v is None:
            takes = ", ".join(repr(n) for n in by_name) or "no inputs"
            raise InputError(f"--shapes names {name!r}, which is not an input of the model (it takes {takes})")
        if len(v.shape) != len(shape):
            raise InputError(f"--shapes gives input {name!r} rank {len(shape)} ({list(shape)}), "
                             f"but the model's input has rank {len(v.shape)}")
        if v.shape != shape:
            raise InputError(f"--shapes asks for input {name!r} as {list(shape)}, but the model fixes it at {list(v.shape)}")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, read in chunks (an ONNX file: its own bytes; external data files
    are not included)."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(16 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise ModelError(f"cannot read {os.fspath(path)!r}: {e.strerror or e}") from None
    return h.hexdigest()


def builtin_sha256(name: str) -> str:
    """sha256 of what defines a built-in model's graph: its name, its config and its weights
    (seeded random, seed 0): equal digests mean ``fusec.models.build(name)`` builds the same graph."""
    import dataclasses
    import hashlib
    import json

    import fusec.models

    cfg = dataclasses.asdict(fusec.models.get_config(name))
    text = json.dumps({"name": name, "config": cfg, "weights": "random, seed 0"}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def source_record(model: object, shapes: Mapping[str, Sequence[int]] | None,
                  options: Mapping[str, object] | None = None) -> dict[str, object]:
    """What a plan records about its source model: a digest, never a path. ``{"model": the
    built-in name or the file's base name (None in memory), "kind": builtin | file | memory,
    "sha256": builtin_sha256 / file_sha256 (None in memory), "shapes", "options": the compile
    options that change the graph}``; ``fusec.retarget.recompile(from_source=True)`` rebuilds
    the plan from it, checking the digest."""
    rec: dict[str, object] = {"model": None, "kind": "memory", "sha256": None}
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        if isinstance(model, str) and text in builtin_names():
            rec = {"model": text, "kind": "builtin", "sha256": builtin_sha256(text)}
        elif os.path.isfile(text):
            rec = {"model": os.path.basename(text), "kind": "file", "sha256": file_sha256(text)}
    rec["shapes"] = {k: [int(d) for d in v] for k, v in (shapes or {}).items()}
    opts = {k: (v if isinstance(v, (str, int, float)) else sorted(v) if not isinstance(v, Mapping) else dict(v))
            for k, v in (options or {}).items() if v}
    if opts:
        rec["options"] = opts
    return rec


def resolve_source(record: Mapping[str, object], where: str, model: str | os.PathLike[str] | None = None) -> str:
    """What to load to rebuild a plan's source model (``source_record``): the built-in name, or
    the file ``model`` (default: the recorded file name next to the plan ``where``), after
    checking its digest. FusecError naming the field when there is nothing that matches."""
    from fusec.errors import FusecError

    kind, digest, name = record.get("kind"), record.get("sha256"), record.get("model")
    if kind == "builtin":
        if str(name) not in builtin_names():
            raise FusecError(f"{where}: the plan was compiled from built-in model {name!r}, which this fusec "
                             "does not have")
        if builtin_sha256(str(name)) != digest:
            raise FusecError(f"{where}: built-in model {name!r} changed since the plan was compiled "
                             "(field 'source.sha256' differs)")
        return str(name)
    if kind == "file":
        path = os.fspath(model) if model is not None else os.path.join(os.path.dirname(os.path.abspath(where)),
                                                                         str(name))
        if not os.path.isfile(path):
            raise FusecError(f"{where}: the source model {name!r} is not at {path!r}; give its path")
        if file_sha256(path) != digest:
            raise FusecError(f"{where}: {path!r} is not the file the plan was compiled from "
                             "(its sha256 differs from field 'source.sha256')")
        return path
    raise FusecError(f"{where}: the plan records no source model to rebuild (field 'source.kind' is {kind!r})")
