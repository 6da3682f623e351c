"""Every ``FUSEC_*`` environment knob, declared once and read when used (never cached at import,
so a test or a caller that sets one later is obeyed).

A knob is a name, a kind and a default; ``get(NAME)`` parses it and names the variable in a
one-line ``InputError`` when its text is not of its kind. ``fusec --help`` lists them
(``describe``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from fusec.errors import InputError

_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no", "")


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # "bool", "int", "float", "path", "text", "choice"
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    bounds: tuple[int, int | None] | None = None  # an int knob's range: (lowest, highest or None)


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("FUSEC_CACHE_DIR", "path", None, "kernel cache directory (default ~/.cache/fusec); must be private"),
    Knob("FUSEC_COMPILE_THREADS", "int", 0, "NVRTC compile threads (0: one per core, at most 16)"),
    Knob("FUSEC_BULK_THREADS", "int", 0, "threads converting weights on the host (0: one per core, at most 16)"),
    Knob("FUSEC_DEBUG", "bool", False, "print tracebacks with errors"),
    Knob("FUSEC_DUMP_SOURCE_ON_ERROR", "bool", False, "print a kernel's numbered source when NVRTC rejects it"),
    Knob("FUSEC_MAX_ELEMENTS", "float", None, "largest tensor (elements) a model or input may declare (unset: 2**32)"),
    Knob("FUSEC_MAX_BYTES", "float", None, "largest tensor or file (bytes) read into memory (unset: 64 GiB)"),
    Knob("FUSEC_NVTX", "bool", False, "NVTX ranges around each launch (Nsight Systems)"),
    Knob("FUSEC_LINEINFO", "bool", False, "compile kernels with source line information (Nsight Compute's "
         "per-line stall sampling; benchmarks/gpu_session.sh qncu)"),
    Knob("FUSEC_TRACE", "bool", False, "compile kernels that record per-block timestamps (start, after the PDL "
         "wait, end) in a module global, fc_trace (benchmarks/block_trace.py reads it; another binary: another key)"),
    Knob("FUSEC_PDL_PIN", "choice", "issue", "where a kernel's PDL wait sits after the weight loads it issues first "
         "(common.cuh fc_pdl_wait_after): issue: once they are issued (pinned by a clock read), so the work after the "
         "wait overlaps their flight; value: once their values return (1.2% slower in the Llama-1B Q4_K_M decode "
         "step, 1.9% at 7B, 2.9% in Q8_0, H200; the A/B of benchmarks/decode_step.py --ab FUSEC_PDL_PIN=value)",
         ("issue", "value")),
    Knob("FUSEC_CUPTI", "bool", True, "allow fusec's driver counters (CUPTI) when stats are asked for"),
    Knob("FUSEC_CUPTI_MODE", "choice", "lazy", "which CUPTI activity kinds stay on once the counters are attached: "
         "lazy, the copy kinds only inside measured runs; always, all of them (every graph launch then pays ~1 us a "
         "node)", ("always", "lazy")),
    Knob("FUSEC_LT_PICK", "bool", False, "time cuBLASLt's candidate algorithms when a plan is loaded on a GPU"),
    Knob("FUSEC_GEMV_FORM", "choice", "ring", "how decode products stream their weights: a shared-memory ring "
         "(the default) or two register buffers (the A/B of benchmarks/decode_step.py --gemv-forms)", ("ring", "register")),
    Knob("FUSEC_GEMV_BULK", "choice", "auto", "decode products' ring: TMA bulk copies from one thread (sm_90) instead of "
         "cp.async from every thread, where K is a multiple of the k group; auto: the rule (build_gemm.gemv_form: up to 4 rows), "
         "1/0: everywhere/nowhere (the A/B of decode_step.py --ab FUSEC_GEMV_BULK=1)", ("auto", "1", "0")),
    Knob("FUSEC_GEMV_L2_EVICT_FIRST", "bool", True, "decode products' ring: the weights' copies carry an L2 "
         "evict-first policy, so that the bytes a step reads once leave L2 before the activations, caches and code it "
         "reads again (H200, batch 1: Qwen3-0.6B 0.547 ms a step against 0.565, the Llama-1B shape 0.757 against 0.768; "
         "Qwen3 batch 8 0.725 against 0.722; the A/B of decode_step.py --ab FUSEC_GEMV_L2_EVICT_FIRST=0). The packed "
         "forms load plainly: under the policy Q4_K_M gained nothing and Q8_0 lost 8-9 us a step"),
    Knob("FUSEC_WGMMA_L2_EVICT_FIRST", "bool", True, "fusec's GEMM in its wgmma form (sm_90; a prefill's "
         "products): the weight's copies carry an L2 evict-first policy, as the decode products' do (H200, in turns, "
         "the same bits: Qwen3-0.6B's 128-token prefill 1.145 ms against 1.151, the Llama-1B shape's 32-token one "
         "1.044 against 1.071; the A/B of prefill_step.py --ab FUSEC_WGMMA_L2_EVICT_FIRST=0)"),
    Knob("FUSEC_GEMV_SPREAD", "choice", "0", "decode products: spread each k group over 1, 2 or 4 times the warps "
         "(a lane holding 1/2 or 1/4 of the chunks; 0: the rule, build_gemm.gemv_form; the A/B of "
         "benchmarks/decode_step.py --ab FUSEC_GEMV_SPREAD=1)", ("0", "1", "2", "4")),
    Knob("FUSEC_GEMV_COOP_NORM", "choice", "auto", "skinny products with a norm prologue: where the block normalizes "
         "x once into shared memory; auto: the rule (build_gemm.gemv_coop_norm: 1-4 and 9-16 rows), all: also 5-8 rows, "
         "where the rule normalizes x in the lanes' fragments (the A/B of decode_step.py --ab FUSEC_GEMV_COOP_NORM=all), "
         "1-2: at 1-2 rows only, as before the twenty-eighth session (9-16 rows normalize each tile's fragments: the A/B "
         "of prefill_step.py --prompt 16 --ab FUSEC_GEMV_COOP_NORM=1-2)", ("auto", "all", "1-2")),
    Knob("FUSEC_GEMV_COOP_PREWAIT", "choice", "one", "skinny products that normalize x in the block: ring stages "
         "issued before the PDL wait; one: the first, the rest once x has arrived (measured at batch 1), all: every "
         "S - 1, as other products (the A/B of prefill_step.py --prompt 16 --ab FUSEC_GEMV_COOP_PREWAIT=all)",
         ("one", "all")),
    Knob("FUSEC_QGEMV_FORM", "choice", "auto", "how decode products over packed weights compute: auto, the rule "
         "(lower.qgemv_form.gemv_form: integer dot products over x as two 8-bit digits per value up to 3 rows of "
         "fp16/bf16 x and up to 8 where the tensor-core form does not apply, tensor cores for 4- to 8-bit codes "
         "where they fit, else fp32 FMAs; past 8 rows tensor cores only); tc: the rule without the dp4a form; dp4a: "
         "the rule without the tensor-core form; fma: fp32 FMAs everywhere up to 8 rows (past them the prefill's "
         "paths; the A/B of benchmarks/quant_bench.py --variants and benchmarks/decode_step.py --ab "
         "FUSEC_QGEMV_FORM=dp4a)",
         ("auto", "tc", "dp4a", "fma")),
    Knob("FUSEC_QGEMV_MAX_ROWS", "int", 16, "the most rows of x the quantized GEMV takes (0-16), past 8 only in its "
         "tensor-core form (fusec.lower.quant.qgemv_takes); a product over packed weights it does not take runs a "
         "prefill's path (the dequantize-in-tile GEMM or scratch + cuBLAS, fusec.lower.quant.choose). 8 gives rows "
         "9-16 to the prefill's paths; fewer than 8 is slower at batch 8 (1B Q4_K_M 2.830 ms a step against 1.175 "
         "when the GEMV was last measured so). The A/B of benchmarks/decode_step.py --batches 16 --ab "
         "FUSEC_QGEMV_MAX_ROWS=8", bounds=(0, 16)),
    Knob("FUSEC_QGEMM", "choice", "auto", "how a prefill's products over packed weights (more rows of x than the "
         "quantized GEMV takes) compute: auto, the rule (fusec.lower.quant.choose, tile_wins: the tile where it was "
         "measured faster); tile: dequantized in the tile of a tensor-core GEMM (templates/qgemm_tc.cu.jinja) "
         "wherever it applies (fp16/bf16 x, K a multiple of 64); "
         "scratch: dequantized into scratch, then cuBLAS (the A/B of benchmarks/prefill_step.py --ab "
         "FUSEC_QGEMM=scratch)", ("auto", "tile", "scratch")),
    Knob("FUSEC_QGEMM_TILE", "text", "", "the dequantize-in-tile GEMM's block as mt,rw,kw[,ks[,blocks]] (n8 tiles of x, "
         "warps over weight rows, warps over K, blocks of a cluster over K (sm_90), blocks an SM its registers are "
         "budgeted for; e.g. 4,4,1,4), for every product it takes; empty: the rule "
         "(fusec.lower.quant.qgemm_tiling)"),
    Knob("FUSEC_QGEMV_DP4A_CHUNKS", "choice", "auto", "the dp4a quantized GEMV's 32-weight chunks a lane loads a "
         "round over its weight rows at one row of x: auto, 8 (two weight rows a task below K = 8192) except where 8 "
         "spill beside the norm prologue's x (lower.qgemv_form.dp4a_heavy: 4 there); 8 or 4 everywhere (4: half the "
         "bytes in flight, 7% slower at the 7B Q4_K_M shape on an H200; 8 where it spills: the A/B of "
         "benchmarks/decode_step.py --ab FUSEC_QGEMV_DP4A_CHUNKS=8)", ("auto", "4", "8")),
    Knob("FUSEC_QGEMV_DP4A_FILL", "bool", True, "the dp4a quantized GEMV at one row of x gives products with short "
         "weight rows (a lane takes at most K / 1024 of a row's chunks a round) 4 rows a task, two gated pairs, so a "
         "round still loads 8 chunks a lane, where every warp still gets a task (Llama-1B's gate/up and LM head: "
         "0.502 ms a step against 0.514 with 0, H200), and long rows two a task at half the chunks each where a warp then "
         "makes fewer round trips (the 7B downs: 1.722 ms a step against 1.749 with 0, H200; the A/B of "
         "benchmarks/decode_step.py --ab FUSEC_QGEMV_DP4A_FILL=0)"),
    Knob("FUSEC_QGEMV_DP4A_WIDE_ROWS", "choice", "4", "the dp4a quantized GEMV at 4-8 rows of x: 4, four weight rows a "
         "task with one chunk each, so each read of x's digits from shared memory serves 4 rows (8-bit codes with a "
         "constant zero point: zero-point operands and shorter codes spilled); 1, one weight row a task and 2 chunks "
         "a round (1-2% slower in Llama-1B Q8_0's "
         "batch-4 and batch-8 steps, H200; the A/B of benchmarks/decode_step.py --model llama-1b-q8_0 --batches 8 "
         "--ab FUSEC_QGEMV_DP4A_WIDE_ROWS=1)", ("1", "4")),
    Knob("FUSEC_QGEMV_DP4A_NORM_EARLY", "bool", True, "the dp4a quantized GEMV with a norm prologue loads the norm's "
         "weights before the PDL wait where x is one batch of a thread's pieces (M K <= 8192), so its x phase has one "
         "round trip to memory fewer; 0: after the wait, beside x (2.8% slower in the Llama-1B Q4_K_M decode step, "
         "4.1% at 7B, H200; the A/B of benchmarks/decode_step.py --ab FUSEC_QGEMV_DP4A_NORM_EARLY=0)"),
    Knob("FUSEC_QGEMV_TC_RUNS", "choice", "4", "runs of chunks a warp of the tensor-core quantized GEMV may copy into "
         "shared memory in turn, where a block's copy of its 16 rows does not fit at once (lower.qgemv_form.gemv_form; "
         "1: such products take the FMA form, as before the sixteenth session; the A/B of benchmarks/decode_step.py "
         "--ab FUSEC_QGEMV_TC_RUNS=1)", ("1", "2", "3", "4")),
    Knob("FUSEC_QGEMV_TC_RUN_KB", "choice", "100", "KB of shared memory a block of the tensor-core quantized GEMV "
         "may copy its rows' run into (lower.qgemv_form.tc_smem_max; more runs a warp where a block's copy is larger): "
         "the Llama-1B Q4_K_M step at batch 8 took 0.766 ms at 100 against 0.777-0.779 at 144, the limit before (H200, "
         "forty-third session); the A/B of benchmarks/decode_step.py --ab FUSEC_QGEMV_TC_RUN_KB=144",
         ("64", "100", "144")),
    Knob("FUSEC_QGEMV_TC_STAGES", "choice", "1", "commit groups the tensor-core quantized GEMV issues a warp's copy "
         "of its chunks in (lower.qgemv_form.gemv_form): from 2, the warp sums a stage's chunks while the later ones "
         "are in flight, and the scale table's first loads issue before the copies. 1 (every chunk copied before any "
         "is summed) stays: the 1B Q4_K_M step at batch 8 took 0.810 ms with 2 and 0.904 with 4 against 0.815 (H200, "
         "forty-first session; the A/B of benchmarks/decode_step.py --model llama-1b-q4_k_m --batches 8 --ab "
         "FUSEC_QGEMV_TC_STAGES=2)", ("1", "2", "3", "4")),
    Knob("FUSEC_QGEMV_TC_MIN_WARPS", "choice", "auto", "the tensor-core quantized GEMV's fewest warps a block "
         "(lower.qgemv_form._tc_min_warps; auto: 8 for 8-bit codes, else 4; the A/B of benchmarks/decode_step.py "
         "--model llama-1b-q8_0 --batches 8 --ab FUSEC_QGEMV_TC_MIN_WARPS=4)", ("auto", "4", "8")),
    Knob("FUSEC_QGEMV_TC_GATE", "bool", True, "the tensor-core quantized GEMV takes a gated unit's SwiGLU as its "
         "epilogue (a block's 16 rows: 8 of each half), one launch fewer a layer at 3-8 rows of x (H200, 1B Q4_K_M "
         "batch 8: 0.877 ms a step against 0.893 with the SwiGLU apart, same bits; 0: apart, the A/B of "
         "benchmarks/decode_step.py --model llama-1b-q4_k_m --batches 8 --ab FUSEC_QGEMV_TC_GATE=0)"),
    Knob("FUSEC_QGEMV_WIDE_GATE", "choice", "dp4a", "a gated quantized product at 4-8 rows of x that the tensor-core "
         "form does not take (FUSEC_QGEMV_FORM=dp4a, or rows too long for its shared memory): dp4a: the dp4a "
         "form, the gated unit apart; fma: the FMA form with its gated unit (the 1B Q8_0 decode step at batch 8 "
         "without tensor cores: 1.697 ms against 2.696, H200; the A/B of benchmarks/decode_step.py --ab "
         "FUSEC_QGEMV_FORM=dp4a+FUSEC_QGEMV_WIDE_GATE=fma)", ("dp4a", "fma")),
    Knob("FUSEC_QGEMV_DP4A_CLUSTER", "choice", "auto", "the dp4a quantized GEMV on sm_90: blocks a thread block cluster "
         "whose warps take turns writing x's digits, each into every block's shared memory; auto: the rule "
         "(lower.qgemv_form.gemv_form: 2 at 4-8 rows of x and at one row without the norm prologue, else 1); 1: every "
         "block writes all of x's digits (the A/B of benchmarks/decode_step.py --model llama-1b-q8_0 --batches 8 "
         "--ab FUSEC_QGEMV_DP4A_CLUSTER=1); gated: the rule, and 2 for a gated product with the norm at one row",
         ("auto", "gated", "1", "2", "4")),
    Knob("FUSEC_QGEMV_DP4A_BLOCKS", "choice", "0", "the dp4a quantized GEMV's blocks an SM (its grid, and the registers "
         "its launch bounds give a thread); 0: the rule (lower.qgemv_form.gemv_form; the A/B of "
         "benchmarks/decode_step.py --ab FUSEC_QGEMV_DP4A_BLOCKS=3)", ("0", "1", "2", "3")),
    Knob("FUSEC_KV_PREFETCH", "bool", True, "decode attention loads the cache rows older than the step before its "
         "PDL wait, where the program shows the kernel before it does not write them (off: the A/B of "
         "benchmarks/decode_step.py --ab FUSEC_KV_PREFETCH=0)"),
    Knob("FUSEC_KV_MMA", "choice", "auto", "decode attention's key loop on tensor cores (fp16/bf16, head_dim 64 or "
         "128): each warp takes 8-key tiles, the scores and P V as mma steps, P rounded to the cache's dtype "
         "(templates/kv_mma.jinja). auto: decode steps with at least 4 q heads a kv head (build_decode.kv_mma_rule, "
         "with its measurements); 1: wherever it applies; 0: never (the A/B of decode_step.py --ab FUSEC_KV_MMA=0)",
         ("auto", "1", "0")),
    Knob("FUSEC_KV_CLUSTER", "bool", True, "decode attention on sm_90 merges up to 8 splits through a thread block "
         "cluster's shared memory instead of global memory and a counter (off: the A/B of decode_step.py --ab)"),
    Knob("FUSEC_KV_CLUSTER_LEVELS", "choice", "2", "decode attention on sm_90 with more than 16 splits (batch 1-2, a "
         "cache of more than 512 rows) at 4 keys a key group: 2 makes the splits clusters of 8, and a context in the "
         "first cluster merges there, a longer one through global memory; 1 merges every split through global "
         "memory, as before the twenty-seventh session (the A/B of benchmarks/decode_step.py --ab "
         "FUSEC_KV_CLUSTER_LEVELS=1)", ("1", "2")),
    Knob("FUSEC_KV_SOLO_KEYS", "int", 128, "decode attention whose splits merge through global memory (no cluster): "
         "a context of at most this many keys runs in one block a head, with no merge (0: always split). Qwen3-0.6B, "
         "batch 1, contexts 16-116 in a 4,240-row cache: 0.613 ms a step against 0.646 split (H200); contexts past it "
         "run as before (the A/B: benchmarks/decode_step.py --context 16 --steps 100 --cache 4240 --ab "
         "FUSEC_KV_SOLO_KEYS=0)", bounds=(0, None)),
    Knob("FUSEC_KV_MAX_SPLITS", "int", 0, "decode attention: at most this many splits of a head's keys (0: the "
         "rule's; 1: one block a head, no merge). The rule's most splits won, in turns on an H200: the 7B int4 step "
         "(32 kv heads, 176-row cache: 6 splits) 1.310 ms against 1.452 (1), 1.340 (2), 1.350 (3); Llama-1B Q4_K_M "
         "0.449 against 0.484 (1), 0.469 (2), 0.452 (4); Qwen3-0.6B 0.552 against 0.777, 0.673, 0.559 (the A/B of "
         "benchmarks/int4_7b.py or decode_step.py --ab FUSEC_KV_MAX_SPLITS=2)", bounds=(0, None)),
    Knob("FUSEC_KV_SPLIT_KEYS", "int", 64, "decode attention: the fewest cache rows (of its capacity) a split may "
         "cover where the batch's heads alone fill a quarter of the SMs (32: the A/B of decode_step.py --ab "
         "FUSEC_KV_SPLIT_KEYS=32, as before)", bounds=(1, None)),
    Knob("FUSEC_KV_TRIGGER", "choice", "wait", "decode attention: where each block lets the kernel after it launch "
         "(PDL): wait: right after its own wait; prologue: once q (and the step's k/v rows) are in; merged: once its "
         "key groups are merged; end: when it exits. Qwen3-0.6B on an H200, in turns: batch 1 0.551 ms a step against "
         "0.565 (prologue), 0.569 (merged) and 0.587 (end), batch 8 0.714 against 0.738 and 0.754 (0.729 against 0.729 "
         "for prologue); the o product's blocks beside it slow the attention by ~0.2 us, and loading their weights "
         "early is worth more (the A/B of decode_step.py --ab FUSEC_KV_TRIGGER=merged)",
         ("wait", "prologue", "merged", "end")),
    Knob("FUSEC_KV_WAVE_BLOCKS", "choice", "4", "decode attention: blocks an SM its full-context split count is "
         "sized for, one wave (fusec.codegen.build_decode.KV_WAVE_BLOCKS: 4 at the kernel's ~110 registers a thread; "
         "8: the first form's, as before the twenty-sixth session; the A/B of benchmarks/decode_step.py --batches 32 "
         "--ab FUSEC_KV_WAVE_BLOCKS=8)", ("4", "8")),
    Knob("FUSEC_KV_UNROLL", "choice", "0", "decode attention: keys each key group loads at a time, so also how many "
         "older rows load before the PDL wait (0: the layout's, 4 for D 128 bf16; the A/B of decode_step.py --ab "
         "FUSEC_KV_UNROLL=8)", ("0", "2", "4", "8")),
    Knob("FUSEC_GEMM_STREAM", "choice", "auto", "products of at most 128 rows of fp16/bf16 activations over a "
         "constant weight (a prefill's, a small request's) on fusec's stream-form GEMM (a block holds every row; on "
         "sm_90 clusters split K, the products run on wgmma, and a gated unit is its epilogue) instead of cuBLAS; "
         "auto: on sm_90 only (its wgmma form), 1: wherever the form fits (the mma.sync form elsewhere), 0: never "
         "(the A/B of benchmarks/prefill_step.py --ab FUSEC_GEMM_STREAM=0, benchmarks/stream_ab.py)",
         ("auto", "0", "1")),
    Knob("FUSEC_ATTN_QWARPS", "choice", "auto", "fp16/bf16 attention (prefill, encoders): warps of a block along the "
         "query rows, the rest splitting each key tile; auto: the kernel selection's (build_attention.query_warps: two, "
         "four where two would take more than a wave, as BERT-base's batch 32; the A/B of benchmarks/prefill_step.py "
         "--ab FUSEC_ATTN_QWARPS=4)", ("auto", "1", "2", "4")),
    Knob("FUSEC_ATTN_BN", "choice", "auto", "fp16/bf16 attention: keys a K/V tile; auto: the kernel selection's "
         "(build_attention.key_tile: 32 at four query warps and a head dimension past 64, else 64; the A/B of "
         "benchmarks/prefill_step.py --ab FUSEC_ATTN_BN=64)", ("auto", "32", "64")),
    Knob("FUSEC_HEAD_ROPE_RPW", "choice", "auto", "the head_rope kernel (q/k norm, RoPE, cache writes): head rows a "
         "warp; auto: build_heads.rows_per_warp (4 where S allows and 4 blocks an SM remain); a count is taken where it "
         "divides S, else 1 (the A/B of benchmarks/prefill_step.py --ab FUSEC_HEAD_ROPE_RPW=1)", ("auto", "1", "2", "4")),
    Knob("FUSEC_PDL", "bool", True, "launch kernels that allow it with programmatic dependent launch (sm_90+)"),
    Knob("FUSEC_API_KEY", "text", None, "fusec serve: the bearer token clients must send (default: --api-key)"),
)}


def raw(name: str) -> str | None:
    """The variable's text, or None when unset (``name`` must be a declared knob)."""
    if name not in KNOBS:
        raise KeyError(f"undeclared fusec knob {name!r}")
    return os.environ.get(name)


def get(name: str) -> Any:
    """The knob's value now: parsed from the environment, else its default."""
    return value(name, raw(name))


def forced_count(name: str) -> int | None:
    """A rule's "auto"-or-number choice knob (FUSEC_ATTN_QWARPS, FUSEC_ATTN_BN, FUSEC_HEAD_ROPE_RPW): the number it
    forces, or None where it leaves the rule to decide."""
    v = get(name)
    return None if v == "auto" else int(v)


def value(name: str, text: str | None) -> Any:
    """``text`` parsed as knob ``name``'s kind (None: the default); InputError names the variable."""
    k = KNOBS[name]
    if text is None:
        return k.default
    t = text.strip()
    if k.kind == "bool":
        if t.lower() in _TRUE:
            return True
        if t.lower() in _FALSE:
            return False
        raise InputError(f"environment variable {name}={text!r} must be 0 or 1")
    if k.kind == "int":
        try:
            n = int(t) if t else k.default
        except ValueError:
            raise InputError(f"environment variable {name}={text!r} is not an integer") from None
        if k.bounds and not (k.bounds[0] <= n and (k.bounds[1] is None or n <= k.bounds[1])):
            lo, hi = k.bounds
            raise InputError(f"environment variable {name}={text!r} must be "
                             + (f"at least {lo}" if hi is None else f"{lo} to {hi}"))
        return n
    if k.kind == "float":
        if not t:
            return k.default
        try:
            return float(t)
        except ValueError:
            raise InputError(f"environment variable {name}={text!r} is not a number") from None
    if k.kind == "choice":
        if t.lower() not in k.choices:
            raise InputError(f"environment variable {name}={text!r} must be one of {', '.join(k.choices)}")
        return t.lower()
    return t or k.default


def describe() -> list[str]:
    """One line per knob, for --help and the README."""
    return [f"{k.name} ({k.kind}{'' if k.default is None else f', default {k.default!r}'}): {k.help}"
            for k in KNOBS.values()]
