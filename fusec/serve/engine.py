"""The engine ``fusec serve`` runs: a generation plan's on a GPU, or the numpy reference backend's.

Built in the engine process (``fusec.serve.remote``) from the command's options.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fusec.errors import InputError


def make_engine(args: Any, note: Callable[[str], None]) -> tuple[Any, Any, str, str]:
    """(engine, tokenizer, model name, backend) for ``fusec serve``'s options ``args`` (checked
    already); ``note`` hears a line worth showing (the reference backend's warning)."""
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
    if not gpu:
        from fusec import toolchain
        from fusec.generation import ReferenceEngine
        from fusec.genmodel import build_graphs

        note(f"{toolchain.gpu_missing_reason(with_fix=False) or 'no GPU found'}: serving with the numpy reference "
             "backend (slow, but the same graphs)")
        engine = ReferenceEngine(build_graphs(gm, batch, t_max, s_len, admit_batch=args.admit_batch), optimize=True)
        engine.meta = dict(engine.meta, vocab_size=cfg.vocab_size)  # as a plan's record has it
        return engine, gm.tokenizer, gm.source, "reference"
    from fusec.compiler import compile_generation
    from fusec.runtime.generation import PlanEngine

    plan = compile_generation(gm, batch=batch, max_seq_len=t_max, prefill_len=s_len, dtype=args.dtype or "bf16",
                              arch=arch, admit_batch=args.admit_batch)
    return PlanEngine(plan), gm.tokenizer, gm.source, "cuda"
