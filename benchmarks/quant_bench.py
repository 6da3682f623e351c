"""Packed quantized weights on the GPU: per-kernel bandwidth and decode speed (a script, not a test).

    python benchmarks/quant_bench.py OUT_DIR [--quick]

1. **Kernels** (``qgemv``): the quantized GEMV at M = 1 (and 8) for the weight shapes of Qwen3-0.6B,
   Llama-3.2-1B (d 2048, ffn 8192, 32/8 heads) and a 7B-class Llama (d 4096, ffn 11008), per format
   (GGUF Q4_K, Q6_K, Q8_0; fusec's int4 g128 and int8), against fusec's bf16 GEMV of the same shape
   and a 1 GiB device copy. Each timing is the median over repeats of a CUDA graph of many launches
   rotating over enough copies of the weight that the working set exceeds L2; bytes = the packed
   operands + x + the output, so GB/s is the bandwidth the kernel reaches (``pct_copy`` of the copy).
   M = 8: the GEMV against the dequantize-into-scratch + cuBLAS path the prefill uses.
2. **PyTorch int4 peer**: ``torch.ops.aten._weight_int4pack_mm`` (gpt-fast's int4 kernel, group 128)
   on the same shapes, when this torch has it for this GPU (else the error is recorded).
3. **Decode**: a Llama-3.2-1B-shaped model (16 layers, vocab 128,256, untied LM head) whose weights are
   random GGUF blocks in llama.cpp's Q4_K_M type mix (Q4_K, Q6_K for the LM head and some attn_v /
   ffn_down) and in Q8_0, repacked as fusec loads a GGUF file (``RandomPackedWeights``: the same
   path without the file, so no ``gguf`` package is needed here), against the bf16 plan of the same
   (dequantized) Q4_K_M weights: ``plan.generate`` tok/s at batch 1 and 8, 16-token prompts, 128 new
   tokens, CUDA graphs. Plans compile in parallel helper processes. ``--7b`` decodes the 7B Llama
   shape in Q4_K_M at batch 1 instead and reports its share of the packed-weight roofline.

``--variants`` times the quantized GEMV's forms (FMA; tensor cores at 4, 8, 16 warps) on Llama-1B's shapes.
Writes OUT_DIR/quant.json and OUT_DIR/quant.md and prints the tables. ~3-4 minutes on an H100.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_kernels import copy_bw, graph_time  # noqa: E402
from peer_kernels import graph_us  # noqa: E402

from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen import specs as S  # noqa: E402
from fusec.codegen.build_gemm import gemv_form as bf16_form  # noqa: E402
from fusec.codegen.specs_quant import QDequantSpec, QGemvSpec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402
from fusec.runtime.generation import generate_with_plan  # noqa: E402

BF16 = DType.BF16
L2_ROTATE = 256 << 20
SHAPES = {  # model -> [(name, N, K)]
    "qwen3-0.6b": [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
                   ("lm_head", 151936, 1024)],
    "llama-1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                 ("lm_head", 128256, 2048)],
    "llama-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
}
FORMATS = [("q4_k", "Q4_K"), ("q6_k", "Q6_K"), ("q8_0", "Q8_0"), ("uint4", "int4-g128"), ("int8", "int8")]


def packed_copies(qw, most: int = 16) -> list[list]:  # noqa: ANN001
    """Device copies of a packed weight's arrays, enough (up to ``most``) to rotate through past L2_ROTATE bytes."""
    import cupy as cp

    return [[cp.asarray(a) for a in qw.arrays] for _ in range(max(1, min(most, -(-L2_ROTATE // qw.nbytes))))]


def _weight(fmt: str, n: int, k: int, rng: np.random.Generator):  # noqa: ANN202
    from fusec.quant import from_affine
    from fusec.quant_gguf import random_blocks, repack

    gguf = {"q4_k": "Q4_K", "q6_k": "Q6_K", "q8_0": "Q8_0"}.get(fmt)
    if gguf is not None:
        return repack(random_blocks(gguf, n, k, rng), gguf, n, k, fmt)
    if fmt == "int8":
        return from_affine(rng.integers(-127, 128, (n, k)).astype(np.int8),
                           rng.uniform(1e-3, 2e-3, (n, 1)).astype(np.float16), None, 8)
    return from_affine(rng.integers(0, 16, (n, k)).astype(np.uint8), rng.uniform(1e-3, 2e-3, (n, k // 128)).astype(np.float16),
                       rng.integers(0, 16, (n, k // 128)).astype(np.uint8), 4)


def _bf16(shape: tuple[int, ...]):  # noqa: ANN202
    import cupy as cp

    return (cp.random.standard_normal(shape, dtype=cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)


def _forms(m: int, n: int, qw, variants: bool) -> list[tuple[str, dict]]:  # noqa: ANN001
    """The quantized GEMV's forms to time at M = ``m`` over ``n`` rows of ``qw``'s format and K (bf16 x): the
    lowering's choice (fusec.lower.quant), or with ``variants`` the FMA form and, where they fit, the
    tensor-core form at 4, 8 and 16 warps and the dp4a form at several rows a task and warps a block."""
    from fusec.codegen.specs_quant import dp4a_fits, tc_fits
    from fusec.lower.qgemv_form import gemv_form

    rule = gemv_form(m, n, qw.k, qw.format, qw.group, BF16)
    if not variants:
        return [("qgemv tc" if rule.get("tc") else "qgemv dp4a" if rule.get("dp4a") else "qgemv", rule)]
    fma = {"rows": 2 if m <= 8 else 1, "fold": m == 1}
    forms = [("fma", fma)]
    if tc_fits(m, qw.format, BF16):
        from fusec.lower.qgemv_form import _tc_fits_smem

        for w in (4, 8, 16):  # the fewest runs whose copy fits its shared memory (as the rule takes them)
            passes = next((p for p in range(1, 5) if _tc_fits_smem(qw.k, qw.group, w, qw.format, p)), 0)
            if passes:
                forms.append((f"tc w{w}{f' p{passes}' if passes > 1 else ''}"
                              f"{' (rule)' if rule.get('tc') and rule['warps'] == w else ''}",
                              {**fma, "tc": True, "warps": w, **({"passes": passes} if passes > 1 else {})}))
    with mock.patch.dict(os.environ, {"FUSEC_QGEMV_FORM": "dp4a"}):  # the rule without the tensor-core form
        d = gemv_form(m, n, qw.k, qw.format, qw.group, BF16)
    if d.get("dp4a") and not rule.get("dp4a"):
        forms.append(("dp4a (FUSEC_QGEMV_FORM=dp4a's rule)", d))
    if dp4a_fits(m, qw.k, False, BF16):
        forms += [(f"dp4a r{r} w{w} b{b}{' (rule)' if rule.get('dp4a') and (rule['rows'], rule['warps'], rule['blocks']) == (r, w, b) else ''}",
                   {"dp4a": True, "rows": r, "warps": w, "blocks": b})
                  for r, w, b in ((1, 8, 1), (1, 8, 2), (1, 8, 3), (1, 8, 4), (2, 8, 2), (2, 8, 3), (2, 8, 4))]
    if not any(name.endswith("(rule)") for name, _ in forms):  # the rule's own form (chunks, fill, clusters...)
        forms.append(("tc (rule)" if rule.get("tc") else "dp4a (rule)" if rule.get("dp4a") else "fma (rule)", rule))
    return forms


def bench_kernels(results: list, quick: bool, copy: float, variants: bool = False, only: str = "") -> None:
    import cupy as cp

    from fusec.runtime.cublas import GemmCall, Handle

    rng = np.random.default_rng(0)
    h = Handle()
    models = ["llama-1b"] if quick or variants else list(SHAPES)
    formats = [(f, lab) for f, lab in FORMATS if not quick or f in ("q4_k", "q8_0")]
    if variants:  # the formats of llama.cpp's Q4_K_M and Q8_0 files
        formats = [(f, lab) for f, lab in formats if f in (only.split(",") if only else ("q4_k", "q6_k", "q8_0"))]
    ms = (1, 2, 3, 4, 8) if variants else (1,) if quick else None
    pending = []  # every kernel compiles on the pool first (the loop below then finds them built)
    for model in models:
        for _, n, k in SHAPES[model]:
            for m in ms or ((1, 8) if model == "llama-1b" else (1,)):
                pending.append(K.build_async(S.GemvSpec(m, n, k, BF16, **bf16_form(n, k, BF16))))
                for fmt, _ in formats:
                    small = _weight(fmt, 4, k, rng)  # the format's group and scale type at this K
                    for _, form in _forms(m, n, small, variants):
                        pending.append(K.build_async(QGemvSpec(m, n, k, small.format, small.group, BF16,
                                                               small.scale_dtype, **form)))
    for p in pending:
        p.result()
    for model in models:
        for name, n, k in SHAPES[model]:
            nb = n * k * 2
            ws = [_bf16((n, k)) for _ in range(max(1, min(8, -(-L2_ROTATE // nb))))]
            packed = {}  # format -> (weight, device copies rotated past L2); made once for every M
            for fmt, _ in formats:
                qw = _weight(fmt, n, k, rng)
                packed[fmt] = (qw, packed_copies(qw))
            for m in ms or ((1, 8) if model == "llama-1b" else (1,)):
                x = _bf16((m, k))
                out = cp.empty((m, n), cp.uint16)
                # bf16 GEMV baseline (fusec's decode GEMV over [N, K] bf16)
                ck = K.build(S.GemvSpec(m, n, k, BF16, **bf16_form(n, k, BF16)))
                us = graph_time([lambda s, w=w, ck=ck, x=x, out=out: K.launch(ck, [x, w, out], stream=s) for w in ws])
                byt = nb + (m * k + m * n) * 2
                results.append({"bench": "kernel", "model": model, "shape": name, "N": n, "K": k, "M": m,
                                "format": "bf16", "kernel": "gemv", "us": us, "bytes": byt,
                                "GBps": byt / us * 1e-3, "pct_copy": 100 * byt / us * 1e6 / copy})
                for fmt, label in formats:
                    qw, sets = packed[fmt]
                    for kname, form in _forms(m, n, qw, variants):
                        spec = QGemvSpec(m, n, k, qw.format, qw.group, BF16, qw.scale_dtype, **form)
                        ck = K.build(spec)
                        us = graph_time([lambda s, p=p, ck=ck, x=x, out=out: K.launch(ck, [x, *p, out], stream=s)
                                         for p in sets])
                        byt = qw.nbytes + (m * k + m * n) * 2
                        results.append({"bench": "kernel", "model": model, "shape": name, "N": n, "K": k, "M": m,
                                        "format": label, "kernel": kname, "us": us, "bytes": byt,
                                        "GBps": byt / us * 1e-3, "pct_copy": 100 * byt / us * 1e6 / copy,
                                        "regs": ck.binary.registers, "bits_per_weight": 8 * qw.nbytes / (n * k)})
                    if m > 1 and name != "lm_head" and not variants:  # the prefill path at the same M, for the crossover
                        dq = K.build(QDequantSpec(n, k, qw.format, qw.group, BF16, qw.scale_dtype))
                        scratch = cp.empty((n, k), cp.uint16)
                        call = GemmCall(m=m, n=n, k=k, batch=1, a=x.data.ptr, b=scratch.data.ptr, c=out.data.ptr,
                                        lda=k, ldb=k, ldc=n, stride_a=0, stride_b=0, stride_c=0, trans_a=False,
                                        trans_b=True, dtype="bf16", compute="f32")

                        def dq_gemm(s, p, dq=dq, scratch=scratch, call=call, h=h) -> None:  # noqa: ANN001
                            K.launch(dq, [*p, scratch], stream=s)
                            call(h, s.ptr)

                        us = graph_time([lambda s, p=p, f=dq_gemm: f(s, p) for p in sets])
                        results.append({"bench": "kernel", "model": model, "shape": name, "N": n, "K": k, "M": m,
                                        "format": label, "kernel": "dequant+cublas", "us": us, "bytes": byt,
                                        "GBps": byt / us * 1e-3, "pct_copy": 100 * byt / us * 1e6 / copy})
                        del scratch
                print(f"  kernels {model} {name} M={m} done", flush=True)
            del ws, packed


def bench_torch_int4(results: list, quick: bool, copy: float) -> None:
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        op = torch.ops.aten._weight_int4pack_mm
    except Exception as e:  # noqa: BLE001 -- recorded: the peer does not run here
        results.append({"bench": "torch_int4", "error": f"{type(e).__name__}: {e}"[:300]})
        return
    models = ["llama-1b"] if quick else list(SHAPES)
    for model in models:
        for name, n, k in SHAPES[model]:
            try:
                w = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
                packed_w = torch.ops.aten._convert_weight_to_int4pack(
                    (w[:, ::2] << 4 | w[:, 1::2]).to(torch.uint8), 8)
                sz = torch.rand(k // 128, n, 2, dtype=torch.bfloat16, device="cuda") * 1e-3
                x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
                copies = max(1, min(16, -(-L2_ROTATE // (n * k // 2))))
                ws = [packed_w.clone() for _ in range(copies)]
                turn = iter(range(1 << 30))

                def call(ws=ws, sz=sz, x=x, turn=turn) -> None:  # the next copy each launch (rotated past L2)
                    op(x, ws[next(turn) % len(ws)], 128, sz)

                us = graph_us(call, reps=max(20, copies))
                byt = n * k // 2 + sz.numel() * 2 + (k + n) * 2
                results.append({"bench": "torch_int4", "model": model, "shape": name, "N": n, "K": k, "M": 1,
                                "us": us, "bytes": byt, "GBps": byt / us * 1e-3, "pct_copy": 100 * byt / us * 1e6 / copy})
            except Exception as e:  # noqa: BLE001
                results.append({"bench": "torch_int4", "model": model, "shape": name, "error": f"{type(e).__name__}: {e}"[:300]})


# ---- decode -----------------------------------------------------------------------------------------

LAYERS, VOCAB, PROMPT, NEW = 16, 128256, 16, 128


class _Dequantized:
    """A weight source handing out its packed weights dequantized (the bf16 plan of the same weights)."""

    def __init__(self, source: object):
        self.source = source

    def get(self, name: str, shape: tuple[int, ...], kind: str):  # noqa: ANN201
        qw = self.source.get_packed(name, shape)  # type: ignore[attr-defined]
        return qw.dequantize() if qw is not None else self.source.get(name, shape, kind)  # type: ignore[attr-defined]

    def finish(self) -> None:
        pass


def _model(mix: str, layers: int, size: str = "1b"):  # noqa: ANN202
    import dataclasses

    from fusec.genmodel import GenModel
    from fusec.models import get_config
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomPackedWeights, q4_k_m_types

    dims = {"1b": dict(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
                       vocab_size=VOCAB),
            "7b": dict(hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, head_dim=128,
                       vocab_size=32000),
            "13b": dict(hidden_size=5120, intermediate_size=13824, num_heads=40, num_kv_heads=40, head_dim=128,
                        vocab_size=32000)}[size]
    cfg = dataclasses.replace(get_config("llama-tiny"), name=f"llama-{size}-{mix}", num_layers=layers,
                              tie_word_embeddings=False, max_positions=4096, **dims)
    types = q4_k_m_types(layers) if mix != "q8_0" else (lambda name: "Q8_0")
    src: object = RandomPackedWeights(types, seed=0, scale=0.02)
    if mix == "bf16":
        src = _Dequantized(RandomPackedWeights(q4_k_m_types(layers), seed=0, scale=0.02))
    return GenModel(cfg, SharedWeights(src), None, (), cfg.name)


def compile_job(job: dict) -> dict:
    """In a helper process: compile one generation plan and save it (returns timings or the error)."""
    os.environ["FUSEC_CUPTI"] = "0"
    os.environ["FUSEC_QGEMV_FORM"] = job.get("form", "auto")  # the packed products' form (fusec.knobs)
    from fusec.compiler import compile_generation

    t0 = time.perf_counter()
    try:
        plan = compile_generation(_model(job["mix"], job["layers"], job.get("size", "1b")), batch=job["batch"],
                                  max_seq_len=PROMPT + NEW,
                                  prefill_len=PROMPT, dtype="bf16", arch=job["arch"], eos_ids=[])
        plan.save(job["path"])
        return {"compile_s": time.perf_counter() - t0, "weights_bytes": plan.manifest["memory"]["weights_bytes"]}
    except Exception as e:  # noqa: BLE001 -- reported in the results
        return {"error": f"{type(e).__name__}: {e}"[:1000]}


def bench_decode(results: list, quick: bool, tmp: Path, seven_b: bool = False, copy: float = 0.0,
                 forms: tuple[str, ...] = ("auto",)) -> None:
    """Decode tok/s of the Llama-1B-shaped plans (bf16, Q4_K_M, Q8_0 at batch 1 and 8); ``seven_b``:
    instead the 7B Llama shape (32 layers, d 4096, ffn 11008, vocab 32,000) in Q4_K_M at batch 1,
    with the share of its packed-weight roofline (weights bytes / ``copy`` bandwidth per step).
    ``forms``: the packed plans once per packed-product form (FUSEC_QGEMV_FORM), timed in this process."""
    import fusec
    from fusec.codegen.compile import default_arch

    layers = 4 if quick else LAYERS
    jobs = [{"mix": mix, "batch": b, "layers": layers, "arch": default_arch(), "form": form,
             "path": str(tmp / f"{mix}-b{b}-{form}.fplan")}
            for form in forms for mix in ("bf16", "q4_k_m", "q8_0") for b in ((1,) if quick else (1, 8))
            if form == forms[0] or mix != "bf16"]
    if seven_b:
        jobs = [{"mix": "q4_k_m", "batch": 1, "layers": 32, "size": "7b", "arch": default_arch(),
                 "path": str(tmp / "q4_k_m-7b-b1.fplan")}]
    import multiprocessing

    with ProcessPoolExecutor(max_workers=min(len(jobs), 6), mp_context=multiprocessing.get_context("spawn")) as ex:
        infos = list(ex.map(compile_job, jobs))
    rng = np.random.default_rng(1)
    for job, info in zip(jobs, infos):
        rec = {"bench": "decode", "mix": job["mix"], "batch": job["batch"], "form": job.get("form", "auto"),
               "layers": layers, "vocab": VOCAB,
               "prompt": PROMPT, "new_tokens": NEW, **info}
        if "error" not in info:
            plan = fusec.load(job["path"])
            vocab = int(plan.manifest["generation"]["vocab_size"])
            prompts = [list(map(int, rng.integers(0, vocab, PROMPT))) for _ in range(job["batch"])]
            generate_with_plan(plan, prompts, max_new_tokens=8)  # device setup, graph capture
            gen = generate_with_plan(plan, prompts, max_new_tokens=NEW)
            rec.update({"decode_tok_s": gen.decode_tok_s, "decode_ms": gen.decode_ms, "prefill_ms": gen.prefill_ms,
                        "steps": gen.decode_steps, "size": job.get("size", "1b")})
            if copy and "weights_bytes" in info:  # the step's floor: every weight read once at copy bandwidth
                rec["pct_roofline"] = 100 * (info["weights_bytes"] / copy) * gen.decode_tok_s / job["batch"]
            del plan
            os.unlink(job["path"])
        results.append(rec)
        print(f"  decode {rec}", flush=True)


# ---- report -----------------------------------------------------------------------------------------

def _md(results: list, copy: float) -> str:
    lines = ["# Packed quantized weights (benchmarks/quant_bench.py)", "",
             f"device copy bandwidth: {copy / 1e9:.0f} GB/s (1 GiB device-to-device, read + write)", "",
             "## Kernels (median us per launch, CUDA graph, weights rotated past L2)", "",
             "| model | shape | N x K | M | format | kernel | us | GB/s | % copy | bits/w |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if r["bench"] == "kernel":
            lines.append(f"| {r['model']} | {r['shape']} | {r['N']}x{r['K']} | {r['M']} | {r['format']} | {r['kernel']} | "
                         f"{r['us']:.2f} | {r['GBps']:.0f} | {r['pct_copy']:.0f} | {r.get('bits_per_weight', 16):.2f} |")
    lines += ["", "## PyTorch int4 peer (aten._weight_int4pack_mm, group 128, M = 1)", ""]
    for r in results:
        if r["bench"] == "torch_int4":
            lines.append(f"- {r.get('model', '')} {r.get('shape', '')}: " + (
                f"error {r['error']}" if "error" in r else f"{r['us']:.2f} us, {r['GBps']:.0f} GB/s ({r['pct_copy']:.0f}% copy)"))
    lines += ["", "## Decode (Llama shapes, plan.generate, 128 new tokens)", "",
              "| model | weights | packed form | batch | tok/s | x bf16 | % packed-weight roofline | weights on GPU | prefill ms | compile s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["batch"]: r.get("decode_tok_s") for r in results if r["bench"] == "decode" and r.get("mix") == "bf16"}
    for r in results:
        if r["bench"] == "decode":
            if "error" in r:
                lines.append(f"| | {r.get('mix', '?')} | {r.get('form', '')} | {r.get('batch', '?')} | error: {r['error'][:120]} | | | | | |")
                continue
            ratio = r["decode_tok_s"] / base[r["batch"]] if base.get(r["batch"]) else float("nan")
            roof = f"{r['pct_roofline']:.0f}%" if "pct_roofline" in r else "-"
            lines.append(f"| {r.get('size', '1b')} | {r['mix']} | {r.get('form', '')} | {r['batch']} | {r['decode_tok_s']:.0f} | {ratio:.2f} | "
                         f"{roof} | {r['weights_bytes'] / 2**20:.0f} MiB | {r['prefill_ms']:.1f} | {r['compile_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true", help="one model's shapes, two formats, a 4-layer decode model")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels,torch,decode")
    ap.add_argument("--7b", dest="seven_b", action="store_true", help="decode: the 7B Llama shape in Q4_K_M at "
                    "batch 1 (with its share of the packed-weight roofline) instead of the 1B plans")
    ap.add_argument("--variants", action="store_true", help="kernels: the quantized GEMV's forms (FMA; tensor cores "
                    "at 4, 8, 16 warps) on Llama-1B's shapes at M = 1, 2, 3, 4 and 8")
    ap.add_argument("--formats", default="", help="with --variants: the formats to time (comma list; default q4_k, "
                    "q6_k, q8_0)")
    ap.add_argument("--qgemv-forms", default="auto", help="decode: the packed plans once per packed-product form "
                    "(comma list of auto, tc, dp4a, fma: FUSEC_QGEMV_FORM), timed in the same process")
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    results: list = []
    copy = copy_bw()
    parts: list[tuple[str, Callable[[], None]]] = [
        ("decode", lambda: bench_decode(results, args.quick, out, args.seven_b, copy,
                                        tuple(args.qgemv_forms.split(",")))),  # its plans compile while nothing else runs
        ("kernels", lambda: bench_kernels(results, args.quick, copy, args.variants, args.formats)),
        ("torch", lambda: bench_torch_int4(results, args.quick, copy))]
    for name, fn in parts:
        if name in skip:
            continue
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 -- the other parts still run and report
            import traceback

            traceback.print_exc()
            results.append({"bench": name, "error": f"{type(e).__name__}: {e}"[:1000]})
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    (out / "quant.json").write_text(json.dumps({"copy_Bps": copy, "results": results,
                                                 "seconds": time.perf_counter() - t0}, indent=1))
    md = _md(results, copy)
    (out / "quant.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
