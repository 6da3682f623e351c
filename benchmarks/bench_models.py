"""fusec vs PyTorch on whole models, same process, same weights, same inputs (GPU only).

For each workload: build the HF model from a transformers config with random weights, save it
as a checkpoint, build the fusec model from that checkpoint (so both run identical weights),
check that the outputs agree, then time single requests with CUDA events:
  torch eager, torch.compile (mode given per workload), fusec eager launches, fusec CUDA graph.
Prints a table and writes JSON to the path given as the first argument.

    python benchmarks/bench_models.py out.json [workload ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

WORKLOADS = {
    # name: (fusec built-in, HF family, batch, seq, dtype)
    "gpt2-small-fp16": ("gpt2-small", "gpt2", 8, 128, "fp16"),
    "gpt2-small-fp32": ("gpt2-small", "gpt2", 8, 128, "fp32"),
    "minilm-fp16": ("minilm", "bert", 32, 128, "fp16"),
    "bert-base-fp16": ("bert-base", "bert", 32, 128, "fp16"),
    "qwen3-0.6b-prefill-bf16": ("qwen3-0.6b", "qwen3", 1, 128, "bf16"),
}


def hf_model(builtin: str, family: str):
    import torch
    import transformers as T

    from fusec.models import get_config

    c = get_config(builtin)
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = T.GPT2Config(vocab_size=c.vocab_size, n_embd=c.hidden_size, n_layer=c.num_layers, n_head=c.num_heads,
                           n_positions=c.max_positions, n_inner=c.intermediate_size, layer_norm_epsilon=c.norm_eps)
        model = T.GPT2LMHeadModel(cfg)
    elif family == "bert":
        cfg = T.BertConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                           num_attention_heads=c.num_heads, intermediate_size=c.intermediate_size,
                           max_position_embeddings=c.max_positions, layer_norm_eps=c.norm_eps,
                           type_vocab_size=max(c.type_vocab_size, 1), hidden_act=c.activation)
        model = T.BertModel(cfg, add_pooling_layer=False)
    else:
        cfg = T.Qwen3Config(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
                            num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                            intermediate_size=c.intermediate_size, tie_word_embeddings=True, rope_theta=c.rope_theta,
                            rms_norm_eps=c.norm_eps, max_position_embeddings=max(c.max_positions, 512))
        model = T.Qwen3ForCausalLM(cfg)
    cfg._attn_implementation = "sdpa"
    return model.eval()


def time_cuda(fn, warmup: int = 10, iters: int = 50) -> dict:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        s.record()
        fn()
        e.record()
        e.synchronize()
        samples.append(s.elapsed_time(e))
    a = np.asarray(samples)
    return {"median_ms": float(np.median(a)), "p10_ms": float(np.percentile(a, 10)), "p90_ms": float(np.percentile(a, 90))}


def run(name: str) -> dict:
    import cupy
    import torch

    import fusec

    builtin, family, b, s, dtype = WORKLOADS[name]
    tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    model = hf_model(builtin, family)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        from fusec.models import build

        graph = build(builtin, shapes={"input_ids": (b, s), "attention_mask": (b, s)}, weights_dir=d)
    model = model.to("cuda", tdt)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=(b, s))
    mask = np.ones((b, s), np.int64)
    t_ids, t_mask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
    out_key = "logits" if family != "bert" else "last_hidden_state"

    t0 = time.perf_counter()
    plan = fusec.compile(graph, dtype=dtype, cuda_graph=True)
    compile_s = time.perf_counter() - t0
    inputs = {"input_ids": cupy.asarray(ids), "attention_mask": cupy.asarray(mask)}
    got = plan.run(inputs)[out_key]
    with torch.no_grad():
        want = getattr(model(input_ids=t_ids, attention_mask=t_mask), out_key)
    g = torch.from_dlpack(got).float() if dtype != "bf16" else torch.from_dlpack(got).view(torch.bfloat16).float()
    rel = float((g - want.float()).norm() / want.float().norm())
    extra = {}
    if dtype != "fp32":  # who is closer to fp32: fusec or torch at the same precision?
        with torch.no_grad():
            ref32 = getattr(model.float()(input_ids=t_ids, attention_mask=t_mask), out_key).float()
        model = model.to(tdt)
        extra = {"fusec_err_vs_torch_fp32": float((g - ref32).norm() / ref32.norm()),
                 "torch_err_vs_torch_fp32": float((want.float() - ref32).norm() / ref32.norm())}

    res = {"workload": name, "shape": [b, s], "dtype": dtype, "rel_err_vs_torch": rel, "fusec_compile_s": compile_s,
           "launches": plan.info()["launches"], **extra}
    with torch.no_grad():
        res["torch_eager"] = time_cuda(lambda: model(input_ids=t_ids, attention_mask=t_mask))
        t0 = time.perf_counter()
        compiled = torch.compile(model)
        compiled(input_ids=t_ids, attention_mask=t_mask)
        res["torch_compile_s"] = time.perf_counter() - t0
        res["torch_compile"] = time_cuda(lambda: compiled(input_ids=t_ids, attention_mask=t_mask))
    stream = cupy.cuda.get_current_stream()
    eager = plan.with_cuda_graph(False)
    res["fusec_eager"] = time_cuda(lambda: eager.run(inputs, stream=stream))
    res["fusec_graph"] = time_cuda(lambda: plan.run(inputs, stream=stream))
    res["fusec_stats"] = plan.stats()
    return res


def main() -> None:
    out_path = sys.argv[1]
    names = sys.argv[2:] or list(WORKLOADS)
    results = []
    for n in names:
        try:
            r = run(n)
        except Exception as e:  # keep going: one workload's failure must not hide the others
            import traceback

            traceback.print_exc()
            r = {"workload": n, "error": f"{type(e).__name__}: {e}"}
        results.append(r)
        with open(out_path, "w") as f:
            json.dump(results, f, indent=2)
    print(f"{'workload':<26}{'err':>9}{'torch eager':>13}{'torch.compile':>15}{'fusec eager':>13}{'fusec graph':>13}{'launches':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['workload']:<26} ERROR {r['error'][:90]}")
            continue
        print(f"{r['workload']:<26}{r['rel_err_vs_torch']:>9.1e}{r['torch_eager']['median_ms']:>13.3f}"
              f"{r['torch_compile']['median_ms']:>15.3f}{r['fusec_eager']['median_ms']:>13.3f}"
              f"{r['fusec_graph']['median_ms']:>13.3f}{r['launches']:>10}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
