"""``fusec generate MODEL_OR_PLAN --prompt TEXT``: text generation with a KV cache."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from fusec.cli._common import add_command, add_json_flag, note
from fusec.errors import InputError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from fusec.genmodel import support_text

    p = add_command(
        subparsers, "generate", "generate text with a decoder (prefill + KV-cache decode)",
        "Generate tokens from MODEL_OR_PLAN: a generation plan (`fusec compile MODEL --generate`), a\n"
        "built-in decoder (llama-tiny, qwen3-tiny, qwen3-0.6b; random weights unless --weights-dir),\n"
        "a Hugging Face checkpoint directory, or a GGUF file (`fusec inspect FILE.gguf` says what it\n"
        "holds). The tokenizer and chat template come with the model (GGUF metadata, tokenizer.json);\n"
        "--chat-template-kwargs passes switches such as enable_thinking to the template.\n"
        "On a GPU the model is compiled into a plan whose decode step is one CUDA-graph replay per\n"
        "token with nothing copied between host and device; without a GPU the numpy reference\n"
        "backend runs the same graphs (and says so). Prints the text as it streams (--stream), then\n"
        "prefill time, decode tokens/s and per-step counters.\n\n" + support_text(),
        ["fusec generate SmolLM2-135M-Instruct.Q4_1.gguf --chat --prompt 'What is a GPU?' --max-new-tokens 40",
         "fusec generate qwen3-tiny --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 8 --json",
         "fusec compile qwen3-0.6b --generate --max-seq-len 1024 --batch 8 --dtype bf16 -o q.fplan",
         "fusec generate q.fplan --prompt-ids 10,11,12 --temperature 0.8 --top-k 50 --top-p 0.9 --seed 1",
         "fusec generate Qwen3-0.6B-Q8_0.gguf --chat --chat-template-kwargs '{\"enable_thinking\": false}' "
         "--prompt 'Hi'"])
    p.add_argument("model", metavar="MODEL_OR_PLAN", help="a .fplan generation plan, built-in name, HF directory or .gguf file")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat for a batch)")
    p.add_argument("--prompt-ids", action="append", default=[], metavar="IDS",
                   help="a prompt as comma-separated token ids (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each text prompt in the model's chat template")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="a JSON object of extra template variables for --chat (e.g. '{\"enable_thinking\": false}')")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to draw per sequence (default 32)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive (one read-back every --stream-every steps)")
    p.add_argument("--stream-every", type=int, default=8, metavar="N", help="decode steps per streamed chunk (default 8)")
    add_json_flag(p, "one JSON object (prompt_ids, new_ids, text, prefill_ms, decode_tok_s, stats)")
    p.add_argument("--stats", action="store_true", help="print the prefill and per-decode-step counters")
    add_generation_arguments(p)
    return p


def add_generation_arguments(p: argparse.ArgumentParser, for_compile: bool = False) -> None:
    """Options of a generation plan (generate compiles with them; compile --generate too)."""
    g = p.add_argument_group("generation plan (when compiling)")
    if for_compile:
        g.add_argument("--generate", action="store_true", help="compile a generation plan: prefill + KV-cache decode entries")
    g.add_argument("--batch", type=int, default=None, metavar="B", help="sequences per batch (default: number of prompts)")
    g.add_argument("--max-seq-len", type=int, default=None, metavar="T",
                   help="KV-cache length: prompt + new tokens (default: fits the prompts and --max-new-tokens)")
    g.add_argument("--max-prompt-len", type=int, default=None, metavar="S", help="compiled prefill length (default: min(T, 128))")
    g.add_argument("--weights-dir", default=None, metavar="DIR", help="HF checkpoint for a built-in model's weights")
    if for_compile:
        return
    from fusec.cli.compile import add_quantize_arguments

    add_quantize_arguments(g)
    s = p.add_argument_group("sampling (per generation: a plan compiles none of it in)")
    s.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (0: greedy)")
    s.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0: all)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1.0: all)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same tokens)")
    g.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="storage dtype on the GPU (default bf16)")
    g.add_argument("--arch", metavar="sm_XX", default=None, help="target GPU architecture (default: current GPU, else sm_90)")


def sampling_from_args(args: argparse.Namespace) -> Any:
    from fusec.sampling import Sampling

    if args.greedy and (args.temperature or args.top_k or args.top_p != 1.0):
        raise InputError("--greedy cannot be combined with --temperature/--top-k/--top-p")
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


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
    if args.stream_every < 1:
        raise InputError(f"--stream-every must be a positive integer, got {args.stream_every}")
    check_generation_sizes(args)
    if args.chat_template_kwargs is not None and not args.chat:
        raise InputError("--chat-template-kwargs applies to the chat template: add --chat")
    template_kwargs(args)  # checked before any model loads
    if args.chat and args.prompt_ids:
        raise InputError("--chat wraps text prompts (--prompt) in the chat template; --prompt-ids are token ids "
                         "and are never wrapped: drop --chat, or give the prompt as --prompt TEXT")
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


def _utf8_prompt(text: str) -> str:
    """``text`` if it encodes as UTF-8. Bytes in argv that are not UTF-8 reach Python as lone
    surrogates (\\udcXX): an InputError naming --prompt, never a tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"lone surrogate U+{c:04X}"
        raise InputError(f"--prompt is not valid UTF-8 text ({what} at character {e.start}): give prompts as "
                         "UTF-8") from None
    return text


def _prompts(args: argparse.Namespace) -> list[Any]:
    out: list[Any] = [_utf8_prompt(t) for t in args.prompt]
    for text in args.prompt_ids:
        try:
            out.append([int(t) for t in text.split(",") if t.strip()])
        except ValueError:
            raise InputError(f"--prompt-ids {text!r}: expected comma-separated integers") from None
    if not out:
        raise InputError("give at least one --prompt TEXT or --prompt-ids IDS")
    return out


def run(args: argparse.Namespace) -> int:
    from fusec import device
    from fusec.genmodel import encode_prompts, load_generation_model

    _check_options(args)
    from fusec.cli.compile import quantize_from_args

    quant = quantize_from_args(args)
    prompts = _prompts(args)
    sampling = sampling_from_args(args)
    if args.model.endswith(".fplan"):
        return _run_plan(args, prompts, sampling)
    arch = None
    if device.gpu_available():  # the GPU path compiles: check the toolchain and --arch before loading
        from fusec import toolchain
        from fusec.codegen.compile import check_arch, default_arch

        toolchain.require_compiler()
        arch = check_arch(args.arch or default_arch(), args.dtype or "bf16")
    gm = load_generation_model(args.model, args.weights_dir)
    ids = encode_prompts(gm.tokenizer, prompts, args.chat, template_kwargs(args))
    batch = args.batch if args.batch is not None else len(ids)
    longest = max(len(i) for i in ids)
    t_max = args.max_seq_len if args.max_seq_len is not None else longest + args.max_new_tokens
    if t_max < longest + args.max_new_tokens:  # said before the prefill length (min(T, ...)) blames --max-prompt-len
        i = max(range(len(ids)), key=lambda b: len(ids[b]))
        raise InputError(f"prompt {i}: {longest} tokens + {args.max_new_tokens} new tokens exceed --max-seq-len {t_max}")
    s_len = args.max_prompt_len if args.max_prompt_len is not None else min(t_max, max(longest, 16))
    if not device.gpu_available():
        from fusec import toolchain

        note(f"{toolchain.gpu_missing_reason(with_fix=False) or 'no GPU found'}: running the numpy reference backend")
        from fusec.generation import ReferenceEngine
        from fusec.genmodel import build_graphs
        from fusec.passes.base import PassOptions

        engine = ReferenceEngine(build_graphs(gm, batch, t_max, s_len), optimize=True,
                                 options=PassOptions(**quant) if quant else None)
        return _generate(args, engine, ids, gm.tokenizer, gm.config.vocab_size, sampling)
    from fusec.genmodel import compile_generation
    from fusec.runtime.generation import PlanEngine

    plan = compile_generation(gm, batch=batch, max_seq_len=t_max, prefill_len=s_len, dtype=args.dtype or "bf16",
                              arch=arch, **quant)
    return _generate(args, PlanEngine(plan), ids, gm.tokenizer, gm.config.vocab_size, sampling)


def _run_plan(args: argparse.Namespace, prompts: list[Any], sampling: Any) -> int:
    import fusec
    from fusec.genmodel import encode_prompts, plan_tokenizer
    from fusec.runtime.generation import PlanEngine

    plan = fusec.load(args.model)
    meta = plan.manifest.get("generation")
    if meta is None:
        raise InputError(f"{args.model}: not a generation plan (compile it with `fusec compile MODEL --generate`)")
    from fusec import toolchain

    why = toolchain.gpu_missing_reason()
    if why is not None:
        raise InputError(f"{args.model}: a generation plan runs only on a GPU: {why}; to run on the CPU, give "
                         f"`fusec generate` the model itself (built-in name, HF directory or .gguf)")
    tok = plan_tokenizer(plan)
    return _generate(args, PlanEngine(plan), encode_prompts(tok, prompts, args.chat, template_kwargs(args)), tok,
                     int(meta["vocab_size"]), sampling)


def _generate(args: argparse.Namespace, engine: Any, ids: list[list[int]], tok: Any, vocab: int, sampling: Any) -> int:
    from fusec.generation import iter_generate

    it = iter_generate(engine, ids, args.max_new_tokens, vocab, args.seed, args.stream_every if args.stream else 0,
                       sampling)
    stream = _Stream(tok, len(ids)) if args.stream and not args.json else None
    while True:
        try:
            chunk = next(it)
        except StopIteration as stop:
            res = stop.value
            break
        if stream is not None:
            stream.add(chunk)
    if stream is not None:
        stream.finish(res.new_ids)
    if tok is not None:
        res.text = [tok.decode(n) for n in res.new_ids]
    if getattr(engine, "last_prefill_ms", None) is not None:
        res.prefill_ms = engine.last_prefill_ms
    if args.json:
        print(json.dumps(res.to_json(), default=str))
        return 0
    if not args.stream:
        for b, new in enumerate(res.new_ids):
            body = res.text[b] if res.text is not None else " ".join(map(str, new))
            print((f"[{b}] " if len(res.new_ids) > 1 else "") + body)
    print(f"prefill {res.prefill_ms:.2f} ms  decode {res.decode_tok_s:.1f} tok/s "
          f"({res.decode_steps} steps x {len(res.new_ids)} sequences)", file=sys.stderr)
    if args.stats:
        print("stats " + json.dumps(res.stats, default=str), file=sys.stderr)
    return 0


class _Stream:
    """Prints each row's new tokens as they arrive, so that a row's printed pieces, joined, are
    exactly its final text: with a tokenizer the whole sequence so far is decoded and only the new
    suffix printed (a piece decoded alone would turn a character split across chunks into U+FFFD),
    holding back a trailing incomplete character (U+FFFD at the end) until it completes or the
    generation ends; token ids keep their separating space across chunks. One row prints on one
    line; several print a ``[b] piece`` line per row and chunk."""

    def __init__(self, tok: Any, rows: int):
        self.tok = tok
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.shown = [""] * rows  # what each row has printed so far

    def add(self, chunk: list[list[int]], final: bool = False) -> None:
        one = len(chunk) == 1
        for b, new in enumerate(chunk):
            started = bool(self.ids[b])
            self.ids[b].extend(int(t) for t in new)
            if self.tok is not None:
                text = self.tok.decode(self.ids[b])
                if not final:
                    text = text.rstrip("\ufffd")
                if not text.startswith(self.shown[b]):  # a decoder that rewrote earlier text: print the new rest
                    keep = len(os.path.commonprefix([text, self.shown[b]]))
                    self.shown[b] = self.shown[b][:keep]
                piece = text[len(self.shown[b]):]
                self.shown[b] += piece
            else:  # one row's chunks share a line: the space between them is the text's own
                piece = (" " if one and started and new else "") + " ".join(map(str, new))
            if one:
                print(piece, end="", flush=True)
            elif piece:
                print(f"[{b}] {piece}", flush=True)

    def finish(self, new_ids: list[list[int]]) -> None:
        """Print what is still held back (the tokens past the last chunk, a trailing U+FFFD)."""
        self.add([n[len(have):] for n, have in zip(new_ids, self.ids)], final=True)
        if len(self.ids) == 1:
            print(flush=True)
