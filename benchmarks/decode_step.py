"""A generation plan's decode step on the GPU, launched with and without programmatic dependent
launch (PDL): step time, tokens/s against the copy-bandwidth roofline, launches per step, and the
per-kernel profile of CUDA-graph replays (CUPTI kernel records): time per kernel family and the
gap between consecutive kernels (negative: the next one started, waiting in-kernel, before the one
before it ended). A kernel's time in the profile runs from the end of the one before (or its own
start, if later) to its end: under PDL a kernel's start includes its wait.

    python benchmarks/decode_step.py OUT_DIR [--model qwen3-0.6b|llama-1b] [--batches 1,8] [--context 128]

One plan per batch (bf16, random weights, greedy), compiled once and loaded twice: FUSEC_PDL=1 and
FUSEC_PDL=0 (read when a plan's device memory is made). The same prompt and steps run on both; the
drawn tokens and the final KV caches must be bit-identical (PDL changes when a kernel starts, never
what it computes; a state over 1 GB is compared by digests computed on the device). Roofline: (weight
bytes + KV bytes attended) per step over the device-to-device
copy bandwidth measured in the same process. The prefill entry is timed too (median of 10 calls,
its input copy included). Variants (--gemv-forms, --ab) are timed in turns with the default plan, all
loaded at once (run_interleaved). Writes OUT_DIR/decode_step.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode_kernels import copy_bw  # noqa: E402  (one copy-bandwidth measurement for the benchmarks)


def model(name: str) -> Any:
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.registry import get_config
    from fusec.models.weights import RandomWeights

    if name in ("llama-1b-q4_k_m", "llama-1b-q8_0", "llama-7b-q4_k_m", "llama-13b-q8_0"):  # packed shapes (quant_bench)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import quant_bench

        size = name.split("-")[1]
        return quant_bench._model(name.split("-", 2)[2], {"1b": 16, "7b": 32, "13b": 40}[size], size)
    if name == "llama-1b":  # the Llama-3.2-1B shape: tied 128,256 vocabulary, 16 layers, d 2048, GQA 32/8
        cfg = dataclasses.replace(get_config("llama-tiny"), name="llama-1b", vocab_size=128256, hidden_size=2048,
                                  num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64, intermediate_size=8192,
                                  max_positions=131072, rope_theta=500000.0, tie_word_embeddings=True)
    else:
        cfg = get_config(name)
    return GenModel(cfg, SharedWeights(RandomWeights(0)), None, (), cfg.name)


def family(name: str, kernels: dict[str, str]) -> str:
    t = kernels.get(name)
    if t is not None:
        return t
    return "cublas" if "gemm" in name.lower() or "sm90" in name or "cutlass" in name else name[:24]


def _engine(path: str, pdl: bool, batch: int, warm: bool = False, edit: Any = None) -> tuple[Any, Any, Any]:
    """(plan, engine, start) for a plan file: FUSEC_PDL as asked (read when its device memory is made),
    greedy rows, and ``start`` prefilling the same random prompt into every row (decode then starts at
    position prefill_len). ``warm``: started and 8 steps run already. ``edit``: applied to the loaded
    plan's manifest before its engine is made (an experiment's variant of the launches)."""
    import fusec
    from fusec.generation import write_sampling
    from fusec.runtime.generation import PlanEngine
    from fusec.sampling import Sampling, row_seeds

    os.environ["FUSEC_PDL"] = "1" if pdl else "0"
    plan = fusec.load(path)
    if edit is not None:
        edit(plan.manifest)
    eng = PlanEngine(plan)
    gen = plan.manifest["generation"]
    ids = np.random.default_rng(0).integers(0, int(gen["vocab_size"]), (batch, int(gen["prefill_len"])))
    write_sampling(eng, [Sampling()] * batch, row_seeds(0, batch))
    lengths = np.full(batch, int(gen["prefill_len"]), np.int64)

    def start() -> None:
        eng.prefill(ids, lengths)

    if warm:
        start()
        for _ in range(8):
            eng.decode()
        eng.sync()
    return plan, eng, start


def _window_ms(eng: Any, start: Any, steps: int) -> float:
    """One timing window: the prompt prefilled again, then ``steps`` decode steps; ms a step."""
    import cupy as cp

    a, b = cp.cuda.Event(), cp.cuda.Event()
    start()
    a.record(eng.stream)
    for _ in range(steps):
        eng.decode()
    b.record(eng.stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / steps


HOST_STATE_BYTES = 1 << 30  # states larger than this are compared by digests computed on the device


def _snapshot(eng: Any) -> dict[str, Any]:
    """Every state of ``eng``'s plan, to compare two runs bit for bit: the bytes on the host, or for a state over
    HOST_STATE_BYTES (a batch-32 cache at a 4,096-token context is ~15 GB) three digests of its 32-bit words computed
    on the device: their sum, their sum weighted by an odd multiplier of each word's index, and their XOR. A flipped
    bit changes the XOR; equal digests of different bytes would need all three to collide."""
    import cupy as cp

    eng.sync()
    xor_reduce = _xor_reduce()
    out: dict[str, Any] = {}
    for r in eng.plan.manifest["state"]:
        arr = eng.device.state_array(r["name"])
        if arr.nbytes <= HOST_STATE_BYTES or arr.nbytes % 4:
            out[r["name"]] = arr.get()
            continue
        words = arr.reshape(-1).view(cp.uint32)
        total = weighted = xor = 0
        for i in range(0, words.size, 1 << 26):  # 256 MB of words at a time (their uint64 copies: 512 MB)
            w = words[i:i + (1 << 26)].astype(cp.uint64)
            idx = (cp.arange(i, i + w.size, dtype=cp.uint64) * cp.uint64(2654435761)) | cp.uint64(1)
            total += int(w.sum())
            weighted += int((w * idx).sum())
            xor ^= int(xor_reduce(w))
        out[r["name"]] = ("digest", total % (1 << 64), weighted % (1 << 64), xor)
    return out


def _xor_reduce() -> Any:
    import cupy as cp

    return cp.ReductionKernel("uint64 x", "uint64 y", "x", "a ^ b", "y = a", "0", "fc_bench_xor_reduce")


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) or isinstance(b, tuple):
        return a == b
    return bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


def run_mode(path: str, pdl: bool, batch: int, steps: int, windows: int) -> tuple[dict[str, Any], Any, Any]:
    import cupy as cp

    plan, eng, start = _engine(path, pdl, batch, warm=True)
    pdl_launches = sum(bool(L.get("pdl")) for L in plan.manifest["entries"]["decode"]["launches"])
    a, b = cp.cuda.Event(), cp.cuda.Event()
    prefill = []  # the prefill entry's GPU time (its inputs' copy included), one call at a time
    for _ in range(10):
        a.record(eng.stream)
        start()
        b.record(eng.stream)
        b.synchronize()
        prefill.append(cp.cuda.get_elapsed_time(a, b))
    times = [_window_ms(eng, start, steps) for _ in range(windows)]
    tokens = eng.read_state("tokens")
    caches = _snapshot(eng)
    out: dict[str, Any] = {"pdl": pdl, "step_ms": statistics.median(times), "step_ms_all": times,
                           "prefill_ms": statistics.median(prefill),
                           "prefill_launches": len(plan.manifest["entries"]["prefill"]["launches"]),
                           "launches": len(plan.manifest["entries"]["decode"]["launches"]),
                           "pdl_launches": pdl_launches, "device_pdl": bool(eng.device.pdl)}
    eng.sync()
    eng = plan = None  # free the device memory (the closures above read eng)
    return out, tokens, caches


def run_interleaved(paths: dict[str, str], batch: int, steps: int, windows: int) -> dict[str, tuple[dict, Any, Any]]:
    """Every plan of ``paths`` loaded at once (PDL) and timed in turns: each window runs every plan
    once, starting from a different one each window, so that no plan is always measured first or
    last (measured in one process: the same plan timed after the others ran 4% slower). Per plan:
    (timing, tokens, caches) after its last window."""
    names = list(paths)
    engines, starts = {}, {}
    for name in names:
        _, engines[name], starts[name] = _engine(paths[name], True, batch, warm=True)
    times: dict[str, list[float]] = {n: [] for n in names}
    for w in range(windows):
        for name in names[w % len(names):] + names[:w % len(names)]:
            times[name].append(_window_ms(engines[name], starts[name], steps))
    out = {}
    for name in names:
        eng = engines[name]
        out[name] = ({"step_ms": statistics.median(times[name]), "step_ms_all": times[name]},
                     eng.read_state("tokens"), _snapshot(eng))
    engines.clear()
    return out


def profile_mode(path: str, pdl: bool, batch: int, entry: str = "decode") -> Any:
    """The per-kernel profile of a few replays of ``entry`` ("decode" or "prefill"; CUPTI kernel
    records): run after every timing, since attached counters slow every later graph launch of the
    process."""

    from fusec.runtime.counters import DriverCounters

    plan, eng, start = _engine(path, pdl, batch)

    out: dict[str, Any] = {}
    counters = DriverCounters.create()
    if counters.available:
        start()
        marks: list[int] = []

        def replays() -> None:
            for _ in range(10):
                marks.append(counters.timestamp())
                if entry == "decode":
                    eng.decode()
                else:
                    start()
                eng.sync()
            marks.append(counters.timestamp())

        from fusec.runtime.kernel_trace import covered, split_by_marks

        recs = split_by_marks(counters.kernel_records(replays), marks)
        # Each replay's records, in start order, are the decode entry's kernel launches in order (a kernel
        # starts only after the one before it started, PDL or not): name them from the plan. CUPTI's own
        # names went stale for a plan loaded after another one was freed in this process (the batch-8 plan
        # showed batch-1 kernels' names).
        launched = [plan.manifest["kernels"][L["kernel"]]["entry"]
                    for L in plan.manifest["entries"][entry]["launches"] if "kernel" in L]
        out["names_from_plan"] = all(len(r) == len(launched) for r in recs if r)
        if out["names_from_plan"]:
            recs = [[(s, e, n) for (s, e, _), n in zip(sorted(r), launched)] for r in recs]
        if recs and recs[1]:
            r0 = sorted(recs[1])
            out["timeline"] = [(n[:28], round((s - r0[0][0]) * 1e-3, 2), round((e - r0[0][0]) * 1e-3, 2)) for s, e, n in r0]
        first_label: dict[str, str] = {}
        for L in plan.manifest["entries"][entry]["launches"]:
            if "kernel" in L:
                first_label.setdefault(plan.manifest["kernels"][L["kernel"]]["entry"], L["label"])
        replays = max(1, sum(1 for r in recs if r))
        mods = {m["id"]: m["template"].split(".")[0] for m in plan.manifest["modules"]}
        kern = {k["entry"]: mods[k["module"]] for k in plan.manifest["kernels"]}
        by: dict[str, list[float]] = {}
        own: dict[str, list[float]] = {}  # per kernel (entry name): the own time of each of its launches
        gaps: list[float] = []
        walls, busy = [], []
        for r in recs:
            if not r:
                continue
            r = sorted(r)
            walls.append((r[-1][1] - r[0][0]) * 1e-3)
            busy.append(covered(r) * 1e-3)  # overlapping (PDL) kernels count once
            gaps += [(r[i + 1][0] - r[i][1]) * 1e-3 for i in range(len(r) - 1)]
            per: dict[str, float] = {}
            prev_end = r[0][0]
            for s, e, n in r:  # a kernel's own time: from when it could run (the one before ended) to its end
                f = family(n, kern)
                per[f] = per.get(f, 0.0) + (e - max(s, prev_end)) * 1e-3
                own.setdefault(n, []).append((e - max(s, prev_end)) * 1e-3)
                prev_end = max(prev_end, e)
            for f, us in per.items():
                by.setdefault(f, []).append(us)
        out["profile"] = {"wall_us": statistics.median(walls), "busy_us": statistics.median(busy),
                          "kernels": len(recs[0]) if recs else 0,
                          "gap_us_median": statistics.median(gaps) if gaps else None,
                          "gap_us_p10": float(np.percentile(gaps, 10)) if gaps else None,
                          "gap_us_p90": float(np.percentile(gaps, 90)) if gaps else None,
                          "by_family_us": {f: round(statistics.median(v), 2) for f, v in sorted(by.items())},
                          # each kernel of the step (a layer's qkv, attention, o, ...): its first launch's label,
                          # launches a step, and the median own time of one launch
                          "by_kernel_us": {n: {"label": first_label.get(n, n), "per_step": round(len(v) / replays, 2),
                                               "median_us": round(statistics.median(v), 2)}
                                           for n, v in own.items()},
                          "names_from_plan": out["names_from_plan"]}
    else:
        out["profile"] = f"unavailable: {counters.reason}"
    eng.sync()
    eng = plan = None  # free the device memory (the closures above read eng)
    return out["profile"], out.get("timeline")


def parse_ab(ab: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """An --ab variant, KNOB=VALUE[+KNOB=VALUE] with disable=RULE[,RULE]: (knobs, disabled fusion rules). Each knob
    must be declared (fusec.knobs) and its value valid, so a variant cannot time the default under another name."""
    from fusec import knobs as K

    knobs = dict(kv.split("=", 1) for kv in ab.split("+"))
    disabled = tuple(knobs.pop("disable").split(",")) if "disable" in knobs else ()
    for name, text in knobs.items():
        if name not in K.KNOBS:
            raise SystemExit(f"--ab {ab}: {name} is not a fusec knob (fusec/knobs.py)")
        K.value(name, text)  # InputError naming the knob for a bad value
    return knobs, disabled


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens, prefilled into every row; the caches hold "
                    "context + steps + 16 rows (512 ran on an H200, seventeenth session)")
    ap.add_argument("--steps", type=int, default=127)
    ap.add_argument("--cache", type=int, default=0, help="the caches' rows (the plan's max_seq_len; 0: context + steps + "
                    "16), e.g. a server's 4096 at a short context")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--gemv-forms", default="ring", help="FUSEC_GEMV_FORM values: the first gets every mode and the "
                    "profile, each other one a PDL timing checked bit for bit against the first's (e.g. ring,register)")
    ap.add_argument("--ab", action="append", default=[], metavar="KNOB=VALUE[+KNOB=VALUE]",
                    help="also time the first form's plan compiled with these knobs (e.g. FUSEC_KV_PREFETCH=0: the "
                    "attention loads no cache row before its PDL wait; disable=RULE[,RULE]: without those fusion "
                    "rules), checked bit for bit; repeatable")
    args = ap.parse_args()
    if args.cache and args.cache < args.context + args.steps + 1:
        ap.error(f"--cache {args.cache} holds fewer rows than --context + --steps + 1")
    forms = args.gemv_forms.split(",")
    env = {f: {"FUSEC_GEMV_FORM": f} for f in forms}
    disabled: dict[str, tuple[str, ...]] = {}
    for ab in args.ab:
        knobs, disabled[ab] = parse_ab(ab)
        env[ab] = {"FUSEC_GEMV_FORM": forms[0], **knobs}
        forms.append(ab)
    from fusec.compiler import compile_generation

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bw()
    gm = model(args.model)
    cfg = gm.config
    results: dict[str, Any] = {"model": args.model, "copy_Bps": bw, "context": args.context, "runs": []}
    tmp = tempfile.mkdtemp()
    for batch in map(int, args.batches.split(",")):
        paths = {}
        for form in forms:
            with mock.patch.dict(os.environ, env[form]):  # the next variant runs with the defaults again
                t0 = time.time()
                plan = compile_generation(gm, batch=batch, max_seq_len=args.cache or args.context + args.steps + 16,
                                          prefill_len=args.context, dtype="bf16", eos_ids=[],
                                          disabled_fusions=disabled.get(form, ()))
                compile_s = time.time() - t0
                paths[form] = os.path.join(tmp, f"b{batch}-{form}.fplan")
                plan.save(paths[form])
                weights = int(plan.manifest["memory"]["weights_bytes"])
                del plan
        path = paths[forms[0]]
        kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * 2 * (args.context + args.steps / 2)
        roof_ms = (weights + kv) / bw * 1e3
        rec: dict[str, Any] = {"batch": batch, "compile_s": round(compile_s, 1), "weights_bytes": weights,
                               "kv_bytes_per_step": kv, "roofline_step_ms": roof_ms}
        runs = {}
        for mode, pdl in (("pdl", True), ("plain", False), ("plain_again", False), ("pdl_again", True)):
            r, tokens, caches = run_mode(path, pdl, batch, args.steps, args.windows if not mode.endswith("again") else 1)
            r["tok_s"] = batch / (r["step_ms"] * 1e-3)
            r["pct_roofline"] = 100 * roof_ms / r["step_ms"]
            if not mode.endswith("again"):
                rec[mode] = r
            runs[mode] = (tokens, caches)
        if len(forms) > 1:  # the variants and the default in turns (run_interleaved)
            inter = run_interleaved(paths, batch, args.steps, 2 * args.windows)
            rec["pdl_interleaved"] = inter[forms[0]][0]
            for form in forms[1:]:
                r, tokens, caches = inter[form]
                r["tok_s"] = batch / (r["step_ms"] * 1e-3)
                r["pct_roofline"] = 100 * roof_ms / r["step_ms"]
                rec[f"pdl_{form}"] = r
                runs[form] = (tokens, caches)

        def same(a: str, b: str) -> dict[str, Any]:
            (ta, ca), (tb, cb) = runs[a], runs[b]
            diff = np.argwhere(ta != tb)
            states = [k for k in ca if not _same_state(ca[k], cb[k])]
            return {"tokens": bool(diff.size == 0), "token_diffs": int(len(diff)),
                    "first_token_diff": [diff[0].tolist(), int(ta[tuple(diff[0])]), int(tb[tuple(diff[0])])] if diff.size else None,
                    "caches": not states, "states_differing": states}

        rec["path"] = path
        rec["pdl_vs_plain"] = same("pdl", "plain")
        rec["plain_vs_plain"] = same("plain", "plain_again")
        rec["pdl_vs_pdl"] = same("pdl", "pdl_again")
        rec["pdl_bit_identical"] = rec["pdl_vs_plain"]["tokens"] and rec["pdl_vs_plain"]["caches"]
        for form in forms[1:]:
            rec[f"{forms[0]}_vs_{form}"] = same("pdl", form)
        rec["layers"] = cfg.num_layers
        rec["launches_per_layer"] = round(rec["pdl"]["launches"] / cfg.num_layers, 2)
        results["runs"].append(rec)
        print(json.dumps(rec, default=str), flush=True)
        (out / "decode_step.json").write_text(json.dumps(results, indent=1, default=str))
    for rec in results["runs"]:  # after every timing: attached CUPTI slows every later graph launch
        for mode, pdl in (("pdl", True), ("plain", False)):
            rec[mode]["profile"], rec[mode]["timeline"] = profile_mode(rec.pop("path") if mode == "plain" else rec["path"],
                                                                       pdl, rec["batch"])
        print(json.dumps({"batch": rec["batch"], "pdl_profile": rec["pdl"]["profile"],
                          "plain_profile": rec["plain"]["profile"]}, default=str), flush=True)
    (out / "decode_step.json").write_text(json.dumps(results, indent=1, default=str))
    md = [f"model {args.model}, context {args.context}, copy bandwidth {bw / 1e9:.0f} GB/s", "",
          "| batch | launches (per layer) | PDL step ms | tok/s | % roofline | plain step ms | median gap PDL / plain (us) | bit-identical "
          "| prefill ms, PDL (launches) |"
          + (" default, in turns with the variants: PDL step ms |" if len(forms) > 1 else "")
          + "".join(f" {f} form, in turns: PDL step ms (same bits) |" for f in forms[1:]),
          "|---|---|---|---|---|---|---|---|---|" + "---|" * (len(forms) - 1 + (len(forms) > 1))]
    for r in results["runs"]:
        g = [f'{x["profile"]["gap_us_median"]:.2f}' if isinstance(x["profile"], dict) else None for x in (r["pdl"], r["plain"])]
        md.append(f"| {r['batch']} | {r['pdl']['launches']} ({r['launches_per_layer']}) | {r['pdl']['step_ms']:.3f} "
                  f"| {r['pdl']['tok_s']:.0f} | {r['pdl']['pct_roofline']:.0f}% | {r['plain']['step_ms']:.3f} "
                  f"| {g[0]} / {g[1]} | {r['pdl_bit_identical']} | {r['pdl']['prefill_ms']:.3f} ({r['pdl']['prefill_launches']}) |"
                  + (f" {r['pdl_interleaved']['step_ms']:.3f} |" if "pdl_interleaved" in r else "")
                  + "".join(f" {r[f'pdl_{f}']['step_ms']:.3f} ({r[f'{forms[0]}_vs_{f}']['tokens'] and r[f'{forms[0]}_vs_{f}']['caches']}) |"
                            for f in forms[1:]))
    (out / "decode_step.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
