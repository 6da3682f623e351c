"""fusec vs PyTorch, one command per workload, with a roofline line (GPU only).

    python benchmarks/compare.py gpt2-small      [--json OUT] [--budget-s S] [--no-autotune] [--onnx]
    python benchmarks/compare.py bert-base | minilm | qwen3-prefill | all

For each workload: build the HF model from a transformers config with random weights (no hub
access on the GPU machines; benchmarks/bench_models.hf_model), save it, and build fusec's model
from that checkpoint (the built-in builder, or with --onnx: the HF module exported by torch.onnx
and imported by fusec), so both run identical weights; compile with fusec (compile time measured,
cold NVRTC cache unless the cache is warm); check agreement (fusec vs torch at the same precision,
and both vs torch fp32); time with CUDA events (10 warm-up, median of 50): torch eager,
torch.compile default and mode="max-autotune" (compile times included in the JSON), fusec as a
bound CUDA graph (``plan.bind``: one graph launch per request; host enqueue time reported) and
through ``plan.run``; for the Qwen3 prefill also the gpt-fast-style peer (benchmarks/torch_decoder:
prefill compiled with mode="reduce-overhead"). Last, the roofline line: FLOPs (2 M N K of every
matrix product of the model's graph, attention's two products at full S x T), minimum bytes
(weights in the storage dtype + inputs + outputs, each once), the floor on this GPU from ceilings
measured here (fusec.bench_kernels.measure_peaks) and fusec's fraction of it.

``--budget-s``: a peer that would start after this many seconds of the command is skipped and
recorded as such (max-autotune costs a minute or more per model).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import hf_model, time_cuda  # noqa: E402  (reused: same HF configs, same timing)

WORKLOADS = {  # name: (fusec built-in, HF family, batch, seq, dtype)
    "gpt2-small": ("gpt2-small", "gpt2", 8, 128, "fp16"),
    "bert-base": ("bert-base", "bert", 32, 128, "fp16"),
    "minilm": ("minilm", "bert", 32, 128, "fp16"),
    "qwen3-prefill": ("qwen3-0.6b", "qwen3", 1, 128, "bf16"),
}
_AUTOTUNE_S = 150  # what max-autotune was seen to cost per model (PERF.md: 63 to 116 s)


def graph_work(graph: Any, storage_itemsize: int) -> tuple[float, float]:
    """(FLOPs, minimum bytes) of a fusec graph: every MATMUL 2 * numel(out) * K, every ATTENTION
    4 B H S T D; weights (float constants in the storage dtype), inputs and outputs once."""
    from fusec.ops import Op

    flops = 0.0
    for n in graph.nodes:
        if n.op == Op.MATMUL:
            a, b = n.inputs
            k = b.shape[-1] if getattr(n.attrs, "trans_b", False) else a.shape[-1]
            flops += 2.0 * math.prod(n.output.shape) * k
        elif n.op == Op.ATTENTION:
            q, kk = n.inputs[0], n.inputs[1]
            bsz, h, s, d = q.shape
            flops += 4.0 * bsz * h * s * kk.shape[2] * d
    consts = {id(v): v for n in graph.nodes for v in n.inputs if v.is_const}
    wbytes = sum(v.numel * (storage_itemsize if v.dtype.is_float else v.dtype.itemsize) for v in consts.values())
    io = sum(v.numel * (storage_itemsize if v.dtype.is_float else v.dtype.itemsize) for v in (*graph.inputs, *graph.outputs))
    return flops, float(wbytes + io)


def _fusec_graph(builtin: str, family: str, model: Any, b: int, s: int, onnx: bool) -> Any:
    from fusec.models import build

    with tempfile.TemporaryDirectory() as d:
        if not onnx:
            model.save_pretrained(d, safe_serialization=True)
            return build(builtin, shapes={"input_ids": (b, s), "attention_mask": (b, s)}, weights_dir=d)
        import torch

        from fusec.frontend.onnx_import import import_onnx

        path = os.path.join(d, "model.onnx")
        ids = torch.zeros((b, s), dtype=torch.int64)
        m = copy.deepcopy(model).float()  # the legacy exporter may change the module it traces (PERF.md)
        torch.onnx.export(m, (ids, torch.ones_like(ids)), path, input_names=["input_ids", "attention_mask"],
                          dynamo=False)
        return import_onnx(path, {"input_ids": (b, s), "attention_mask": (b, s)})


def request(vocab: int, b: int, s: int) -> tuple[np.ndarray, np.ndarray]:
    """One request: random token ids (seed 0) and an all-ones mask, as int64 host arrays."""
    return np.random.default_rng(0).integers(0, vocab, size=(b, s)), np.ones((b, s), np.int64)


def host_ms(fn: Any, n: int = 100) -> float:
    """Median host time of one call (perf_counter around it; the GPU runs behind, synchronized
    every 10 calls so that the queue stays short)."""
    import torch

    t = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        t.append((time.perf_counter() - t0) * 1e3)
        if i % 10 == 9:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return float(np.median(t))


def _partial(res: dict[str, Any]) -> None:
    """One line per measurement as it is made: a peer that outlives the device call's time limit
    (max-autotune's autotuning) must not take what was already measured with it."""
    print("partial " + json.dumps(res, default=str), flush=True)


def _skip(res: dict, key: str, t_start: float, budget: float | None, cost: float) -> bool:
    if budget is not None and time.perf_counter() - t_start + cost > budget:
        res[key] = {"skipped": f"budget ({budget:.0f} s) would be exceeded"}
        return True
    return False


def run(name: str, budget: float | None = None, autotune: bool = True, onnx: bool = False,
        peaks: dict | None = None) -> dict[str, Any]:
    import cupy
    import torch

    import fusec
    from fusec.bench_kernels import measure_peaks

    t_start = time.perf_counter()
    builtin, family, b, s, dtype = WORKLOADS[name]
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = hf_model(builtin, family)
    graph = _fusec_graph(builtin, family, model, b, s, onnx)
    model = model.to("cuda", tdt)
    ids, mask = request(model.config.vocab_size, b, s)
    t_ids, t_mask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
    out_key = "last_hidden_state" if family == "bert" else "logits"
    t0 = time.perf_counter()
    plan = fusec.compile(graph, dtype=dtype, cuda_graph=True)
    res: dict[str, Any] = {"workload": name, "shape": [b, s], "dtype": dtype, "source": "onnx" if onnx else "builtin",
                           "fusec_compile_s": time.perf_counter() - t0, "launches": plan.info()["launches"]}
    inputs = {"input_ids": cupy.asarray(ids), "attention_mask": cupy.asarray(mask)}
    got = plan.run(inputs)[out_key]
    from fusec.bench import counters_state

    res["fusec_driver_counters"] = counters_state()  # "off (disabled by FUSEC_CUPTI=0)" unless asked for
    g = torch.from_dlpack(got)
    g = (g.view(torch.bfloat16) if dtype == "bf16" else g).float()
    with torch.no_grad():
        want = getattr(model(input_ids=t_ids, attention_mask=t_mask), out_key).float()
        ref32 = getattr(copy.deepcopy(model).float()(input_ids=t_ids, attention_mask=t_mask), out_key).float()
    res["err_vs_torch_same_dtype"] = float((g - want).norm() / want.norm())
    res["fusec_err_vs_torch_fp32"] = float((g - ref32).norm() / ref32.norm())
    res["torch_err_vs_torch_fp32"] = float((want - ref32).norm() / ref32.norm())
    del ref32

    stream = cupy.cuda.get_current_stream()
    bound = plan.bind(inputs)
    res["fusec_bound_graph"] = time_cuda(lambda: bound.run(stream))
    res["fusec_bound_graph"]["host_enqueue_ms"] = host_ms(lambda: bound.run(stream))
    res["fusec_run_graph"] = time_cuda(lambda: plan.run(inputs, stream=stream))
    res["fusec_run_graph"]["host_enqueue_ms"] = host_ms(lambda: plan.run(inputs, stream=stream))
    _partial(res)
    with torch.no_grad():
        res["torch_eager"] = time_cuda(lambda: model(input_ids=t_ids, attention_mask=t_mask))
        _partial(res)
        for mode, key, cost in ((None, "torch_compile_default", 60), ("max-autotune", "torch_compile_max_autotune",
                                                                        _AUTOTUNE_S)):
            if (mode and not autotune) or _skip(res, key, t_start, budget, cost):
                res.setdefault(key, {"skipped": "--no-autotune"})
                continue
            torch._dynamo.reset()
            t0 = time.perf_counter()
            compiled = torch.compile(model, mode=mode) if mode else torch.compile(model)
            compiled(input_ids=t_ids, attention_mask=t_mask)
            torch.cuda.synchronize()
            res[key] = {"compile_s": time.perf_counter() - t0,
                        **time_cuda(lambda: compiled(input_ids=t_ids, attention_mask=t_mask))}
            _partial(res)
        if family == "qwen3" and not _skip(res, "gpt_fast_prefill", t_start, budget, 90):
            from torch_decoder import from_hf, prefill_tokens

            torch._dynamo.reset()
            peer = from_hf(model)
            peer.setup_caches(b, max(s, 256))
            pos = torch.arange(s, device="cuda")
            fn = torch.compile(prefill_tokens, mode="reduce-overhead", fullgraph=True)
            t0 = time.perf_counter()
            for _ in range(3):
                fn(peer, t_ids, pos)
            torch.cuda.synchronize()
            res["gpt_fast_prefill"] = {"compile_s": time.perf_counter() - t0,
                                       **time_cuda(lambda: fn(peer, t_ids, pos))}
    storage = {"fp16": 2, "bf16": 2, "fp32": 4}[dtype]
    flops, nbytes = graph_work(graph, storage)
    pk = peaks or measure_peaks({"fp16": "f16", "bf16": "bf16", "fp32": "f32"}[dtype])
    floor_ms = 1e3 * max(flops / (pk["tflops"] * 1e12), nbytes / (pk["gbps"] * 1e9))
    fusec_ms = res["fusec_bound_graph"]["median_ms"]
    res["roofline"] = {"flops": flops, "min_bytes": nbytes, "peak_tflops": pk["tflops"], "peak_gbps": pk["gbps"],
                       "floor_ms": floor_ms, "fusec_fraction": floor_ms / fusec_ms,
                       "bound": "flops" if flops / (pk["tflops"] * 1e12) >= nbytes / (pk["gbps"] * 1e9) else "bytes"}
    peers = [res[k]["median_ms"] for k in ("torch_eager", "torch_compile_default", "torch_compile_max_autotune",
                                           "gpt_fast_prefill") if "median_ms" in res.get(k, {})]
    res["fusec_vs_best_peer"] = fusec_ms / min(peers) if peers else None
    res["peer_times_ms"] = {k: res[k].get("median_ms") for k in ("torch_eager", "torch_compile_default",
                                                                  "torch_compile_max_autotune", "gpt_fast_prefill")
                            if k in res}
    return res


def report(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['workload']}: ERROR {r['error']}"
    rf = r["roofline"]
    peers = "  ".join(f"{k.replace('torch_', '')} {v:.3f}" for k, v in r["peer_times_ms"].items() if v)
    return (f"{r['workload']} {r['dtype']} {r['shape'][0]}x{r['shape'][1]}: fusec {r['fusec_bound_graph']['median_ms']:.3f} ms "
            f"(bound graph; run() {r['fusec_run_graph']['median_ms']:.3f} ms, host enqueue "
            f"{r['fusec_bound_graph']['host_enqueue_ms'] * 1e3:.1f} us bound / "
            f"{(r['fusec_run_graph']['host_enqueue_ms'] or 0) * 1e3:.1f} us run), {r['launches']} launches, "
            f"compile {r['fusec_compile_s']:.1f} s; err vs torch {r['err_vs_torch_same_dtype']:.1e}, vs fp32 fusec "
            f"{r['fusec_err_vs_torch_fp32']:.1e} / torch {r['torch_err_vs_torch_fp32']:.1e}\n"
            f"  peers (ms): {peers}; fusec / best peer {r['fusec_vs_best_peer'] or float('nan'):.2f}x\n"
            f"  roofline: {rf['flops'] / 1e9:.1f} GFLOP, {rf['min_bytes'] / 1e6:.1f} MB minimum; floor {rf['floor_ms']:.3f} ms "
            f"({rf['bound']}-bound at {rf['peak_tflops']:.0f} TFLOP/s, {rf['peak_gbps']:.0f} GB/s measured); "
            f"fusec at {100 * rf['fusec_fraction']:.1f}% of the floor")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", nargs="+", choices=[*WORKLOADS, "all"])
    ap.add_argument("--json", metavar="OUT", help="write every result as JSON to OUT")
    ap.add_argument("--budget-s", type=float, default=None, help="skip peers that would start after this many seconds")
    ap.add_argument("--no-autotune", action="store_true", help="skip torch.compile mode='max-autotune'")
    ap.add_argument("--onnx", action="store_true", help="import the HF module through torch.onnx instead of the builder")
    args = ap.parse_args(argv)
    names = list(WORKLOADS) if "all" in args.workload else args.workload
    t0 = time.perf_counter()
    results, peaks = [], {}
    for n in names:
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - t0)
        dtype = {"fp16": "f16", "bf16": "bf16", "fp32": "f32"}[WORKLOADS[n][4]]
        try:
            if dtype not in peaks:
                from fusec.bench_kernels import measure_peaks

                peaks[dtype] = measure_peaks(dtype)
            r = run(n, left, not args.no_autotune, args.onnx, peaks[dtype])
        except Exception as e:  # one workload's failure must not hide the others
            import traceback

            traceback.print_exc()
            r = {"workload": n, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        print(report(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"peaks": peaks, "results": results}, f, indent=2)
    print(json.dumps({"peaks": peaks, "results": results}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # fusec's driver counters, attached, add ~1 us per node to every graph launch (fusec.runtime.counters):
    # off unless asked for, so that fusec's times are its plans' own
    os.environ.setdefault("FUSEC_CUPTI", "0")
    sys.exit(main())
