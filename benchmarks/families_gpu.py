"""Decode speed of real-sized decoder families loaded from GGUF files (issue 20): a
Qwen3-0.6B-shaped and a Gemma-2-2B-shaped model with random Q8_0 weights, written here with the
``gguf`` package's writer, loaded by ``fusec generate``'s path (``load_generation_model``),
compiled into bf16 generation plans (the Q8_0 matrices stay packed, as ``fusec generate`` keeps them)
and run on the GPU. Records, per model and context: the GGUF
write / load / compile seconds, prefill ms, decode tok/s and the per-step driver counters
(launches, syncs, allocations, copies: ``plan stats``), as JSON and a markdown table.

    python benchmarks/families_gpu.py OUT.json [--dir DIR] [--batches 8,32] [--no-window-study]

Runs: each model at batch 1, a 32-token prompt and 128 new tokens; the Gemma-2 shape also at a
4,096-token context (a 3,968-token prompt, 128 new tokens) with its real 4,096-key window and with a
512-key window on its windowed layers: fusec keeps every position in the KV cache either way (no
ring buffer) and the window bounds the keys each decode step reads, which this pair measures.
Needs a GPU and the ``gguf`` package (its writer makes the files). About 2-3 minutes on an H100, most
of it writing and repacking 2.6B random weights and four
compiles; each ``--batches`` entry adds a compile per model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from fusec.runtime.generation import generate_with_plan

# name -> (GGUF architecture, metadata beyond the sizes, sizes); shapes of the HF configs
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(arch="qwen3", vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128,
                       ffn=3072, ctx=40960, eps=1e-6, theta=1e6, extra={}),
    "gemma2-2b": dict(arch="gemma2", vocab=256000, hidden=2304, layers=26, heads=8, kv_heads=4, head_dim=256,
                      ffn=9216, ctx=8192, eps=1e-6, theta=10000.0,
                      extra={"attention.sliding_window": (4096, "UINT32"), "attn_logit_softcapping": (50.0, "FLOAT32"),
                             "final_logit_softcapping": (30.0, "FLOAT32")}),
}


def _need_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        sys.exit("benchmarks/families_gpu.py needs the `gguf` package (pip install gguf, or the wheel carried to "
                 "this machine) to write the GGUF files")
    return gguf


def _q8_0(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """Random Q8_0 blocks (fp16 scale d, 32 int8 weights: w = d * q) of a [rows, cols] matrix, as
    the raw [rows, cols / 32 * 34] bytes GGUFWriter takes; |w| stays below ~``scale`` * 2."""
    blocks = rows * cols // 32
    raw = np.frombuffer(rng.bytes(blocks * 34), np.uint8).reshape(blocks, 34).copy()
    raw[:, :2] = np.full((blocks, 1), scale / 64, np.float16).view(np.uint8)
    return raw.reshape(rows, cols // 32 * 34)


def write_model(name: str, path: Path, seed: int = 0) -> float:
    """Write the ``name``-shaped GGUF file (Q8_0 matrices, F32 norms); returns the seconds taken."""
    gguf = _need_gguf()
    s = SHAPES[name]
    a, V, Q = s["arch"], gguf.GGUFValueType, gguf.GGMLQuantizationType
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.fspath(path), a)
    meta = {"context_length": (s["ctx"], "UINT32"), "embedding_length": (s["hidden"], "UINT32"),
            "block_count": (s["layers"], "UINT32"), "feed_forward_length": (s["ffn"], "UINT32"),
            "attention.head_count": (s["heads"], "UINT32"), "attention.head_count_kv": (s["kv_heads"], "UINT32"),
            "attention.key_length": (s["head_dim"], "UINT32"), "attention.value_length": (s["head_dim"], "UINT32"),
            "attention.layer_norm_rms_epsilon": (s["eps"], "FLOAT32"), "rope.freq_base": (s["theta"], "FLOAT32"),
            **s["extra"]}
    for key, (value, vtype) in meta.items():
        w.add_key_value(f"{a}.{key}", value, V[vtype])
    d, hd, f = s["hidden"], s["head_dim"], s["ffn"]
    q, kv = s["heads"] * hd, s["kv_heads"] * hd

    def mat(tname: str, rows: int, cols: int) -> None:
        w.add_tensor(tname, _q8_0(rng, rows, cols, cols ** -0.5), raw_dtype=Q.Q8_0)

    def norm(tname: str, n: int) -> None:  # Gemma files store 1 + w: about 1 either way
        w.add_tensor(tname, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", s["vocab"], d)
    norm("output_norm.weight", d)
    for i in range(s["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", d)
        mat(p + "attn_q.weight", q, d)
        mat(p + "attn_k.weight", kv, d)
        mat(p + "attn_v.weight", kv, d)
        mat(p + "attn_output.weight", d, q)
        norm(p + "ffn_norm.weight", d)
        mat(p + "ffn_gate.weight", f, d)
        mat(p + "ffn_up.weight", f, d)
        mat(p + "ffn_down.weight", d, f)
        if a == "qwen3":
            norm(p + "attn_q_norm.weight", hd)
            norm(p + "attn_k_norm.weight", hd)
        if a == "gemma2":
            norm(p + "post_attention_norm.weight", d)
            norm(p + "post_ffw_norm.weight", d)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return time.perf_counter() - t0


def run_case(gm: Any, prompt_len: int, new: int, batch: int, seed: int = 0) -> dict[str, Any]:
    """Compile a bf16 generation plan (packed weights stay packed) for (batch, prompt_len + new) and generate twice (the first
    run warms up); the second run's numbers."""
    from fusec.compiler import compile_generation

    t0 = time.perf_counter()
    plan = compile_generation(gm, batch=batch, max_seq_len=prompt_len + new, prefill_len=prompt_len, dtype="bf16",
                              eos_ids=())
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, gm.config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    generate_with_plan(plan, prompts, max_new_tokens=min(new, 8))
    res = generate_with_plan(plan, prompts, max_new_tokens=new, measure=True)
    dec = res.stats["decode"]
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new, "context": prompt_len + new,
            "compile_s": round(compile_s, 2), "prefill_ms": round(res.prefill_ms, 3),
            "decode_tok_s": round(res.decode_tok_s, 1), "decode_ms_per_step": round(1e3 * batch / res.decode_tok_s, 4),
            "launches_per_step": dec.get("launches_per_step"), "kernels_per_layer": dec.get("kernels_per_layer"),
            "cuda_graph": dec.get("cuda_graph"), "counters": dec.get("counters"), "per_step": dec.get("per_step"),
            "new_ids_head": res.new_ids[0][:8]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--dir", default=None, help="where the GGUF files go (default: a temporary directory)")
    ap.add_argument("--no-window-study", action="store_true", help="skip Gemma-2 at 4,096 tokens, window 4096 vs 512")
    ap.add_argument("--batches", default="", help="more batch sizes to run at a 96-token context (e.g. 8,32)")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    _need_gguf()
    from fusec import device, toolchain

    if not device.gpu_available():
        sys.exit(f"benchmarks/families_gpu.py needs a GPU: {toolchain.gpu_missing_reason()}")
    import dataclasses

    from fusec.genmodel import load_generation_model

    out: dict[str, Any] = {"fusec": _version(), "gpu": _gpu_name(), "models": {}}
    with tempfile.TemporaryDirectory(prefix="families_gpu_") as tmp:
        root = Path(args.dir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in SHAPES:
            path = root / f"{name}-random-Q8_0.gguf"
            rec: dict[str, Any] = {"gguf_write_s": round(write_model(name, path), 2),
                                   "gguf_bytes": path.stat().st_size}
            t0 = time.perf_counter()
            gm = load_generation_model(path)
            rec["load_s"] = round(time.perf_counter() - t0, 2)  # header + config; weights load with the compile
            rec["family"] = gm.config.family
            rec["runs"] = [run_case(gm, 32, 128, 1)] + [run_case(gm, 32, 64, b) for b in args.batches]
            if name == "gemma2-2b" and not args.no_window_study:
                for window in (4096, 512):
                    gm.config = dataclasses.replace(gm.config, sliding_window=window)
                    r = run_case(gm, 3968, 128, 1)
                    r["window"] = window
                    rec["runs"].append(r)
            out["models"][name] = rec
            print(json.dumps({name: rec}, indent=1), flush=True)
            del gm
            path.unlink()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(_markdown(out))
    return 0


def _markdown(out: dict[str, Any]) -> str:
    lines = [f"GPU: {out['gpu']}; bf16 plans, weights kept packed Q8_0, from random-weight GGUF files (`python benchmarks/families_gpu.py`)",
             "", "| model | B | context | window | prefill ms | decode tok/s | ms/step | launches/step | "
             "syncs / allocs / H2D / D2H per step | compile s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, rec in out["models"].items():
        for r in rec["runs"]:
            ps = r.get("per_step") or {}
            counters = " / ".join(str(ps.get(k, "-")) for k in ("syncs", "allocations", "h2d_bytes", "d2h_bytes"))
            lines.append(f"| {name} | {r['batch']} | {r['context']} | {r.get('window', '-')} | {r['prefill_ms']} | "
                         f"{r['decode_tok_s']} | {r['decode_ms_per_step']} | {r['launches_per_step']} | {counters} | "
                         f"{r['compile_s']} |")
    return "\n".join(lines)


def _version() -> str:
    import fusec

    return getattr(fusec, "__version__", "?")


def _gpu_name() -> str:
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001 -- informational only
        return "?"


if __name__ == "__main__":
    raise SystemExit(main())
