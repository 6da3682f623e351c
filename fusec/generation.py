"""Text generation over a prefill entry and a decode entry that share state (models/generate.py).

One loop serves both backends through a small ``Engine`` interface:

* ``ReferenceEngine``: the numpy reference interpreter runs the two graphs (any machine);
* ``fusec.runtime.generation.PlanEngine``: a compiled plan on the GPU; the decode step is one
  CUDA-graph replay, and nothing crosses between host and device between the prefill and the
  read-back of the tokens (or each streamed chunk).

The host writes each row's sampling settings once (the ``temperature``, ``top_k``, ``top_p`` and
``seed`` states: fusec/sampling.py), runs the prefill on the padded prompts with their lengths
(every row admitted), then ``max_new_tokens - 1`` decode steps, and reads ``tokens`` and ``pos``
back at the end (or every ``stream_every`` steps). New tokens of row b are
``tokens[b, length_b : pos_b + 1]``: a row stops at its own end-of-sequence token, which its new
ids end with (as ``transformers`` does). With ``stream_every``, the first token is handed on right
after the prefill, then every ``stream_every`` decode steps. Ctrl-C during the decode steps raises
``Interrupted`` carrying the tokens drawn so far.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from fusec.errors import InputError
from fusec.sampling import Sampling, check_seed, row_seeds


class Engine(Protocol):
    meta: Mapping[str, Any]  # graph.meta["generation"] of the decode entry
    syncs: int  # host synchronizations made so far (the reference backend has no device: 0)

    def set_state(self, name: str, value: np.ndarray) -> None: ...
    def write_states(self, values: dict[str, np.ndarray]) -> None: ...  # several states, queued behind the work so far
    def read_state(self, name: str) -> np.ndarray: ...
    def prefill(self, input_ids: np.ndarray, lengths: np.ndarray, timed: bool = True,
                measure: bool = False) -> None: ...  # lengths 0: row not admitted
    def admit(self, feeds: Mapping[str, np.ndarray]) -> None: ...  # one run of the admit entry (admit_feeds)
    def join(self, feeds: Mapping[str, np.ndarray]) -> None: ...  # one decode step joined by up to J prompts (join_feeds)
    def decode(self) -> None: ...
    def sync(self) -> None: ...
    def measure(self, on: bool) -> None: ...  # start/stop counting driver activity (decode loop)
    def finished(self) -> bool | None: ...  # every row done, if known without device work (else None)
    def stats(self) -> dict[str, Any]: ...


@dataclasses.dataclass
class Generated:
    """One generation's result; ``fusec.generate``'s docstring and the README describe the fields."""

    prompt_ids: list[list[int]]
    new_ids: list[list[int]]
    prefill_ms: float
    decode_ms: float
    decode_steps: int
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    text: list[str] | None = None
    # per row: "stop" (it drew an end-of-sequence token, the last of its new ids), "length"
    # (max_new_tokens reached) or "interrupted" (Ctrl-C)
    finish_reason: list[str] = dataclasses.field(default_factory=list)
    backend: str = ""

    @property
    def prompt_tokens(self) -> list[int]:
        return [len(p) for p in self.prompt_ids]

    @property
    def completion_tokens(self) -> list[int]:
        return [len(n) for n in self.new_ids]

    @property
    def prefill_tok_s(self) -> float:
        """Prompt throughput: the prompts' tokens (padding not counted) per second of prefill."""
        return sum(self.prompt_tokens) / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Decode throughput: tokens drawn by decode steps (all rows) per second."""
        n = self.decode_steps * len(self.prompt_ids)
        return n / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt_ids, "new_ids": self.new_ids, "text": self.text,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "prefill_ms": self.prefill_ms,
                "prefill_tok_s": self.prefill_tok_s, "decode_ms": self.decode_ms, "decode_steps": self.decode_steps,
                "decode_tok_s": self.decode_tok_s, "backend": self.backend, "stats": self.stats}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a generation; ``partial`` is the ``Generated`` record of the tokens drawn so
    far (rows not finished have finish_reason "interrupted")."""

    def __init__(self, partial: Generated):
        super().__init__("interrupted")
        self.partial = partial


def check_prompts(prompts: Sequence[Sequence[int]], meta: Mapping[str, Any], vocab: int,
                  max_new_tokens: int) -> list[list[int]]:
    """Validate prompts against the plan's batch, prefill length, cache length and vocabulary."""
    rows = check_prompt_ids(prompts, vocab, max_new_tokens)
    batch, prefill_len, t_max = int(meta["batch"]), int(meta["prefill_len"]), int(meta["max_seq_len"])
    if len(rows) > batch:
        raise InputError(f"{len(rows)} prompts, but the plan was compiled for a batch of {batch} (--batch)")
    for i, r in enumerate(rows):
        if len(r) > prefill_len:
            raise InputError(f"prompt {i} has {len(r)} tokens, longer than the compiled prefill length "
                             f"{prefill_len} (--max-prompt-len)")
        if len(r) + max_new_tokens > t_max:
            raise InputError(f"prompt {i}: {len(r)} tokens + {max_new_tokens} new tokens exceed the compiled cache "
                             f"length {t_max} (max_seq_len, --max-seq-len when compiling)")
    return rows


def check_prompt_ids(prompts: Sequence[Sequence[int]], vocab: int | None, max_new_tokens: int) -> list[list[int]]:
    """The prompts as lists of ints: at least one, none empty, ids in [0, ``vocab``) (when given);
    ``max_new_tokens`` a positive integer."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    rows = [list(map(int, p)) for p in prompts]
    if not rows:
        raise InputError("no prompt given")
    for i, r in enumerate(rows):
        if not r:
            raise InputError(f"prompt {i} is empty")
        bad = [t for t in r if vocab is not None and not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return rows


def generate(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab: int, seed: int = 0,
             stream_every: int = 0, on_tokens: Callable[[list[list[int]]], None] | None = None,
             sampling: Sampling | Sequence[Sampling] | None = None, measure: bool = False) -> Generated:
    """Run the prefill and the decode steps; see the module docstring. With ``stream_every`` and
    ``on_tokens``, each row's new tokens are passed on every ``stream_every`` decode steps (and at
    the end). ``sampling``: one setting for every row or one per prompt (default greedy); row b
    draws with seed ``row_seeds(seed, B)[b]``; ``measure``: see ``iter_generate``."""
    it = iter_generate(engine, prompts, max_new_tokens, vocab, seed, stream_every, sampling, measure=measure)
    while True:
        try:
            chunk = next(it)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if on_tokens is not None:
            on_tokens(chunk)


def row_settings(sampling: Sampling | Sequence[Sampling] | None, rows: int, batch: int) -> list[Sampling]:
    """One Sampling per batch row: ``sampling`` for every row, or one per prompt (padding rows copy
    the first)."""
    if sampling is None:
        sampling = Sampling()
    if isinstance(sampling, Sampling):
        return [sampling] * batch
    per = list(sampling)
    if len(per) != rows or not all(isinstance(s, Sampling) for s in per):
        raise InputError(f"sampling: give one Sampling for every prompt or one per prompt ({rows}), got {len(per)}")
    return per + [per[0]] * (batch - rows)


def write_sampling(engine: Engine, settings: Sequence[Sampling], seeds: np.ndarray) -> None:
    """Write every row's sampling state (whole [B] arrays: a setup step, outside any run)."""
    engine.write_states(sampling_states(settings, seeds))


def sampling_states(settings: Sequence[Sampling], seeds: np.ndarray) -> dict[str, np.ndarray]:
    """The four per-row sampling states of a batch (see models/generate.py)."""
    return {"temperature": np.array([s.temperature for s in settings], np.float32),
            "top_k": np.array([s.top_k for s in settings], np.int64),
            "top_p": np.array([s.top_p for s in settings], np.float32),
            "seed": np.asarray(seeds, np.int64)}


def iter_generate(engine: Engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, vocab: int, seed: int = 0,
                  stream_every: int = 0, sampling: Sampling | Sequence[Sampling] | None = None,
                  progress: Callable[[str, str], None] | None = None,
                  measure: bool = False) -> Generator[list[list[int]], None, Generated]:
    """Yield each row's new tokens after the prefill and every ``stream_every`` decode steps (0:
    only at the end), one read-back per chunk; returns (StopIteration.value) the ``Generated``
    record. ``sampling``: one setting for every row or one per row (default greedy).
    ``progress(step, item)`` hears "prefill", "first token" (with its time) and "decode".
    ``measure``: count what the driver does in the prefill and over the decode loop (``stats``;
    on a GPU this attaches CUPTI, which slows every later graph launch: only when asked)."""
    meta = engine.meta
    rows = check_prompts(prompts, meta, vocab, max_new_tokens)
    batch, prefill_len = int(meta["batch"]), int(meta["prefill_len"])
    check_seed(seed)
    settings = row_settings(sampling, len(rows), batch)
    # Unused batch rows repeat the first prompt (their tokens are dropped): every row stays valid.
    padded = rows + [rows[0]] * (batch - len(rows))
    lengths = np.array([len(r) for r in padded], np.int64)
    ids = np.zeros((batch, prefill_len), np.int64)
    for b, r in enumerate(padded):
        ids[b, : len(r)] = r
    write_sampling(engine, settings, row_seeds(seed, batch))

    eos = {int(e) for e in meta.get("eos_ids", ())}

    def record(new: list[list[int]], t_end: float, steps_run: int, cut: bool = False) -> Generated:
        why = ["stop" if n and n[-1] in eos else "interrupted" if cut else "length" for n in new]
        return Generated(prompt_ids=rows, new_ids=new, prefill_ms=(t1 - t0) * 1e3,
                         decode_ms=max(t_end - t1 - paused, 0.0) * 1e3, decode_steps=steps_run, stats=engine.stats(),
                         finish_reason=why)

    if progress is not None:
        progress("prefill", f"{sum(len(r) for r in rows)} prompt tokens in {len(rows)} sequences")
    t0 = time.perf_counter()
    engine.prefill(ids, lengths, measure=measure)
    engine.sync()
    t1 = time.perf_counter()
    if progress is not None:
        progress("first token", f"after {(t1 - t0) * 1e3:.0f} ms of prefill")
    paused = 0.0  # host time spent handing chunks to the caller, not counted as decode time
    sent = [0] * len(rows)
    steps = max_new_tokens - 1
    done_steps = 0
    try:
        if stream_every:  # the first token, drawn by the prefill, without waiting for a decode step
            new = _new_ids(engine, rows)
            t_pause = time.perf_counter()
            yield new
            paused += time.perf_counter() - t_pause
            sent = [len(n) for n in new]
        if progress is not None and steps:
            progress("decode", f"up to {steps} steps")
        if measure:
            engine.measure(True)
        for step in range(steps):
            if engine.finished():  # the reference backend knows for free; the GPU never asks the device
                break
            engine.decode()
            done_steps += 1
            if stream_every and (step + 1) % stream_every == 0 and step + 1 < steps:
                new = _new_ids(engine, rows)
                t_pause = time.perf_counter()
                yield [n[s:] for n, s in zip(new, sent)]
                paused += time.perf_counter() - t_pause
                sent = [len(n) for n in new]
        if measure:
            engine.measure(False)
        engine.sync()
    except KeyboardInterrupt:
        engine.sync()  # the steps already queued finish; their tokens count
        raise Interrupted(record(_new_ids(engine, rows), time.perf_counter(), done_steps, cut=True)) from None
    t2 = time.perf_counter()
    new = _new_ids(engine, rows)
    tail = [n[s:] for n, s in zip(new, sent)]
    if any(tail):
        yield tail
    return record(new, t2, done_steps)


def _new_ids(engine: Engine, rows: list[list[int]]) -> list[list[int]]:
    tokens, pos = engine.read_state("tokens"), engine.read_state("pos")
    return [[int(t) for t in tokens[b, len(r): int(pos[b]) + 1]] for b, r in enumerate(rows)]


def admit_rows(engine: Engine, input_ids: np.ndarray, lengths: np.ndarray) -> int:
    """Admit the rows with ``lengths`` > 0 (``input_ids`` [B, S] and ``lengths`` [B] as the prefill
    takes them), leaving the other rows as they are: through the admit entry, ``admit_batch``
    prompts a run, when that computes fewer rows than one prefill of the whole batch; else through
    the prefill. Returns the admit runs made (0: the prefill ran)."""
    lengths = np.asarray(lengths, np.int64)
    slots = int(engine.meta.get("admit_batch") or 0)
    rows = np.flatnonzero(lengths > 0)
    runs = -(-len(rows) // slots) if slots else 0
    if not slots or runs * slots >= len(lengths):
        engine.prefill(input_ids, lengths, timed=False)
        return 0
    for feeds in admit_feeds(input_ids, lengths, slots):
        engine.admit(feeds)
    return runs


def admit_feeds(input_ids: np.ndarray, lengths: np.ndarray, slots: int) -> list[dict[str, np.ndarray]]:
    """The admit entry's inputs (models/generate.py) for the rows with ``lengths`` > 0, ``slots``
    prompts a run: an unused slot has length 0 (it computes a dummy prompt nobody takes)."""
    lengths = np.asarray(lengths, np.int64)
    rows = np.flatnonzero(lengths > 0)
    batch, seq = input_ids.shape
    out = []
    for i in range(0, len(rows), slots):
        chunk = rows[i:i + slots]
        ids, slot_lengths = np.zeros((slots, seq), np.int64), np.zeros(slots, np.int64)
        ids[:len(chunk)], slot_lengths[:len(chunk)] = input_ids[chunk], lengths[chunk]
        src, row_lengths = np.zeros(batch, np.int64), np.zeros(batch, np.int64)
        src[chunk], row_lengths[chunk] = np.arange(len(chunk)), lengths[chunk]
        out.append({"input_ids": ids, "lengths": slot_lengths, "row_lengths": row_lengths, "src": src})
    return out


def join_feeds(prompts: Sequence[tuple[int, Sequence[int]]], prefill_len: int, slots: int = 1) -> dict[str, np.ndarray]:
    """The inputs of a join entry of ``slots`` prompts a step (models/join.py): each (row, prompt
    ids) of ``prompts`` (at most ``slots``, rows distinct) into its row; slots left over are empty."""
    if len(prompts) > slots:
        raise InputError(f"{len(prompts)} prompts for a join entry of {slots} a step")
    if len({row for row, _ in prompts}) != len(prompts):
        raise InputError(f"a join's prompts take distinct rows, got rows {[row for row, _ in prompts]}")
    ids = np.zeros((slots, prefill_len), np.int64)
    lengths, rows = np.zeros(slots, np.int64), np.zeros(slots, np.int64)
    for j, (row, prompt) in enumerate(prompts):
        if not 1 <= len(prompt) <= prefill_len:
            raise InputError(f"a joining prompt has {len(prompt)} tokens; the plan takes 1 to {prefill_len}")
        ids[j, :len(prompt)], lengths[j], rows[j] = prompt, len(prompt), row
    return {"input_ids": ids, "lengths": lengths, "row": rows}


class Ready:
    """A read-back that is already done (``ReferenceEngine.fetch``; the GPU engine's waits)."""

    def __init__(self, value: np.ndarray):
        self._value = value

    def ready(self) -> bool:
        return True

    def get(self) -> np.ndarray:
        return self._value


class ReferenceEngine:
    """The numpy reference backend: runs the prefill/decode graphs, keeps the state in a dict.
    ``optimize``: run the pass pipeline first (fp32; e.g. the lm_head's weight transpose is then
    read through numpy's transposed view instead of recomputed every step) — the same numbers,
    much faster. Weights are read in their [N, K] layout (``weights_nk``, as generation plans
    read them), so the two graphs share their arrays instead of each caching transposed copies."""

    syncs = 0  # no device: nothing to wait for

    def __init__(self, graphs: Mapping[str, Any], optimize: bool = False, options: Any = None):
        """``options``: the ``PassOptions`` to optimize with (e.g. ``quantize``; default fp32)."""
        import dataclasses

        from fusec.ir import verify

        self.graphs = dict(graphs)
        if optimize:
            from fusec.bulk import sharing_derived
            from fusec.passes.base import PassOptions
            from fusec.passes.pipeline import optimize as run_passes

            def fresh() -> Any:  # weights read [N, K], as generation plans read them
                if options is None:
                    return PassOptions(weights_nk=True)
                return dataclasses.replace(options, declines=[], stats={}, weights_nk=True)

            with sharing_derived():  # the graphs share what the passes derive from their weights
                self.graphs = {k: run_passes(g, fresh())[0] for k, g in self.graphs.items()}
        for g in self.graphs.values():
            verify(g)
        self.meta = self.graphs["decode"].meta["generation"]
        self.state: dict[str, np.ndarray] = {}
        g = self.graphs["decode"]
        for src, _ in g.state_pairs():
            self.state[src.name] = np.zeros(src.shape, src.dtype.np)
        self._steps = 0

    def set_state(self, name: str, value: np.ndarray) -> None:
        self.state[name] = np.asarray(value).astype(self.state[name].dtype).reshape(self.state[name].shape)

    def write_states(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            self.set_state(name, value)

    def read_state(self, name: str) -> np.ndarray:
        return self.state[name].copy()

    def fetch(self, name: str) -> Ready:
        """The state now (the reference backend has run every step already)."""
        return Ready(self.read_state(name))

    def _run(self, entry: str, inputs: Mapping[str, np.ndarray]) -> None:
        from fusec import reference

        g = self.graphs[entry]
        feeds = dict(inputs)
        for src, _ in g.state_pairs():
            feeds[src.name] = self.state[src.name]
        out = reference.run(g, feeds)
        # one dict update: a Ctrl-C arrives between bytecodes, so the state is never half-updated
        self.state.update({src.name: out[dst.name] for src, dst in g.state_pairs() if dst is not src})
        self._steps += 1

    def prefill(self, input_ids: np.ndarray, lengths: np.ndarray, timed: bool = True, measure: bool = False) -> None:
        self._steps = 0
        self._run("prefill", {"input_ids": input_ids, "lengths": np.asarray(lengths, np.int64)})

    def admit(self, feeds: Mapping[str, np.ndarray]) -> None:
        self._run("admit", feeds)

    def join(self, feeds: Mapping[str, np.ndarray]) -> None:
        self._run("join", feeds)

    def decode(self) -> None:
        self._run("decode", {})

    def sync(self) -> None:
        pass

    def measure(self, on: bool) -> None:
        pass

    def finished(self) -> bool | None:
        return bool(self.state["done"].all())

    def stats(self) -> dict[str, Any]:
        return {"backend": "reference", "runs": self._steps}
