"""Issue 12: tiny Gemma-2 in fp32 gives non-finite logits on the GPU (fp16 passes; every fp32
attention variant alike). Which launch goes wrong first, and which compile variants avoid it.

    python benchmarks/bisect_gemma2.py OUT.json [--cpu] [--exporter legacy|dynamo] [--variant NAME ...]

The model and inputs are exactly tests/test_families_llm.py's GPU test (tests/llm_families.py:
export_case("gemma2", exporter); its inputs have one padded row). Per exporter and variant:

- fp32, fp16, tf32: the default compile of that dtype;
- fp32-cublas: every GEMM whose default is a cuBLASLt epilogue forced back to cuBLAS + the separate
  epilogue kernel (choices {key: "cublas"}, as benchmarks/epilogue_ab.py does);
- fp32-nofusion: every fusion rule disabled (disabled_fusions = all of fusec's RULES);
- fp32-cublas-nofusion: both;
- fp32-nopad: the default fp32 plan fed an attention mask of all ones (no padded positions).

For each: a normal eager run (non-finite logits: all, and at unpadded positions; relative error
against the reference there) and ``fusec.debug.bisect`` (the first launch beyond tolerance, the
first launch non-finite where the reference is finite, its node, ops, inputs). OUT.json holds
everything (every launch row); OUT.txt (next to it) the verdicts and tables around the first
divergence. ``--cpu``: no GPU: compiles for sm_90, maps every launch to its IR value and runs the
reference (checks this script and the mapping; no GPU numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

VARIANTS = ("fp32", "fp16", "tf32", "fp32-cublas", "fp32-nofusion", "fp32-cublas-nofusion", "fp32-nopad")
TOL = {"fp32": 1e-3, "tf32": 1e-2, "fp16": 2e-2}  # per element, intermediate values: looser than the test's norm


def lt_off(path: str, shapes: dict, dtype: str) -> dict[str, str]:
    from fusec.compiler import stage
    from fusec.loader import load_graph
    from fusec.lower.choices import choice_points, choose

    st = stage(load_graph(path, shapes), dtype, "sm_90", dry_run=True)
    return {cp.key: "cublas" for _, cp in choice_points(st.graph) if choose({}, cp) == "cublaslt"}


def options(variant: str, path: str, shapes: dict) -> tuple[str, dict[str, Any]]:
    from fusec.passes.fusion_rules import RULES

    dtype = variant.split("-")[0]
    opts: dict[str, Any] = {}
    if "cublas" in variant:
        opts["choices"] = lt_off(path, shapes, dtype)
    if "nofusion" in variant:
        opts["disabled_fusions"] = sorted(RULES)
    return dtype, opts


def one(variant: str, path: str, inputs: dict, want: np.ndarray, keep: np.ndarray, out_name: str,
        cpu: bool) -> tuple[dict[str, Any], str]:
    import fusec
    from fusec.debug import bisect, launch_map, reference_values, staged_for

    shapes = {k: v.shape for k, v in inputs.items()}
    dtype, opts = options(variant, path, shapes)
    feed = dict(inputs)
    if variant.endswith("nopad"):
        feed["attention_mask"] = np.ones_like(inputs["attention_mask"])
    rec: dict[str, Any] = {"variant": variant, "dtype": dtype, "options": {k: (len(v) if k == "choices" else v)
                                                                          for k, v in opts.items()}}
    t0 = time.perf_counter()
    plan = fusec.compile(path, shapes=shapes, dtype=dtype, arch="sm_90" if cpu else None, **opts)
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    rec["launches"] = len(plan.manifest["launches"])
    rec["lowering"] = plan.manifest["report"].get("lowering", {}).get("by_template")
    if cpu:
        st = staged_for(plan, variant, path)
        slots = launch_map(st.graph, plan.manifest["launches"], st.memory.offsets, st.memory.state)
        ref = reference_values(st.graph, {k: np.asarray(v) for k, v in feed.items()})
        logits = ref[out_name]
        rec.update({"mapped": sum(1 for s in slots if s.values), "not_mapped": [s.why_not for s in slots if not s.values],
                    "reference_logits_nonfinite": int((~np.isfinite(logits.astype(np.float64))).sum())})
        return rec, f"{variant}: {rec['launches']} launches, {rec['mapped']} compared, reference logits non-finite: " \
                    f"{rec['reference_logits_nonfinite']}"
    import cupy

    got = cupy.asnumpy(plan.run(feed)[out_name]).astype(np.float64)
    rows_kept = got[keep] if not variant.endswith("nopad") else got
    rec["logits_nonfinite"] = int((~np.isfinite(got)).sum())
    rec["logits_nonfinite_unpadded"] = int((~np.isfinite(got[keep])).sum())
    if not variant.endswith("nopad"):
        fin = np.isfinite(rows_kept).all()
        rec["rel_err_unpadded"] = float(np.linalg.norm(rows_kept - want) / np.linalg.norm(want)) if fin else None
    tol = TOL[dtype]
    t0 = time.perf_counter()
    rep = bisect(plan, feed, atol=tol, rtol=tol, model=path)
    rec["bisect_s"] = round(time.perf_counter() - t0, 2)
    rec["bisect"] = rep.to_json()
    text = (f"== {variant}  ({rec['launches']} launches; logits non-finite {rec['logits_nonfinite']}, at unpadded "
            f"positions {rec['logits_nonfinite_unpadded']})\n{rep.verdict()}\n"
            + (f"inputs of the first: {rep.inputs_off}\n" if rep.inputs_off else "") + rep.table(around=8) + "\n")
    if rep.first_nonfinite is not None and rep.first_nonfinite != rep.first:
        text += f"-- around the first non-finite launch:\n{rep.table(around=4, at=rep.first_nonfinite)}\n"
    return rec, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="OUT.json (OUT.txt is written next to it)")
    ap.add_argument("--cpu", action="store_true", help="no GPU: compile for sm_90, map launches, run the reference")
    ap.add_argument("--exporter", action="append", choices=("legacy", "dynamo"), default=None)
    ap.add_argument("--variant", action="append", choices=VARIANTS, default=None)
    a = ap.parse_args()
    import llm_families as L

    from fusec import reference
    from fusec.frontend.onnx_import import import_onnx

    result: dict[str, Any] = {"case": "gemma2", "runs": []}
    texts = []
    for exporter in a.exporter or L.EXPORTERS:
        try:
            path, inputs, _ = L.export_case("gemma2", exporter)
        except BaseException as e:  # noqa: BLE001 -- export_case skips (pytest.skip) with the exporter's error
            result["runs"].append({"exporter": exporter, "error": f"export: {type(e).__name__}: {str(e)[:300]}"})
            texts.append(f"### {exporter}: export failed: {str(e)[:300]}")
            continue
        out_name = L.CASES["gemma2"].output
        keep = inputs["attention_mask"].astype(bool)
        want = reference.run(import_onnx(path, {k: v.shape for k, v in inputs.items()}), inputs)[out_name]
        want = want.astype(np.float64)[keep]
        texts.append(f"### gemma2 / {exporter} ({path}); reference logits finite: {bool(np.isfinite(want).all())}")
        for variant in a.variant or VARIANTS:
            try:
                rec, text = one(variant, path, inputs, want, keep, out_name, a.cpu)
            except Exception as e:  # noqa: BLE001 -- one variant's failure is recorded, the others still run
                rec = {"variant": variant, "error": f"{type(e).__name__}: {str(e).strip()[:400]}",
                       "where": traceback.format_exc(limit=-3)}
                text = f"== {variant}: ERROR {rec['error']}"
            rec["exporter"] = exporter
            result["runs"].append(rec)
            texts.append(text)
            print(text.splitlines()[0] + ("\n  " + text.splitlines()[1] if len(text.splitlines()) > 1 else ""),
                  flush=True)
    summary = [f"{r.get('exporter')}/{r.get('variant')}: " + (r["error"] if "error" in r else
               f"{r.get('launches')} launches, compared {r['mapped']}" if a.cpu else
               f"logits non-finite {r['logits_nonfinite']} (unpadded {r['logits_nonfinite_unpadded']}); "
               f"first divergence {r['bisect']['first']}, first non-finite {r['bisect']['first_nonfinite']}")
               for r in result["runs"]]
    result["summary"] = summary
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    txt = os.path.splitext(a.out)[0] + ".txt"
    with open(txt, "w") as f:
        f.write("\n".join(texts) + "\n\nSUMMARY\n" + "\n".join(summary) + "\n")
    print("\n".join(summary))
    print(f"wrote {a.out} and {txt}")


if __name__ == "__main__":
    main()
