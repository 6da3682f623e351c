"""``fusec models``: list the built-in models."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fusec.cli._common import add_command, add_json_flag


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "models", "list the built-in models",
        "List the built-in models: name, a one-line description and the default input shapes.\n"
        "Any of these names can stand for MODEL in the other commands; the weights are random\n"
        "(seeded) unless a model's builder is given a weights directory from Python. With --json,\n"
        "also what `fusec generate` accepts (decoder families, GGUF tensor types, RoPE scalings;\n"
        "`fusec generate --help` lists them too).",
        ["fusec models", "fusec models --json"])
    add_json_flag(p)
    return p


def _field(cfg: Any, *names: str) -> Any:
    for n in names:
        if isinstance(cfg, dict) and n in cfg:
            return cfg[n]
        if hasattr(cfg, n):
            return getattr(cfg, n)
    return None


def describe(name: str) -> dict[str, Any]:
    """Name, one-line description and default input shapes of a built-in model."""
    import fusec.models

    cfg = fusec.models.get_config(name)
    desc = _field(cfg, "description", "summary") or (type(cfg).__doc__ or "").strip().splitlines()[0:1]
    if isinstance(desc, list):
        desc = desc[0] if desc else ""
    shapes = _field(cfg, "default_shapes", "shapes") or {}
    return {"name": name, "description": " ".join(str(desc).split()),
            "default_shapes": {str(k): [int(d) for d in v] for k, v in dict(shapes).items()}}


def run(args: argparse.Namespace) -> int:
    from fusec.cli._common import fmt_name
    from fusec.loader import builtin_names
    from fusec.shapes import format_shape

    rows = [describe(n) for n in builtin_names()]
    if args.json:
        from fusec.genmodel import generation_support

        print(json.dumps({"models": rows, "generate": generation_support()}, indent=2))
        return 0
    if not rows:
        print("no built-in models in this build")
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        shapes = ",".join(f"{fmt_name(k)}:{format_shape(tuple(v))}" for k, v in r["default_shapes"].items())
        print(f"{r['name']:<{width}}  {r['description']}" + (f"  [{shapes}]" if shapes else ""))
    return 0
