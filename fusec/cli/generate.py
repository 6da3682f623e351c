"""``fusec generate MODEL_OR_PLAN --prompt TEXT``: text generation with a KV cache (``fusec.generate``'s
command line; the loop, the backends and the result live in ``fusec.textgen``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from fusec.cli import _common
from fusec.cli._common import add_command, add_json_flag, fmt_name, note
from fusec.errors import InputError

# the most a prompt file or stdin may hold (a prompt is at most a model's context of tokens; this
# is far more, and /dev/zero is one error line, not an out-of-memory)
PROMPT_FILE_LIMIT = 16 << 20


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from fusec.genmodel import support_text

    p = add_command(
        subparsers, "generate", "generate text with a decoder (prefill + KV-cache decode)",
        "Generate tokens from MODEL_OR_PLAN: a generation plan (`fusec compile MODEL --generate`), a\n"
        "built-in decoder (llama-tiny, qwen3-tiny, qwen3-0.6b; random weights unless --weights-dir),\n"
        "a Hugging Face checkpoint directory or hub id (org/name, found in the local Hugging Face\n"
        "cache, never downloaded), or a GGUF file (`fusec inspect FILE.gguf` says what it holds).\n"
        "The tokenizer and chat template come with the model (GGUF metadata, tokenizer.json);\n"
        "--chat-template-kwargs passes switches such as enable_thinking to the template.\n"
        "On a GPU the model is compiled into a plan whose decode step is one CUDA-graph replay per\n"
        "token with nothing copied between host and device; without a GPU the numpy reference\n"
        "backend runs the same graphs (and says so). Decoding is greedy unless --temperature is\n"
        "given (--top-k, --top-p and --seed apply only then; a plan compiles no sampling in, every\n"
        "generation gives its own). Prints the text (as it arrives with --stream), then the load\n"
        "time, prompt and decode tokens/s; -v shows every step with its time.\n\n" + support_text(),
        ["fusec generate SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt 'What is a GPU?' --max-new-tokens 40",
         "fusec generate HuggingFaceTB/SmolLM2-135M-Instruct --chat --system 'Answer briefly.' -f question.txt",
         "echo 'Once upon a time' | fusec generate model.gguf --prompt - --stream",
         "fusec generate qwen3-tiny --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 8 --json",
         "fusec compile qwen3-0.6b --generate --max-seq-len 1024 --batch 8 --dtype bf16 -o q.fplan",
         "fusec generate q.fplan --prompt-ids 10,11,12 --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1",
         "fusec generate Qwen3-0.6B-Q8_0.gguf --chat --chat-template-kwargs '{\"enable_thinking\": false}' "
         "--prompt 'Hi'"])
    p.add_argument("model", metavar="MODEL_OR_PLAN",
                   help="a .fplan generation plan, built-in name, HF directory or hub id, or .gguf file")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt, '-' reads stdin (repeat for a batch)")
    p.add_argument("-f", "--prompt-file", action="append", default=[], metavar="FILE",
                   help="a text prompt read from FILE, '-' for stdin (repeat for a batch; trailing newlines dropped)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each text prompt in the model's chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: the chat's system message")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object of extra template variables for --chat (e.g. '{\"enable_thinking\": false}')")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to draw per sequence (default 32)")
    p.add_argument("--stream", action="store_true", help="print the text as it arrives (with --json: one JSON line per "
                                                         "sequence and chunk, then the result's line)")
    p.add_argument("--stream-every", type=int, default=None, metavar="N",
                   help="with --stream: decode steps per streamed chunk, one read-back each (default 1: every token)")
    add_json_flag(p, "one JSON object (text, prompt_ids, new_ids, finish_reason, token counts, timings, stats)")
    p.add_argument("--stats", action="store_true", help="count and print what the driver does in the prefill and per "
                                                        "decode step (attaches CUPTI on a GPU, which slows decode a little)")
    add_generation_arguments(p)
    return p


JOIN_HELP = ("a join entry: a decode step that prefills up to J new requests (--join alone: 1) into free rows in the same "
             "products, so a request admitted while other rows decode costs a fraction of a step instead of stalling "
             "every row for a prefill (models/join.py; J <= B)")
DEQUANTIZE_HELP = ("a GGUF file's quantized weights dequantized at load to the plan's dtype instead of kept packed: about 3.5x the weight memory of Q4_K_M, for batches where the packed kernels are slower (measured on an H100: packed Q4_K_M 1.67x bf16 at batch 1, 0.64x at batch 8; benchmarks/RESULTS.md)")


def add_generation_arguments(p: argparse.ArgumentParser, for_compile: bool = False) -> None:
    """Options of a generation plan (generate compiles with them; compile --generate too). The
    sampling options default to None: "not given" (see ``sampling_from_args``)."""
    g = p.add_argument_group("generation plan (when compiling)")
    if for_compile:
        g.add_argument("--generate", action="store_true", help="compile a generation plan: prefill + KV-cache decode entries")
    g.add_argument("--batch", type=int, default=None, metavar="B", help="sequences per batch (default: number of prompts)")
    g.add_argument("--max-seq-len", type=int, default=None, metavar="T",
                   help="KV-cache length: prompt + new tokens (default: fits the prompts and --max-new-tokens"
                        + ("; compile: 256, at most the model's context)" if for_compile else ")"))
    g.add_argument("--max-prompt-len", type=int, default=None, metavar="S", help="compiled prefill length (default: min(T, 128))"
                   if for_compile else "compiled prefill length (default: the longest prompt, at least 16)")
    g.add_argument("--weights-dir", default=None, metavar="DIR", help="HF checkpoint for a built-in model's weights")
    g.add_argument("--dequantize", action="store_true", help=DEQUANTIZE_HELP)
    if for_compile:
        g.add_argument("--admit-batch", type=int, default=0, metavar="A",
                       help="also an admit entry prefilling A requests at a time into their rows, for `fusec serve "
                            "PLAN` (default 0: none; A < B)")
        g.add_argument("--join", type=int, nargs="?", const=1, default=0, metavar="J",
                       help="also " + JOIN_HELP + ", for `fusec serve PLAN`")
        return
    from fusec.cli.compile import add_quantize_arguments

    add_quantize_arguments(g)
    s = p.add_argument_group("sampling (per generation: a plan compiles none of it in)")
    s.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    s.add_argument("--temperature", type=float, default=None, metavar="T", help="sample at temperature T > 0 "
                                                                                "(default: greedy)")
    s.add_argument("--top-k", type=int, default=None, metavar="K", help="with --temperature: keep the K most likely tokens")
    s.add_argument("--top-p", type=float, default=None, metavar="P", help="with --temperature: nucleus sampling mass")
    s.add_argument("--seed", type=int, default=None, help="with sampling: the seed (same seed, same tokens; default 0)")
    g.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="storage dtype on the GPU (default bf16)")
    g.add_argument("--arch", metavar="sm_XX", default=None, help="target GPU architecture (default: current GPU, else sm_90)")


def flag(name: str) -> str:
    """A ``fusec.textgen`` argument's command-line spelling."""
    return "--" + name.replace("_", "-")


def sampling_from_args(args: argparse.Namespace) -> tuple[Any, int]:
    """(Sampling, seed) from the sampling options (``fusec.textgen.resolve_sampling``)."""
    from fusec.textgen import resolve_sampling

    return resolve_sampling(args.temperature, args.top_k, args.top_p, args.seed, greedy=args.greedy, flag=flag)


def check_generation_sizes(args: argparse.Namespace) -> None:
    """--batch, --max-seq-len, --max-prompt-len: None (the default) or a positive integer; a 0 is
    refused, never taken as the default."""
    for name in ("batch", "max_seq_len", "max_prompt_len"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")


def _check_options(args: argparse.Namespace) -> None:
    """The generate options that can be wrong on their own, checked before any model loads."""
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    if args.stream_every is not None:
        if args.stream_every < 1:
            raise InputError(f"--stream-every must be a positive integer, got {args.stream_every}")
        if not args.stream:
            raise InputError("--stream-every applies with --stream (without it the text is printed at the end)")
    check_generation_sizes(args)
    if args.chat_template_kwargs is not None and not args.chat:
        raise InputError("--chat-template-kwargs applies to the chat template: add --chat")
    template_kwargs(args)  # checked before any model loads
    if args.chat and args.prompt_ids:
        raise InputError("--chat wraps text prompts (--prompt) in the chat template; --prompt-ids are token ids "
                         "and are never wrapped: drop --chat, or give the prompt as --prompt TEXT")
    if args.system is not None and not args.chat:
        raise InputError("--system is the chat's system message: give it with --chat")
    if args.arch is not None:  # as `fusec run` checks it, also where the reference backend compiles nothing
        from fusec.codegen.compile import check_arch

        check_arch(args.arch, args.dtype or "bf16")


def template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--chat-template-kwargs as a dict of template variables (a JSON object with string keys)."""
    text = getattr(args, "chat_template_kwargs", None)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InputError(f"--chat-template-kwargs is not JSON: {str(e)[:120]}") from None
    if not isinstance(value, dict):
        raise InputError(f"--chat-template-kwargs must be a JSON object, got {type(value).__name__}")
    reserved = {"messages", "add_generation_prompt"} & set(value)
    if reserved:
        raise InputError(f"--chat-template-kwargs cannot set {', '.join(sorted(reserved))} (fusec sets them)")
    return value


def _utf8_prompt(text: str, what: str = "--prompt") -> str:
    """``text`` if it encodes as UTF-8. Bytes in argv that are not UTF-8 reach Python as lone
    surrogates (\\udcXX): an InputError naming --prompt, never a tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        bad = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise InputError(f"{what} is not valid UTF-8 text ({bad} at character {e.start}): give prompts as "
                         "UTF-8") from None
    return text


def _read_prompt(path: str, what: str) -> str:
    """The text of a prompt file ('-': stdin), at most PROMPT_FILE_LIMIT bytes, UTF-8, trailing
    newlines dropped (as the shell's $(...) does)."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(PROMPT_FILE_LIMIT + 1)
        else:
            with open(path, "rb") as f:  # a FIFO (`-f <(cmd)`) is fine: read up to the limit
                data = f.read(PROMPT_FILE_LIMIT + 1)
    except OSError as e:
        raise InputError(f"{what}: cannot read {path!r}: {e.strerror or e}") from None
    if len(data) > PROMPT_FILE_LIMIT:
        raise InputError(f"{what}: {'stdin' if path == '-' else repr(path)} holds more than {PROMPT_FILE_LIMIT} bytes, "
                         "more than any prompt")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} is not valid UTF-8 text ({e.reason} at byte {e.start}): give prompts as UTF-8") from None
    return text.rstrip("\r\n")


def _prompts(args: argparse.Namespace) -> list[Any]:
    """The prompts in the order given: --prompt texts, --prompt-file texts, then --prompt-ids.
    Empty prompts and more prompts than --batch are refused here, before any model loads."""
    if (args.prompt.count("-") + args.prompt_file.count("-")) > 1:
        raise InputError("stdin can be read once: give '-' to one --prompt or --prompt-file")
    out: list[Any] = []
    for i, t in enumerate(args.prompt):
        out.append(_read_prompt("-", f"--prompt {i} (stdin)") if t == "-" else _utf8_prompt(t))
    out += [_read_prompt(path, f"--prompt-file {path!r}") for path in args.prompt_file]
    for text in args.prompt_ids:
        try:
            out.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise InputError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not out:
        raise InputError("give at least one --prompt TEXT, --prompt-file FILE or --prompt-ids IDS")
    for i, p in enumerate(out):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty")
    if args.batch is not None and len(out) > args.batch:
        raise InputError(f"{len(out)} prompts, more than --batch {args.batch}")
    return out


class Steps:
    """The steps of a generation on stderr: with -v each step as it starts, with the time since the
    command started, and each finished step's duration; the durations feed the load-time line."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, float] = {}

    def __call__(self, stage: str, item: str) -> None:
        note(f"[{time.perf_counter() - self.t0:7.2f}s] {stage}: {item[:160]}", _common.VERBOSE)

    def timed(self, stage: str, item: str, fn: Any) -> Any:
        self(stage, item)
        t = time.perf_counter()
        out = fn()
        self.times[stage] = time.perf_counter() - t
        self(stage, f"done in {self.times[stage]:.2f}s")
        return out


def run(args: argparse.Namespace) -> int:
    from fusec import device

    _check_options(args)
    from fusec.cli.compile import quantize_from_args

    quant = quantize_from_args(args)
    sampling, seed = sampling_from_args(args)
    prompts = _prompts(args)
    if args.model.endswith(".fplan"):
        if quant:
            raise InputError(f"{args.model}: a plan's weights are as it was compiled: --quantize applies when compiling "
                             "(`fusec compile MODEL --generate --quantize ...`)")
        return _run_plan(args, prompts, sampling, seed)
    from fusec.genmodel import encode_prompts, load_generation_model
    from fusec.textgen import plan_sizes, prepare

    arch = None
    backend = "cuda" if device.gpu_available() else "reference"
    if backend == "cuda":  # the GPU path compiles: check the toolchain and --arch before loading
        from fusec import toolchain
        from fusec.codegen.compile import check_arch, default_arch

        toolchain.require_compiler()
        arch = check_arch(args.arch or default_arch(), args.dtype or "bf16")
    steps = Steps()
    gm = steps.timed("load", args.model, lambda: load_generation_model(args.model, args.weights_dir,
                                                                                  packed=not args.dequantize))
    ids = encode_prompts(gm.tokenizer, prompts, args.chat, args.system, template_kwargs(args))
    batch, t_max, s_len = plan_sizes(ids, args.max_new_tokens, batch=args.batch, max_seq_len=args.max_seq_len,
                                     max_prompt_len=args.max_prompt_len,
                                     max_positions=getattr(gm.config, "max_positions", None),
                                     vocab=int(gm.config.vocab_size), flag=flag)
    what = "compile a generation plan" if backend == "cuda" else "the reference backend"
    if backend == "reference":
        from fusec import toolchain

        note(f"{toolchain.gpu_missing_reason(with_fix=False) or 'no GPU found'}: running the numpy reference backend")
    engine = steps.timed("prepare", f"{what} (batch {batch}, cache {t_max}, prefill {s_len})",
                         lambda: prepare(gm, batch=batch, max_seq_len=t_max, prefill_len=s_len, backend=backend,
                                         dtype=args.dtype or "bf16", arch=arch, progress=steps, quantize=quant))
    note(f"loaded {fmt_name(gm.source)} in {steps.times['load']:.2f}s, prepared "
         f"{'the plan' if backend == 'cuda' else what} in {steps.times['prepare']:.2f}s")
    return _generate(args, engine, ids, gm.tokenizer, gm.config.vocab_size, sampling, seed, steps, backend)


def _run_plan(args: argparse.Namespace, prompts: list[Any], sampling: Any, seed: int) -> int:
    import fusec
    from fusec.genmodel import encode_prompts, plan_tokenizer
    from fusec.runtime.generation import PlanEngine

    steps = Steps()
    plan = steps.timed("load", args.model, lambda: fusec.load(args.model))
    meta = plan.manifest.get("generation")
    if meta is None:
        raise InputError(f"{args.model}: not a generation plan (compile it with `fusec compile MODEL --generate`)")
    from fusec import toolchain

    why = toolchain.gpu_missing_reason()
    if why is not None:
        raise InputError(f"{args.model}: a generation plan runs only on a GPU: {why}; to run on the CPU, give "
                         f"`fusec generate` the model itself (built-in name, HF directory or .gguf)")
    tok = plan_tokenizer(plan)
    engine = steps.timed("prepare", "upload the weights, capture the decode step", lambda: PlanEngine(plan))
    note(f"loaded {fmt_name(args.model)} in {steps.times['load']:.2f}s")
    ids = encode_prompts(tok, prompts, args.chat, args.system, template_kwargs(args))
    return _generate(args, engine, ids, tok, int(meta["vocab_size"]), sampling, seed, steps, "cuda")


def _generate(args: argparse.Namespace, engine: Any, ids: list[list[int]], tok: Any, vocab: int, sampling: Any,
              seed: int, steps: Steps, backend: str) -> int:
    from fusec.generation import Interrupted
    from fusec.textgen import run as run_generation

    out = _Printer(args, tok, len(ids))
    every = (args.stream_every or 1) if args.stream else 0
    try:
        res = run_generation(engine, ids, tok, vocab, max_new_tokens=args.max_new_tokens, seed=seed, sampling=sampling,
                             stream_every=every, on_tokens=out.chunk if args.stream else None, progress=steps,
                             measure=args.stats)
    except Interrupted as e:  # Ctrl-C: what was generated so far, then exit 130 (fusec.cli.main)
        e.partial.backend = backend
        out.result(e.partial)
        raise KeyboardInterrupt from None
    res.backend = backend
    out.result(res)
    if not args.json:
        print(f"prefill {sum(res.prompt_tokens)} tokens {res.prefill_ms:.2f} ms ({res.prefill_tok_s:.1f} tok/s)  "
              f"decode {res.decode_tok_s:.1f} tok/s ({res.decode_steps} steps x {len(res.new_ids)} sequences)",
              file=sys.stderr)
    if args.stats:
        print("stats " + json.dumps(res.stats, default=str), file=sys.stderr)
    return 0


class _Printer:
    """What ``fusec generate`` prints on stdout: the texts at the end, or (--stream) each row's new
    text as it arrives so that a row's printed pieces, joined, are exactly its final text
    (``fusec.textgen.TextStream``; token ids keep their separating space across chunks). One row
    prints on one line; several print a ``[b] piece`` line per row and chunk. --json: the result
    as one object; with --stream one JSON line per row and chunk ({"index", "ids", "text"}) first."""

    def __init__(self, args: argparse.Namespace, tok: Any, rows: int):
        from fusec.textgen import TextStream

        self.json, self.stream = args.json, args.stream
        self.text = TextStream(tok, rows) if tok is not None else None
        self.ids: list[list[int]] = [[] for _ in range(rows)]

    def chunk(self, chunk: list[list[int]], final: bool = False) -> None:
        pieces = self.text.add(chunk, final) if self.text is not None else None
        one = len(chunk) == 1
        for b, new in enumerate(chunk):
            started = bool(self.ids[b])
            self.ids[b].extend(int(t) for t in new)
            if self.json:
                if new or (pieces and pieces[b]):
                    print(json.dumps({"index": b, "ids": [int(t) for t in new], "text": pieces[b] if pieces else None}),
                          flush=True)
                continue
            if pieces is not None:
                piece = pieces[b]
            else:  # one row's chunks share a line: the space between them is the text's own
                piece = (" " if one and started and new else "") + " ".join(map(str, new))
            if one:
                print(piece, end="", flush=True)
            elif piece:
                print(f"[{b}] {piece}", flush=True)

    def result(self, res: Any) -> None:
        if self.stream:  # what is still held back: the tokens past the last chunk, a trailing U+FFFD
            self.chunk([n[len(have):] for n, have in zip(res.new_ids, self.ids)], final=True)
            if len(self.ids) == 1 and not self.json:
                print(flush=True)
        if self.json:
            print(json.dumps(res.to_json(), default=str), flush=True)
        elif not self.stream:
            for b, new in enumerate(res.new_ids):
                body = res.text[b] if res.text is not None else " ".join(map(str, new))
                print((f"[{b}] " if len(res.new_ids) > 1 else "") + body, flush=True)
