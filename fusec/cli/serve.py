"""``fusec serve MODEL_OR_PLAN``: an OpenAI-compatible HTTP server with continuous batching."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from fusec.cli._common import add_command, note
from fusec.cli.generate import DEQUANTIZE_HELP, JOIN_HELP
from fusec.errors import InputError
from fusec.serve.batcher import READBACK_EVERY

MAX_CHAT_TEMPLATE_BYTES = 1 << 20
DEFAULT_JOIN = 2  # prompts a join step takes when serve compiles the model (measured: --join's help)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "serve", "serve a decoder over an OpenAI-compatible HTTP API (continuous batching)",
        "Serve MODEL_OR_PLAN (a generation plan, a built-in decoder, a Hugging Face Llama/Qwen3 directory\n"
        "or a GGUF file) over HTTP: GET /v1/models, POST /v1/completions, POST /v1/chat/completions\n"
        "(messages rendered with the model's chat template), GET /health, GET /metrics (Prometheus).\n"
        "Requests take free rows of the plan's batch and join between decode steps while the other rows\n"
        "keep decoding; `stream: true` answers with server-sent events ending in `data: [DONE]`.\n"
        "Every request brings its own temperature/top_p/top_k/seed (nothing is compiled in). Binds\n"
        "127.0.0.1 unless --host says otherwise; with --api-key, /v1/* needs `Authorization: Bearer KEY`.\n"
        "Without a GPU the numpy reference backend runs the same graphs (slow, and it says so).\n"
        "SIGINT/SIGTERM end in-flight requests with an error (streams: an error chunk) and exit.\n"
        "Needs the serve extra: pip install 'fusec[serve]'.",
        ["fusec serve qwen3-0.6b --batch 8 --max-seq-len 1024 --port 8000",
         "fusec serve SmolLM2-135M-Instruct.Q4_1.gguf --api-key \"$KEY\" --port 0",
         "curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' "
         "-d '{\"model\": \"qwen3-0.6b\", \"prompt\": [1, 2, 3], \"max_tokens\": 8, \"temperature\": 0}'"])
    p.add_argument("model", metavar="MODEL_OR_PLAN", help="a .fplan generation plan, built-in name, HF directory or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port; the bound one is printed)")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="rows served at once (default 8; a plan: its own)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="T",
                   help="positions per row, prompt + completion (default min(1024, the model's))")
    p.add_argument("--max-prompt-len", type=int, default=None, metavar="S", help="longest prompt (default min(T - 1, 512))")
    p.add_argument("--api-key", default=None, metavar="KEY", help="require `Authorization: Bearer KEY` on /v1/* "
                   "(default: $FUSEC_API_KEY if set)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template instead of the model's")
    p.add_argument("--served-model-name", default=None, metavar="NAME", help="the model name clients send (default: "
                   "the model's base name)")
    p.add_argument("--max-queue", type=int, default=64, metavar="N", help="requests waiting for a row before 503 (default 64)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="largest request body (default 1 MiB)")
    p.add_argument("--default-max-tokens", type=int, default=256, metavar="N",
                   help="chat completions without max_tokens (default 256, at most what the context leaves)")
    p.add_argument("--admit-wait-ms", type=float, default=2.0, metavar="MS",
                   help="a request waits up to this long for others to join its prefill (default 2)")
    p.add_argument("--admit-batch", type=int, default=0, metavar="A",
                   help="compile an admit entry that prefills A new requests at a time into their rows, so "
                        "admitting k requests computes about k rows instead of the whole batch (0, the default: "
                        "every admission runs the whole batch's prefill; A < B; models fusec builds, not a plan "
                        "file or an ONNX export)")
    p.add_argument("--join", type=int, nargs="?", const=1, default=None, metavar="J",
                   help="compile " + JOIN_HELP + f"; models fusec builds, not a plan file (default: {DEFAULT_JOIN}, at most "
                        "the batch; 0: none; an ONNX export with its KV cache has none). Measured on an H200 at 32 "
                        "clients, in the same runs: 0.77-0.79 of the plan's decode rate against 0.72-0.75 "
                        "through the prefill, time to first token p50 16-18 ms against 28-29 "
                        "(benchmarks/RESULTS.md)")
    p.add_argument("--dequantize", action="store_true", help=DEQUANTIZE_HELP)
    p.add_argument("--readback-every", type=int, default=READBACK_EVERY, metavar="K",
                   help="read the drawn tokens back once every K decode steps (one copy of the tokens state) "
                        "instead of after each step: the engine thread's host work and driver calls per token "
                        f"divided by K; tokens reach clients K at a time (default {READBACK_EVERY}; measured on an "
                        "H200 at 32 clients, in the same call: 0.87-0.88 of the plan's decode rate at 4 against 0.83 "
                        "at 1, benchmarks/RESULTS.md)")
    p.add_argument("--counters", action="store_true", help="count the driver's work over decode steps (CUPTI; /health)")
    p.add_argument("--weights-dir", default=None, metavar="DIR", help="HF checkpoint for a built-in model's weights")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default=None, help="storage dtype on the GPU (default bf16)")
    p.add_argument("--arch", metavar="sm_XX", default=None, help="target GPU architecture (default: the current GPU)")
    return p


def _check(args: argparse.Namespace) -> None:
    """Options that can be wrong on their own, checked before any model loads."""
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("batch", "max_seq_len", "max_prompt_len"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {v}")
    if args.model.endswith(".fplan"):  # options of the compile serve makes: a plan file had its own
        for flag, given, why in (("--dequantize", args.dequantize, "a plan's weights are compiled in"),
                                 ("--join", args.join is not None, "a plan has its entries already (fusec compile --generate --join)"),
                                 ("--admit-batch", args.admit_batch,
                                  "a plan has its entries already (fusec compile --generate --admit-batch A)")):
            if given:
                raise InputError(f"{flag} applies when serve compiles the model; {why}")
    from fusec.models.generate import check_admit_batch, check_join

    check_admit_batch(args.admit_batch, args.batch if args.batch is not None else 8)
    if args.join is not None:
        check_join(args.join, args.batch if args.batch is not None else 8)
    if not 0 <= args.admit_wait_ms <= 1000:
        raise InputError(f"--admit-wait-ms must be in [0, 1000], got {args.admit_wait_ms}")
    for name in ("max_queue", "max_body_bytes", "default_max_tokens", "readback_every"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.max_seq_len is not None and args.max_seq_len < 2:
        raise InputError(f"--max-seq-len must be at least 2 (a prompt token and a new one), got {args.max_seq_len}")
    if args.max_prompt_len is not None and args.max_seq_len is not None and args.max_prompt_len >= args.max_seq_len:
        raise InputError(f"--max-prompt-len {args.max_prompt_len} leaves no room for a completion in --max-seq-len "
                         f"{args.max_seq_len}")
    if args.api_key is not None and not args.api_key.strip():
        raise InputError("--api-key must not be empty")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise InputError("--served-model-name must not be empty")
    if args.arch is not None:
        from fusec.codegen.compile import check_arch

        check_arch(args.arch, args.dtype or "bf16")


def _chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CHAT_TEMPLATE_BYTES + 1)
    except OSError as e:
        raise InputError(f"--chat-template {path!r}: {e.strerror or e}") from None
    if len(data) > MAX_CHAT_TEMPLATE_BYTES:
        raise InputError(f"--chat-template {path!r}: larger than {MAX_CHAT_TEMPLATE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--chat-template {path!r}: not UTF-8 text") from None


def _engine(args: argparse.Namespace) -> tuple[Any, Any, str, str]:
    """(engine, tokenizer, model name, backend)."""
    from fusec import device

    if args.model.endswith(".fplan"):
        import fusec
        from fusec import toolchain
        from fusec.genmodel import plan_tokenizer
        from fusec.runtime.generation import PlanEngine

        why = toolchain.gpu_missing_reason()
        if why is not None:
            raise InputError(f"{args.model}: a generation plan runs only on a GPU: {why}; to serve on the CPU, give "
                             "`fusec serve` the model itself (built-in name, HF directory or .gguf)")
        plan = fusec.load(args.model)
        if plan.manifest.get("generation") is None:
            raise InputError(f"{args.model}: not a generation plan (compile it with `fusec compile MODEL --generate`)")
        return PlanEngine(plan), plan_tokenizer(plan), str(plan.manifest["generation"].get("source")), "cuda"
    from fusec.genmodel import load_generation_model

    arch = None
    gpu = device.gpu_available()
    if gpu:
        from fusec import toolchain
        from fusec.codegen.compile import check_arch, default_arch

        toolchain.require_compiler()
        arch = check_arch(args.arch or default_arch(), args.dtype or "bf16")
    gm = load_generation_model(args.model, args.weights_dir, packed=not args.dequantize)
    cfg = gm.config
    t_max = args.max_seq_len if args.max_seq_len is not None else min(1024, getattr(cfg, "max_positions", 1024))
    s_len = args.max_prompt_len if args.max_prompt_len is not None else max(1, min(t_max - 1, 512))
    if s_len >= t_max:
        raise InputError(f"--max-prompt-len {s_len} leaves no room for a completion in --max-seq-len {t_max}")
    batch = args.batch if args.batch is not None else 8
    join = join_prompts(args.join, gm, batch)
    if not gpu:
        from fusec import toolchain
        from fusec.generation import ReferenceEngine
        from fusec.genmodel import build_graphs

        note(f"{toolchain.gpu_missing_reason(with_fix=False) or 'no GPU found'}: serving with the numpy reference "
             "backend (slow, but the same graphs)")
        engine = ReferenceEngine(build_graphs(gm, batch, t_max, s_len, admit_batch=args.admit_batch, join=join),
                                 optimize=True)
        engine.meta = dict(engine.meta, vocab_size=cfg.vocab_size)  # as a plan's record has it
        return engine, gm.tokenizer, gm.source, "reference"
    from fusec.compiler import compile_generation
    from fusec.runtime.generation import PlanEngine

    plan = compile_generation(gm, batch=batch, max_seq_len=t_max, prefill_len=s_len, dtype=args.dtype or "bf16",
                              arch=arch, admit_batch=args.admit_batch, join=join)
    return PlanEngine(plan), gm.tokenizer, gm.source, "cuda"


def join_prompts(given: int | None, gm: Any, batch: int) -> int:
    """The join entry's prompts a step for a model serve compiles: as given, else DEFAULT_JOIN (at
    most the batch), or 0 for a model exported with its KV cache (no join entry can be built for it)."""
    if given is not None:
        return given
    return 0 if gm.builder is not None else min(DEFAULT_JOIN, batch)


class _Terminated(Exception):
    pass


def run(args: argparse.Namespace) -> int:
    _check(args)
    template = _chat_template(args.chat_template)
    from fusec import knobs

    api_key = args.api_key if args.api_key is not None else (knobs.get("FUSEC_API_KEY") or None)
    try:
        from fusec.serve import app as serve_app
    except ImportError as e:  # starlette/uvicorn/prometheus_client: the serve extra
        raise InputError(f"fusec serve needs the serve extra ({e.name or e}): pip install 'fusec[serve]'") from None
    for mod in ("starlette", "uvicorn", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            raise InputError(f"fusec serve needs {mod} (the serve extra): pip install 'fusec[serve]'") from None
    from fusec.serve.batcher import Batcher

    engine, tok, source, backend = _engine(args)
    name = args.served_model_name or os.path.basename(str(source)) or "model"
    batcher = Batcher(engine, lambda events: None, max_queue=args.max_queue, counters=args.counters,
                      admit_wait=args.admit_wait_ms / 1e3, readback_every=args.readback_every)
    server = serve_app.Server(batcher, tok, name, api_key=api_key, max_body=args.max_body_bytes,
                              default_max_tokens=args.default_max_tokens, chat_template=template)
    # the engine thread and the event loop share the GIL: let a waiting thread in sooner than 5 ms
    # (50 and 100 us measured no different at 32 clients on the H100: benchmarks/RESULTS.md, issue 24)
    sys.setswitchinterval(0.0005)

    def ready(port: int) -> None:
        print(f"fusec serve: {name} on http://{args.host}:{port} (batch {batcher.batch}, max_seq_len "
              f"{batcher.max_seq_len}, prompts up to {batcher.prefill_len} tokens, {backend} backend"
              f"{', API key required' if api_key else ''}; {batcher.admission()})", file=sys.stderr, flush=True)

    def terminated(sig: int, frame: Any) -> None:  # uvicorn re-raises the signal after its graceful shutdown
        raise _Terminated()

    previous = {sig: signal.signal(sig, terminated) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve_app.run(server, args.host, args.port, on_ready=ready)
    except _Terminated:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        batcher.shutdown(wait=10.0)
    print(f"fusec serve: stopped ({batcher.counts['finished']} requests finished)", file=sys.stderr, flush=True)
    return 0
