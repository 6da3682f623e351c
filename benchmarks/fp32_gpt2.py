"""GPT-2 small in fp32 and tf32: fusec against torch eager and torch.compile, all measured
against a float64 torch reference (GPU only). Same process, same weights, same inputs.

fusec's fp32 cases: ``fusec_fp32`` is the default (weight products as one 3xTF32 tensor-core GEMM,
passes/split_tf32.py; attention on 3xTF32 tensor cores), ``fusec_fp32_sgemm`` the same plan with
``fp32_gemm="sgemm"`` (cuBLAS's exact-fp32 SGEMM, the earlier default), ``fusec_fp32_simt_attention``
the default with the SIMT attention kernel. Both main cases record their 12 slowest launches
(``profile``) and their weight bytes; ``ratios`` compares them with torch.compile's fp32 default.

    python benchmarks/fp32_gpt2.py out.json [B S]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_models import hf_model, time_cuda  # noqa: E402


def main() -> None:
    import cupy
    import torch

    import fusec
    from fusec.codegen import specs as S
    from fusec.models import build

    out_path = sys.argv[1]
    b, s = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (8, 128)
    model = hf_model("gpt2-small", "gpt2")
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d, safe_serialization=True)
        graph = build("gpt2-small", shapes={"input_ids": (b, s), "attention_mask": (b, s)}, weights_dir=d)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.config.vocab_size, size=(b, s))
    mask = np.ones((b, s), np.int64)
    t_ids, t_mask = torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda()
    with torch.no_grad():
        ref = model.to("cuda", torch.float64)(input_ids=t_ids, attention_mask=t_mask).logits
    model = model.to(torch.float32)
    rel = lambda x: float((x.double() - ref).norm() / ref.norm())  # noqa: E731
    maxabs = lambda x: float((x.double() - ref).abs().max())  # noqa: E731
    inputs = {"input_ids": cupy.asarray(ids), "attention_mask": cupy.asarray(mask)}
    stream = cupy.cuda.get_current_stream()
    res: dict = {"shape": [b, s], "device": torch.cuda.get_device_name()}

    def fusec_case(name: str, dtype: str, attn_math: str | None, fp32_gemm: str = "3xtf32",
                   profile: bool = False) -> None:
        orig = S.AttentionSpec.math
        if attn_math is not None:
            S.AttentionSpec.math = lambda self: attn_math if self.dtype == fusec.dtypes.DType.F32 else orig(self)
        try:
            t0 = time.perf_counter()
            plan = fusec.compile(graph, dtype=dtype, cuda_graph=True, fp32_gemm=fp32_gemm)
            cs = time.perf_counter() - t0
        finally:
            S.AttentionSpec.math = orig
        got = torch.from_dlpack(plan.run(inputs)["logits"])
        res[name] = {"rel_err_vs_f64": rel(got), "max_abs_vs_f64": maxabs(got), "compile_s": cs,
                     "launches": plan.info()["launches"], "time": time_cuda(lambda: plan.run(inputs, stream=stream)),
                     "weights_bytes": plan.manifest["memory"].get("weights_bytes"),
                     "gemm_compute": sorted({L["compute"] for L in plan.manifest["launches"] if L["type"] == "gemm"})}
        if profile:
            res[name]["profile"] = sorted(plan.profile(inputs, repeats=5), key=lambda p: -p["ms"])[:12]
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "profile"}), flush=True)
        with open(out_path, "w") as f:
            json.dump(res, f, indent=2)

    fusec_case("fusec_fp32", "fp32", None, profile=True)
    fusec_case("fusec_fp32_sgemm", "fp32", None, fp32_gemm="sgemm", profile=True)
    if os.environ.get("FUSEC_BENCH_SIMT", "1") != "0":  # the old attention kernel, for the record (~1 min)
        fusec_case("fusec_fp32_simt_attention", "fp32", "simt")
    fusec_case("fusec_tf32", "tf32", None)
    with torch.no_grad():
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
            tag = "tf32" if tf32 else "fp32"
            got = model(input_ids=t_ids, attention_mask=t_mask).logits
            res[f"torch_eager_{tag}"] = {"rel_err_vs_f64": rel(got), "max_abs_vs_f64": maxabs(got),
                                         "time": time_cuda(lambda: model(input_ids=t_ids, attention_mask=t_mask))}
            if tf32:  # torch.compile's fp32 default is the target's baseline; its tf32 build costs minutes more
                continue
            torch._dynamo.reset()
            t0 = time.perf_counter()
            compiled = torch.compile(model)
            got = compiled(input_ids=t_ids, attention_mask=t_mask).logits
            res[f"torch_compile_{tag}"] = {"rel_err_vs_f64": rel(got), "max_abs_vs_f64": maxabs(got),
                                           "compile_s": time.perf_counter() - t0,
                                           "time": time_cuda(lambda: compiled(input_ids=t_ids, attention_mask=t_mask))}
    base = res["torch_compile_fp32"]["time"]["median_ms"]
    res["ratios"] = {k: res[k]["time"]["median_ms"] / base for k in ("fusec_fp32", "fusec_fp32_sgemm", "fusec_tf32")}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=2)
    print("vs torch.compile fp32:", json.dumps(res["ratios"]))
    for k, v in res.items():
        if isinstance(v, dict) and "time" in v:
            print(f"{k:<28} {v['time']['median_ms']:8.3f} ms   rel err vs f64 {v['rel_err_vs_f64']:.2e}   "
                  f"max abs {v['max_abs_vs_f64']:.2e}")


if __name__ == "__main__":
    main()
