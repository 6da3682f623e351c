"""What bounds a decode step. How much DRAM costs it: the step as compiled against the same plan with every layer's
launches reading the first layer's weights (redirected in its launch records), so that after the first layer they
come from L2, timed in turns in one process. The LM head (read once a step, larger than L2) is left as it is.
With ``--drop``, also what a layer kernel costs the step: the same plan without that kernel's launches in every
layer (``--drop 2``: a layer's third kernel; ``--drop 1+2``: its second and third; the layer's kernels are printed).
Those variants compute nothing meaningful (the kernels after a dropped one read what it left); they bound what
fusing the kernel away (its launch, its boundary, its latency) could win, its bytes included.

The difference is the most that overlapping the weights' DRAM traffic with the step's latency-bound phases (the
attention, the kernel boundaries, the products' ramps; e.g. an L2 prefetch of the next kernels' weights) could win;
the hot step's time is what is left when the layers' weights cost no DRAM time at all. The tokens differ (other
weights); both variants run the same kernels, grids and launches. CUDA only.

    python benchmarks/l2_bound.py OUT_DIR [--model qwen3-0.6b] [--batches 1,8] [--context 128] [--steps 64]
                                          [--windows 6] [--drop 2,1,1+2]

Writes OUT_DIR/l2_bound.json and prints, a batch, its record (JSON) and a line of each variant's ms a step and its
difference from the plan as compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step import _engine, _window_ms, model  # noqa: E402


def hot_weights(manifest: dict[str, Any], entry: str = "decode") -> int:
    """Point every launch of ``entry`` that runs a kernel an earlier launch ran at that first launch's weight
    arguments (a layer's launches at the first layer's weights: the same kernels, shapes and argument order).
    Returns the weight bytes a step no longer reads from distinct places: the launches redirected count their
    weight arguments' spans up to the next weight offset (an upper bound per argument, from the weights layout)."""
    launches = manifest["entries"][entry]["launches"]
    first: dict[int, list[Any]] = {}
    offsets = sorted({a[2] for L in launches for a in L.get("args", ()) if a[:2] == ["ptr", "weights"]})
    end = int(manifest["memory"]["weights_bytes"])
    span = {o: (offsets[i + 1] if i + 1 < len(offsets) else end) - o for i, o in enumerate(offsets)}
    saved = 0
    for L in launches:
        if L.get("type") != "kernel":
            continue
        ref = first.setdefault(int(L["kernel"]), L["args"])
        if ref is L["args"]:
            continue
        new = []
        for a, r in zip(L["args"], ref):
            if a[:2] == ["ptr", "weights"] and r[:2] == ["ptr", "weights"]:
                saved += span[a[2]]
                new.append(list(r))
            else:
                new.append(a)
        L["args"] = new
    return saved


def layer_kernels(manifest: dict[str, Any], entry: str = "decode") -> list[tuple[int, str]]:
    """A layer's kernels in launch order, (kernel index, label): the launches from the first one of a kernel the
    entry launches once a layer up to its next launch."""
    launches = [L for L in manifest["entries"][entry]["launches"] if L.get("type") == "kernel"]
    ids = [int(L["kernel"]) for L in launches]
    layers = int(manifest["generation"]["num_layers"])
    i0 = next(i for i, k in enumerate(ids) if ids.count(k) == layers)
    i1 = ids.index(ids[i0], i0 + 1)
    return [(ids[i], str(launches[i].get("label", ""))) for i in range(i0, i1)]


def drop_layer_kernels(manifest: dict[str, Any], positions: list[int], entry: str = "decode") -> int:
    """Remove every launch of the kernels at ``positions`` of a layer (``layer_kernels``) from ``entry``; returns
    how many launches went. A kernel the layer launches more than once is refused unless every position of it is
    named (the drop takes them all)."""
    ids = [k for k, _ in layer_kernels(manifest, entry)]
    gone = {ids[p] for p in positions}
    if any(k in gone and p not in positions for p, k in enumerate(ids)):
        raise SystemExit(f"a layer launches one of the kernels at {positions} at other positions too ({ids}): name "
                         "them all")
    launches = manifest["entries"][entry]["launches"]
    kept = [L for L in launches if not (L.get("type") == "kernel" and int(L["kernel"]) in gone)]
    manifest["entries"][entry]["launches"] = kept
    return len(launches) - len(kept)


def main() -> int:
    import cupy as cp

    from fusec.compiler import compile_generation

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--drop", default="", help="comma-separated variants, each a '+'-joined list of positions in a "
                    "layer's kernels (0-based) whose launches the variant drops from every layer")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gm = model(args.model)
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    results: dict[str, Any] = {"model": args.model, "context": args.context, "device": device, "runs": []}
    tmp = tempfile.mkdtemp()
    for batch in map(int, args.batches.split(",")):
        path = os.path.join(tmp, f"b{batch}.fplan")
        plan = compile_generation(gm, batch=batch, max_seq_len=args.context + args.steps + 16, prefill_len=args.context,
                                  dtype="bf16", eos_ids=[])
        plan.save(path)
        weights = int(plan.manifest["memory"]["weights_bytes"])
        del plan
        saved: list[int] = []
        engines = {"as compiled": _engine(path, True, batch, warm=True),
                   "layers' weights in L2": _engine(path, True, batch, warm=True,
                                                    edit=lambda m, s=saved: s.append(hot_weights(m)))}
        if args.drop:
            layer = layer_kernels(engines["as compiled"][0].manifest)
            print("a layer's kernels:", "; ".join(f"{i}: {label}" for i, (_, label) in enumerate(layer)), flush=True)
        for variant in filter(None, args.drop.split(",")):
            pos = [int(p) for p in variant.split("+")]
            engines["without " + " + ".join(layer[p][1] for p in pos)] = _engine(
                path, True, batch, warm=True, edit=lambda m, pos=pos: drop_layer_kernels(m, pos))
        times: dict[str, list[float]] = {k: [] for k in engines}
        names = list(engines)
        for w in range(args.windows):  # in turns, each window starting from another variant
            for name in names[w % len(names):] + names[:w % len(names)]:
                _, eng, start = engines[name]
                times[name].append(_window_ms(eng, start, args.steps))
        rec = {"batch": batch, "weights_bytes": weights, "redirected_bytes": saved[0],
               **{k: {"step_ms": statistics.median(v), "all": v} for k, v in times.items()}}
        rec["dram_share_ms"] = rec["as compiled"]["step_ms"] - rec["layers' weights in L2"]["step_ms"]
        rec["dropped_saves_ms"] = {k: rec["as compiled"]["step_ms"] - rec[k]["step_ms"] for k in names[2:]}
        results["runs"].append(rec)
        print(json.dumps({k: v for k, v in rec.items()}, default=str), flush=True)
        base = rec["as compiled"]["step_ms"]
        print(f"batch {batch}: " + "; ".join(
            f"{k} {rec[k]['step_ms']:.4f} ms" + ("" if k == names[0] else f" ({rec[k]['step_ms'] - base:+.4f})")
            for k in names), flush=True)
        engines.clear()
        (out / "l2_bound.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
