"""``fusec train``: train the built-in intent/slot encoder, or fine-tune a BERT checkpoint for
sequence classification, with a compiled training step (fusec.train)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fusec.cli._common import NORMAL, VERBOSE, add_command, note


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "train", "train a model with a compiled training step",
        "Train MODEL on the JSON-lines file --data and write the trained model to the directory -o.\n"
        "MODEL is `intent-slot` (the built-in joint intent/slot BERT encoder: vocab 1000, d 128, 2 layers,\n"
        "4 heads, ffn 512, sequence 50; records {\"tokens\", \"intent\", \"slots\"} with BIO tags, see\n"
        "`python -m fusec.train.atis_like`) or a Hugging Face BERT checkpoint directory, fine-tuned for\n"
        "sequence classification (records {\"text\", \"label\"}). On a GPU the whole step (forward,\n"
        "backward, AdamW with the schedule and gradient clipping) replays as one CUDA graph over\n"
        "parameters and optimizer state that stay on the device; without one the numpy reference runs\n"
        "the same step (slowly) and says so. After every epoch: the held-out metrics (--eval, else\n"
        "--holdout of --data), OUT/checkpoint.safetensors (for --resume) and the model directory OUT\n"
        "(`fusec compile OUT`/`fusec run OUT` read it; a BERT classifier also loads in transformers).",
        ["python -m fusec.train.atis_like -o atis && fusec train intent-slot --data atis/train.jsonl "
         "--eval atis/heldout.jsonl -o intent-model",
         "fusec train path/to/all-MiniLM-L6-v2 --data data/topics/train.jsonl --eval data/topics/heldout.jsonl "
         "--epochs 3 --batch 16 --lr 5e-5 --seq 32 -o topics-model",
         "fusec train intent-slot --data atis/train.jsonl -o intent-model --resume intent-model/checkpoint.safetensors",
         "fusec run intent-model --backend reference"])
    p.add_argument("model", metavar="MODEL", help="`intent-slot` or a Hugging Face BERT checkpoint directory")
    p.add_argument("--data", metavar="FILE.jsonl", required=True, help="training records, one JSON object per line")
    p.add_argument("--eval", metavar="FILE.jsonl", default=None, help="held-out records (default: --holdout of --data)")
    p.add_argument("-o", "--output", metavar="OUT", required=True, help="directory for the trained model and checkpoints")
    p.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 5e-4; 5e-5 for a fine-tune)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="fp32, or bf16 products with fp32 master weights (default fp32)")
    p.add_argument("--seed", type=int, default=0, help="initialization and shuffling seed (default 0)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 50; 128 for a fine-tune)")
    p.add_argument("--resume", metavar="CHECKPOINT", default=None, help="continue from a checkpoint this command wrote")
    p.add_argument("--backend", choices=("auto", "cuda", "reference"), default="auto",
                   help="where the step runs (default: the GPU when there is one)")
    p.add_argument("--warmup", type=float, default=0.1, help="warmup, as a fraction of the steps (default 0.1)")
    p.add_argument("--schedule", choices=("linear", "cosine", "constant"), default="linear",
                   help="learning-rate decay after warmup (default linear)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (default 0.01)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradients' global norm (0: off)")
    p.add_argument("--holdout", type=float, default=0.1, help="fraction of --data held out without --eval")
    p.add_argument("--log-every", type=int, default=20, help="steps between progress lines (default 20)")
    return p


def run(args: argparse.Namespace) -> int:
    from fusec.cli._common import VERBOSITY
    from fusec.train.loop import TrainOptions
    from fusec.train.loop import run as train

    opts = TrainOptions(model=args.model, data=args.data, out=args.output, eval=args.eval, epochs=args.epochs,
                        batch=args.batch, lr=args.lr, dtype=args.dtype, seed=args.seed, seq=args.seq,
                        resume=args.resume, backend=args.backend, warmup=args.warmup, schedule=args.schedule,
                        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm, holdout=args.holdout,
                        log_every=args.log_every)
    tty = sys.stderr.isatty()
    width = [0]

    def status(line: str) -> None:  # a progress bar on a terminal: one line, rewritten
        if VERBOSITY < NORMAL:
            return
        if tty:
            print("\r" + line.ljust(width[0]), end="", file=sys.stderr, flush=True)
            width[0] = len(line)
        else:
            print(line, file=sys.stderr)

    def say(line: str) -> None:
        if tty and width[0]:
            print(file=sys.stderr)
            width[0] = 0
        note(line)

    def progress(stage: str, item: str) -> None:
        note(f"{stage}: {item}", VERBOSE)

    metrics = train(opts, say, status, progress)
    if tty and width[0]:
        print(file=sys.stderr)
    print(json.dumps({"output": args.output, **metrics}))
    return 0
