"""``fusec.generate``: text generation from Python on any machine (the one entry ``fusec generate``
uses too).

``generate(model, prompts, max_new_tokens=..., ...)`` loads the model (a built-in decoder, a
Hugging Face checkpoint directory or hub id in the local cache, a GGUF file, an ONNX decoder with a
KV cache, or a generation plan), then:

* on a GPU (CuPy finds a device): compiles a generation plan for the prompts' sizes
  (``fusec.compiler.compile_generation``; a given plan runs as it is) and runs it, one CUDA-graph
  replay per decode step (``fusec.runtime.generation.PlanEngine``);
* elsewhere: runs the same prefill and decode graphs with the numpy reference backend
  (``fusec.generation.ReferenceEngine``): the same tokens, much slower.

Sampling arguments are plain keyword arguments (``temperature``, ``top_k``, ``top_p``, ``seed``),
never compiled into a plan (each row's settings are device state, fusec/sampling.py); ``top_k``,
``top_p`` and ``seed`` apply only when sampling (``temperature > 0``) and are refused otherwise,
never silently ignored. Streaming: ``on_tokens(chunk)``
receives each row's new token ids and ``on_text(row, piece)`` each row's new text, every
``stream_every`` decode steps (and after the prefill); a row's pieces joined are exactly its final
text (a character split across tokens is held back until it completes).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fusec.errors import InputError
from fusec.generation import Generated, Interrupted, iter_generate

BACKENDS = ("cuda", "reference")


def _py(name: str) -> str:
    return name


def resolve_sampling(temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     seed: int | None = None, *, greedy: bool = False,
                     flag: Callable[[str], str] = _py) -> tuple[Any, int]:
    """(``fusec.sampling.Sampling``, seed) from the arguments given (None: not given). A plan
    compiles no sampling in: every generation gives its own. ``top_k``/``top_p``/``seed`` without
    sampling (temperature 0) are refused, as is ``greedy`` with any of them; ``flag`` names an
    argument in messages (the CLI's ``--top-k``)."""
    from fusec.sampling import Sampling

    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if greedy:
        extra = [flag(k) for k, v in {**given, "seed": seed}.items() if v is not None and not (k == "temperature" and v == 0)]
        if extra:
            raise InputError(f"{flag('greedy')} cannot be combined with {', '.join(extra)}")
    t = float(temperature) if temperature is not None else 0.0
    if t == 0.0:
        idle = [flag(k) for k, v in (("top_k", top_k), ("top_p", top_p), ("seed", seed)) if v is not None]
        if idle:
            raise InputError(f"{', '.join(idle)} apply only when sampling, and without {flag('temperature')} decoding "
                             f"is greedy: give {flag('temperature')} T (T > 0)")
    sampling = Sampling(temperature=t, top_k=int(top_k) if top_k is not None else 0,
                        top_p=float(top_p) if top_p is not None else 1.0)
    return sampling, int(seed) if seed is not None else 0


def plan_sizes(ids: Sequence[Sequence[int]], max_new_tokens: int, *, batch: int | None = None,
               max_seq_len: int | None = None, max_prompt_len: int | None = None, max_positions: int | None = None,
               vocab: int | None = None, flag: Callable[[str], str] = _py) -> tuple[int, int, int]:
    """(batch, cache length T, prefill length S) for these prompts: the given sizes, checked, or
    the smallest that fit (T = longest prompt + new tokens, at most the model's ``max_positions``;
    S = the longest prompt, at least 16, at most T). Checked before anything is built: the
    prompts' token ids lie in [0, ``vocab``)."""
    from fusec.generation import check_prompt_ids

    check_prompt_ids(ids, vocab, max_new_tokens)
    for name, v in (("batch", batch), ("max_seq_len", max_seq_len), ("max_prompt_len", max_prompt_len)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise InputError(f"{flag(name)} must be a positive integer, got {v!r}")
    if batch is not None and len(ids) > batch:
        raise InputError(f"{len(ids)} prompts, more than {flag('batch')} {batch}")
    longest = max(len(i) for i in ids)
    i = max(range(len(ids)), key=lambda b: len(ids[b]))
    need = longest + max_new_tokens
    if max_seq_len is None:
        if max_positions is not None and need > max_positions:
            raise InputError(f"prompt {i}: {longest} tokens + {max_new_tokens} new tokens exceed the model's context "
                             f"of {max_positions} positions: shorten the prompt or lower {flag('max_new_tokens')}")
        t_max = need
    else:
        if max_positions is not None and max_seq_len > max_positions:
            raise InputError(f"{flag('max_seq_len')} {max_seq_len} exceeds the model's context of {max_positions} positions")
        if need > max_seq_len:
            raise InputError(f"prompt {i}: {longest} tokens + {max_new_tokens} new tokens exceed {flag('max_seq_len')} "
                             f"{max_seq_len}")
        t_max = max_seq_len
    s_len = max_prompt_len if max_prompt_len is not None else min(t_max, max(longest, 16))
    if s_len < longest:
        raise InputError(f"prompt {i} has {longest} tokens, longer than {flag('max_prompt_len')} {s_len}")
    return (batch if batch is not None else len(ids)), t_max, s_len


def pick_backend(backend: str | None) -> str:
    """``backend`` checked, or the default: "cuda" where CuPy finds a GPU, else "reference"."""
    from fusec import device

    if backend is None:
        return "cuda" if device.gpu_available() else "reference"
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "cuda" and not device.gpu_available():
        from fusec import toolchain

        raise InputError(f"backend 'cuda': {toolchain.gpu_missing_reason() or 'no GPU found'}")
    return backend


def prepare(gm: Any, *, batch: int, max_seq_len: int, prefill_len: int, backend: str, dtype: str = "bf16",
            arch: str | None = None, progress: Callable[[str, str], None] | None = None,
            quantize: Mapping[str, Any] | None = None) -> Any:
    """An engine for ``gm`` (a ``fusec.genmodel.GenModel``): a compiled plan's on "cuda" (the
    compile reports its steps to ``progress``), the reference interpreter's on "reference".
    ``quantize``: ``compile_generation``'s quantize/quantize_group/quantize_head arguments."""
    from fusec.genmodel import build_graphs

    if backend == "reference":
        from fusec.generation import ReferenceEngine

        from fusec.passes.base import PassOptions

        return ReferenceEngine(build_graphs(gm, batch, max_seq_len, prefill_len), optimize=True,
                               options=PassOptions(**quantize) if quantize else None)
    from fusec.compiler import compile_generation
    from fusec.runtime.generation import PlanEngine

    plan = compile_generation(gm, batch=batch, max_seq_len=max_seq_len, prefill_len=prefill_len, dtype=dtype,
                              arch=arch, progress=progress, **(quantize or {}))
    return PlanEngine(plan)


class TextStream:
    """Each row's new text in pieces whose concatenation is exactly the row's final text: the whole
    sequence so far is decoded and only the new suffix handed on (a piece decoded alone would turn
    a character split across chunks into U+FFFD), a trailing incomplete character (U+FFFD at the
    end) held back until it completes or the generation ends."""

    def __init__(self, tok: Any, rows: int):
        self.tok = tok
        self.ids: list[list[int]] = [[] for _ in range(rows)]
        self.shown = [""] * rows  # what each row has handed on so far

    def add(self, chunk: Sequence[Sequence[int]], final: bool = False) -> list[str]:
        pieces = []
        for b, new in enumerate(chunk):
            self.ids[b].extend(int(t) for t in new)
            text = self.tok.decode(self.ids[b])
            if not final:
                text = text.rstrip("\ufffd")
            if not text.startswith(self.shown[b]):  # a decoder that rewrote earlier text: hand on the new rest
                self.shown[b] = self.shown[b][:len(os.path.commonprefix([text, self.shown[b]]))]
            pieces.append(text[len(self.shown[b]):])
            self.shown[b] += pieces[-1]
        return pieces

    def rest(self, new_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each row's tokens not handed on yet (those past the last chunk)."""
        return [list(n[len(have):]) for n, have in zip(new_ids, self.ids)]


def run(engine: Any, ids: Sequence[Sequence[int]], tok: Any, vocab: int, *, max_new_tokens: int, seed: int = 0,
        sampling: Any = None, stream_every: int = 0, on_tokens: Callable[[list[list[int]]], None] | None = None,
        on_text: Callable[[int, str], None] | None = None,
        progress: Callable[[str, str], None] | None = None, measure: bool = False) -> Generated:
    """The generation loop over ``engine`` with the texts decoded and the callbacks fed (see the
    module docstring). Ctrl-C raises ``fusec.generation.Interrupted`` whose ``partial`` result
    holds what was generated so far (texts included)."""
    if on_text is not None and tok is None:
        raise InputError("on_text needs a tokenizer and this model carries none: use on_tokens for the token ids")
    text = TextStream(tok, len(ids)) if on_text is not None else None

    def hand_on(chunk: list[list[int]], final: bool = False) -> None:
        if on_tokens is not None and any(chunk):
            on_tokens(chunk)
        if text is not None:
            for b, piece in enumerate(text.add(chunk, final)):
                if piece:
                    on_text(b, piece)  # type: ignore[misc]

    it = iter_generate(engine, ids, max_new_tokens, vocab, seed, stream_every, sampling, progress=progress,
                       measure=measure)
    try:
        while True:
            try:
                chunk = next(it)
            except StopIteration as stop:
                res: Generated = stop.value
                break
            hand_on(chunk)
    except Interrupted as e:
        _finish(e.partial, engine, tok)
        raise
    if text is not None:
        hand_on(text.rest(res.new_ids), final=True)
    return _finish(res, engine, tok)


def _finish(res: Generated, engine: Any, tok: Any) -> Generated:
    if tok is not None:
        res.text = [tok.decode(n) for n in res.new_ids]
    if getattr(engine, "last_prefill_ms", None) is not None:  # the GPU's own clock (CUDA events)
        res.prefill_ms = engine.last_prefill_ms
    return res


def generate(model: Any, prompts: str | Sequence[Any], *, max_new_tokens: int = 32, chat: bool = False,
             system: str | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
             temperature: float | None = None, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None,
             on_text: Callable[[int, str], None] | None = None,
             on_tokens: Callable[[list[list[int]]], None] | None = None, stream_every: int = 1,
             batch: int | None = None, max_seq_len: int | None = None, max_prompt_len: int | None = None,
             dtype: str = "bf16", arch: str | None = None, weights_dir: str | os.PathLike[str] | None = None,
             backend: str | None = None, progress: Callable[[str, str], None] | None = None,
             quantize: Mapping[str, Any] | None = None, measure: bool = False) -> Generated:
    """Generate up to ``max_new_tokens`` tokens after each prompt; see the module docstring.

    ``model``: a built-in decoder name (random weights unless ``weights_dir``), a Hugging Face
    checkpoint directory or hub id (``org/name``, from the local cache), a ``.gguf`` file, an ONNX
    decoder with a KV cache, a generation plan (``.fplan`` path or ``Plan``; GPU only), or a
    ``fusec.genmodel.GenModel``. ``prompts``: a string, token ids, or a list of either (one row
    each). ``chat``: wrap text prompts in the model's chat template (``system``: its system
    message; ``chat_template_kwargs``: template variables such as ``{"enable_thinking": False}``).
    ``backend``: "cuda" or "reference" (default: "cuda" where there is a GPU).
    ``batch``/``max_seq_len``/``max_prompt_len``: the compiled sizes (default: what the prompts
    need); ``dtype``/``arch``: the compiled plan's (GPU); ``quantize``: weight quantization
    (``{"quantize": "int4", "quantize_group": 128}``, ``fusec.compiler.quantize_options``).
    ``progress(stage, item)`` hears each step; ``measure``: count what the driver does per decode
    step (``stats``; attaches CUPTI on a GPU, which slows later graph launches: only when asked).

    Returns ``fusec.generation.Generated``: ``text`` (one string per prompt, None without a
    tokenizer), ``new_ids``, ``prompt_ids``, ``finish_reason`` ("stop": the row drew an
    end-of-sequence token, which ends its ids; "length": it reached ``max_new_tokens``),
    ``prompt_tokens``/``completion_tokens`` (per row), ``prefill_ms``, ``prefill_tok_s``,
    ``decode_ms``, ``decode_steps``, ``decode_tok_s``, ``backend`` and ``stats``. Ctrl-C raises
    ``fusec.generation.Interrupted`` (a KeyboardInterrupt) whose ``partial`` is this record so far."""
    from fusec.genmodel import GenModel, encode_prompts, load_generation_model, plan_tokenizer

    rows = _rows(prompts)
    if not isinstance(stream_every, int) or isinstance(stream_every, bool) or stream_every < 1:
        raise InputError(f"stream_every must be a positive integer, got {stream_every!r}")
    every = stream_every if (on_text is not None or on_tokens is not None) else 0
    plan = _as_plan(model)
    if plan is not None:
        meta = plan.manifest["generation"]
        sampling, seed_ = resolve_sampling(temperature, top_k, top_p, seed)
        if pick_backend(backend) != "cuda":
            raise InputError("a generation plan runs only on a GPU: give the model itself to generate on the CPU")
        from fusec.runtime.generation import PlanEngine

        engine = getattr(plan, "_engine", None) or PlanEngine(plan)
        plan._engine = engine
        tok = plan_tokenizer(plan)
        ids = encode_prompts(tok, rows, chat, system, dict(chat_template_kwargs or {}))
        res = run(engine, ids, tok, int(meta["vocab_size"]), max_new_tokens=max_new_tokens, seed=seed_,
                  sampling=sampling, stream_every=every, on_tokens=on_tokens, on_text=on_text, progress=progress,
                  measure=measure)
        res.backend = "cuda"
        return res
    sampling, seed_ = resolve_sampling(temperature, top_k, top_p, seed)
    chosen = pick_backend(backend)
    if progress is not None and not isinstance(model, GenModel):
        progress("load", os.fspath(model))
    gm = model if isinstance(model, GenModel) else load_generation_model(model, weights_dir)
    ids = encode_prompts(gm.tokenizer, rows, chat, system, dict(chat_template_kwargs or {}))
    b, t_max, s_len = plan_sizes(ids, max_new_tokens, batch=batch, max_seq_len=max_seq_len,
                                 max_prompt_len=max_prompt_len, max_positions=getattr(gm.config, "max_positions", None),
                                 vocab=int(gm.config.vocab_size))
    if progress is not None:
        progress("prepare", f"{'compile a generation plan' if chosen == 'cuda' else 'the reference backend'} "
                            f"(batch {b}, cache {t_max}, prefill {s_len})")
    engine = prepare(gm, batch=b, max_seq_len=t_max, prefill_len=s_len, backend=chosen, dtype=dtype, arch=arch,
                     progress=progress, quantize=quantize)
    res = run(engine, ids, gm.tokenizer, int(gm.config.vocab_size), max_new_tokens=max_new_tokens, seed=seed_,
              sampling=sampling, stream_every=every, on_tokens=on_tokens, on_text=on_text, progress=progress,
                  measure=measure)
    res.backend = chosen
    return res


def _rows(prompts: Any) -> list[Any]:
    """One prompt (a string or a list of ids) or a list of them, as a list of rows."""
    if isinstance(prompts, str):
        return [prompts]
    rows = list(prompts)
    if rows and all(isinstance(t, int) and not isinstance(t, bool) for t in rows):
        return [rows]  # one prompt given as token ids
    if not rows:
        raise InputError("no prompt given")
    return rows


def _as_plan(model: Any) -> Any:
    """The generation plan ``model`` names (a ``Plan``, or a path ending in .fplan), else None."""
    from fusec.plan import Plan

    if isinstance(model, Plan):
        plan = model
    elif isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".fplan"):
        import fusec

        plan = fusec.load(model)
    else:
        return None
    if "generation" not in plan.manifest:
        raise InputError("this plan cannot generate: compile it with `fusec compile MODEL --generate`")
    return plan
