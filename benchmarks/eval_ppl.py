"""Quality of packed / quantized weights: perplexity on a real text and logit differences (a script).

    python benchmarks/eval_ppl.py MODEL [--tokens 256] [--quantize int4|int8 [--quantize-group 32|128]] [--dp4a-activations]
                                  [--backend reference|cuda] [--dtype fp32|bf16] [--chat PROMPT] [--out DIR]

Two plans of the same model read the same text (``benchmarks/data/austen_pride_ch1.txt``: the first
chapter of Jane Austen's *Pride and Prejudice*, 1813, public domain), as one forward pass over its
first ``--tokens`` tokens:

- MODEL a GGUF file: its weights kept packed (``load_gguf``, what fusec compiles by default) against
  the same file dequantized at load (``packed=False``, what fusec did before);
- otherwise (a built-in name, an HF checkpoint directory, an ONNX file) or with ``--quantize``: the
  model quantized by fusec (``--quantize``) against the unquantized model (a GGUF file: its weights
  dequantized at load, then quantized by fusec).

Reported: each perplexity (exp of the mean negative log-likelihood of every next token), their
ratio, and the max / mean absolute difference of the logits. ``--chat PROMPT`` also generates a
greedy answer (24 tokens, the model's chat template) from the packed/quantized weights.
``--backend reference`` (default) runs fusec's numpy reference on the CPU (SmolLM2-135M, 256 tokens:
about a minute); ``--backend cuda`` compiles plans. Writes DIR/eval.json and DIR/eval.md (--out).

    python benchmarks/eval_ppl.py $(python -c "from fusec.models.gguf import find_smollm2; print(find_smollm2())") \\
        --chat "What is the capital of France?" --out /tmp/eval
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

TEXT = Path(__file__).resolve().parent / "data" / "austen_pride_ch1.txt"


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean over i of -log softmax(logits[i])[ids[i + 1]]) in fp64."""
    lg = logits.astype(np.float64)[:-1]
    lg -= lg.max(axis=-1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(axis=-1, keepdims=True))
    return float(math.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def _graphs(model: str, n: int, args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any], dict[str, Any], Any]:
    """(graph A, graph B, pass options A, pass options B, tokenizer): A is the packed/quantized side."""
    shapes = {"input_ids": (1, n), "attention_mask": (1, n)}
    q = {}
    if args.quantize:
        q = {"quantize": args.quantize, "quantize_group": args.quantize_group}
    if model.lower().endswith(".gguf") and not args.quantize:
        from fusec.models.gguf import build_gguf, load_gguf

        tok = load_gguf(model).tokenizer
        return build_gguf(model, shapes), build_gguf(model, shapes, packed=False), {}, {}, tok
    from fusec.loader import load_graph

    tok = None
    if model.lower().endswith(".gguf"):  # fusec's quantizer over the file's weights dequantized
        from fusec.models.gguf import build_gguf, load_gguf

        g = build_gguf(model, shapes, packed=False)
        tok = load_gguf(model).tokenizer
        return g, g, q, {}, tok
    g = load_graph(model, shapes)
    if os.path.isdir(model):
        from fusec.text import Tokenizer

        tok = Tokenizer.from_hf_dir(Path(model))
    return g, g, q, {}, tok


class _Dp4aActivations:
    """While entered: the reference's products over packed weights read x as the dp4a decode form
    represents it (``fusec.quant.dp4a_blocks``: two 8-bit digits, per 32 values), so a forward pass shows
    what that form costs in perplexity (each row's blocks are its own: the same as one token a step)."""

    def __enter__(self) -> None:
        from fusec import quant

        self.quant, self.matmul = quant, quant.matmul
        quant.matmul = lambda x, *a, **kw: self.matmul(quant.dp4a_blocks(x), *a, **kw)

    def __exit__(self, *exc: object) -> None:
        self.quant.matmul = self.matmul


def _run(graph: Any, options: dict[str, Any], ids: np.ndarray, args: argparse.Namespace) -> np.ndarray:
    feeds = {"input_ids": ids[None, :].astype(np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    if args.backend == "cuda":
        import fusec

        plan = fusec.compile(graph, dtype=args.dtype, **options)
        out = plan.run(feeds)["logits"]
        arr = out.get()
        return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)[0] if args.dtype == "bf16" else arr[0]
    from fusec import reference
    from fusec.passes.base import PassOptions
    from fusec.passes.pipeline import optimize

    g, _ = optimize(graph, PassOptions(**options))
    return reference.run(g, feeds)["logits"][0].astype(np.float32)


def _chat(model: str, prompt: str, args: argparse.Namespace) -> str:
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, encode_prompts, load_generation_model
    from fusec.passes.base import PassOptions

    gm = load_generation_model(model, packed=not args.quantize)  # --quantize: fusec quantizes the dequantized file
    ids = encode_prompts(gm.tokenizer, [prompt], chat=True)
    q = {"quantize": args.quantize, "quantize_group": args.quantize_group} if args.quantize else {}
    t = len(ids[0]) + 24
    if args.backend == "cuda":
        from fusec.compiler import compile_generation
        from fusec.runtime.generation import generate_with_plan

        plan = compile_generation(gm, batch=1, max_seq_len=t, prefill_len=len(ids[0]), dtype=args.dtype, **q)
        res = generate_with_plan(plan, ids, max_new_tokens=24)
    else:
        eng = ReferenceEngine(build_graphs(gm, 1, t, len(ids[0])), optimize=True,
                              options=PassOptions(**q) if q else None)
        res = generate(eng, ids, 24, gm.config.vocab_size)
    return gm.tokenizer.decode(res.new_ids[0]) if gm.tokenizer is not None else str(res.new_ids[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--quantize", choices=("int8", "int4"), default=None)
    ap.add_argument("--quantize-group", type=int, choices=(32, 128), default=128)
    ap.add_argument("--backend", choices=("reference", "cuda"), default="reference")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="--backend cuda: the plans' dtype")
    ap.add_argument("--chat", default=None, metavar="PROMPT")
    ap.add_argument("--text", default=str(TEXT))
    ap.add_argument("--out", default=None, metavar="DIR")
    ap.add_argument("--dp4a-activations", action="store_true",
                    help="--backend reference: the packed side's products read x as the dp4a decode form represents it "
                         "(two 8-bit digits per value, per 32 values: fusec.quant.dp4a_blocks)")
    args = ap.parse_args()
    if args.dp4a_activations and args.backend != "reference":
        ap.error("--dp4a-activations emulates the dp4a form in the reference backend")
    t0 = time.perf_counter()
    text = Path(args.text).read_text(encoding="utf-8")
    ga, gb, oa, ob, tok = _graphs(args.model, 8, args)  # the tokenizer first: the text decides the length
    if tok is None:
        rng = np.random.default_rng(0)
        ids = rng.integers(0, 1000, args.tokens)
        source = "random token ids (the model has no tokenizer)"
    else:
        ids = np.asarray(tok.encode(text), np.int64)[:args.tokens]
        source = f"{Path(args.text).name} ({len(ids)} tokens)"
    ga, gb, oa, ob, _ = _graphs(args.model, len(ids), args)
    with _Dp4aActivations() if args.dp4a_activations else contextlib.nullcontext():
        la = _run(ga, oa, ids, args)
    lb = _run(gb, ob, ids, args)
    diff = np.abs(la.astype(np.float64) - lb)
    side = f"--quantize {args.quantize}" + (f" (group {args.quantize_group})" if args.quantize == "int4" else "") \
        if args.quantize else "GGUF packed"
    if args.dp4a_activations:
        side += ", x as the dp4a form has it"
    base = "GGUF dequantized at load" if args.model.lower().endswith(".gguf") else "unquantized"
    rec: dict[str, Any] = {"model": os.path.basename(args.model), "text": source, "backend": args.backend,
                           "dtype": args.dtype if args.backend == "cuda" else "fp32", "a": side, "b": base,
                           "ppl_a": perplexity(la, ids), "ppl_b": perplexity(lb, ids),
                           "logit_max_abs_diff": float(diff.max()), "logit_mean_abs_diff": float(diff.mean()),
                           "logit_std": float(lb.std())}
    rec["ppl_ratio"] = rec["ppl_a"] / rec["ppl_b"]
    if args.chat:
        with _Dp4aActivations() if args.dp4a_activations else contextlib.nullcontext():
            rec["chat_prompt"], rec["chat_answer"] = args.chat, _chat(args.model, args.chat, args)
    rec["seconds"] = time.perf_counter() - t0
    md = "\n".join([
        f"# eval_ppl: {rec['model']} ({rec['backend']}, {rec['dtype']})", "",
        f"text: {rec['text']}", "",
        "| weights | perplexity |", "| --- | --- |",
        f"| {rec['a']} | {rec['ppl_a']:.4f} |", f"| {rec['b']} | {rec['ppl_b']:.4f} |", "",
        f"perplexity ratio {rec['ppl_ratio']:.5f}; logits: max |diff| {rec['logit_max_abs_diff']:.4g}, "
        f"mean |diff| {rec['logit_mean_abs_diff']:.4g} (logit std {rec['logit_std']:.3g})",
        *(["", f"chat ({rec['a']}): {json.dumps(rec['chat_prompt'])} -> {json.dumps(rec['chat_answer'])}"]
          if args.chat else []),
        "", f"{rec['seconds']:.0f} s"]) + "\n"
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(rec, indent=1))
        (out / "eval.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
