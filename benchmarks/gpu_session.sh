#!/bin/bash
# One device call of a session: install fusec (editable, no deps) and the carried wheels, then run
# the named steps, each under its own time limit, results under $OUT (or /tmp/gpu_session).
# Usage: bash benchmarks/gpu_session.sh STEP [STEP ...]
#   kernels   GPU tests of the decode kernels, PDL and generation
#   gpu_all   every GPU test (benchmarks/gpu_check.sh; 563 s of a call in the thirty-fifth session)
#   gpu_k     the kernels' GPU tests alone (8 workers); gpu_r: the whole-plan, family and A/B GPU tests
#   qgemm     the dequantize-in-tile GEMM: its GPU tests and the packed plans', alone against the scratch path by
#             tiling (benchmarks/qgemm_bench.py), Llama-1B Q4_K_M prefills of 32 and 128 tokens against FUSEC_QGEMM=scratch
#   int4_7b   issue 22's 7B int4 target: fusec --quantize int4 (group 128, head packed) at batch 1 against its packed-weight
#             roofline and gpt-fast's int4 form compiled in torch, in turns (benchmarks/int4_7b.py, ~7 minutes; $INT4_AB:
#             its --ab variants)
#   gcl       clusters of 2 for the gated product with the norm at one row: dp4a GPU tests, 7B int4 and Llama-1B Q4_K_M
#   hw        the 5/6-bit products alone under Nsight Compute against an earlier tree ($OLD_TREE, default .old/tree:
#             a git archive, carried); hwstep: the decode steps of both trees ($HW_MODELS, default llama-1b-q4_k_m, at
#             batches $HW_BATCHES, default 1,8), each its own process, in turns (qtests: every packed GPU test)
#   tctrace   the tensor-core quantized GEMV's blocks in the 1B Q4_K_M step at batch 8 (block_trace.py --blocks qgemv)
#   kvs       the decode attention's split count (FUSEC_KV_MAX_SPLITS 1, 2, 3 against the rule's 6 at the 7B int4 step's 32
#             kv heads; 1, 2, 4 at Llama-1B Q4_K_M and Qwen3-0.6B): where its merges' fixed cost goes
#   kvab      the decode attention's merge knobs (clusters off, split keys 128 and 32) on Llama-1B Q4_K_M and Qwen3-0.6B
#   c1        clusters of 2 for the one-row dp4a products without the norm: their GPU tests, the 7B int4 step and the
#             Q4_K_M decode steps (Llama-1B, 7B; batch 1) against FUSEC_QGEMV_DP4A_CLUSTER=1
#   qgncu     Nsight Compute of the tile GEMM at 32 rows, Llama-1B's qkv in Q4_K (QG_TILE: its tiling)
#   qgemm3    the tile GEMM's GPU tests, alone at 32 rows in Q4_K, and the Llama-1B Q4_K_M 32-token prefill against scratch
#   qgemm2    the tile GEMM's GPU tests; Llama-1B Q4_K_M and Q8_0 32-token prefills: the rule against scratch and tile
#   lt_t      the cuBLASLt algorithm-pick GPU tests (tests/test_lt_algo.py)
#   validate  what the fifth session left unrun on a GPU: the generation tests (prefill attention over the caches), the
#             decode kernels and GEMV tests (the ring's 4-stage case), the serve tests (read-backs every 4 steps)
#   gemv      decode products alone vs cuBLAS (benchmarks/bench_decode_kernels.py --only gemv)
#   kv        split attention alone (--only kv)
#   rings     the decode products' shared-memory ring forms (stages x tiles per block) beside the register form and cuBLAS
#   gncu      Nsight Compute counters of the skinny product's forms and cuBLAS on the LM head's shape (benchmarks/gemv_ncu.py)
#   gtests    the skinny-product GPU tests (tests/test_gemv_gpu.py)
#   step_q    Qwen3-0.6B decode step (and prefill time), PDL vs plain, batch 1 and 8, the GEMV's ring form vs its register form (benchmarks/decode_step.py)
#   prof27    per-kernel profiles of the Qwen3-0.6B decode step (batch 1, 8) and the Llama-1B Q4_K_M one (batch 1)
#   xprobe    an L2-resident load's latency behind the SM's cold weight bytes in flight, by how they were asked for
#   kvmerge   the global split merge's GPU tests; the attention alone (B 1, 8) and Qwen3 at batch 1 and 4,096 tokens with
#             the merge against the one before it (.old/kv_attention.cu.jinja, carried), each in its own process
#   kvm2      the attention's blocks traced in the Qwen3 step at batch 1 and 4,096 tokens; the merge's loads a share
#             8 at a time against 16 and 4 (.old/kv_u16.jinja, kv_u4.jinja), alone
#   kvT       the attention alone at batch 1 and 128 keys in caches of 272, 1,024 and 4,096 rows (cluster or global merge)
#   kvcl      the attention's clusters of 8 merged over the clusters: its GPU tests; alone at batch 1 in 1,024- and
#             4,096-row caches; Qwen3 batch 1 at 128 tokens in a 4,096-row cache and at 4,096 tokens, in turns against
#             FUSEC_KV_CLUSTER_LEVELS=1 (and at 4,096 tokens FUSEC_KV_UNROLL=4 against the rule's 8)
#   solo      the kv GPU tests; Qwen3 at batch 1 and 2, 128 tokens in a 4,240-row cache (global merges), in turns against
#             FUSEC_KV_SOLO_KEYS=0
#   next27    Qwen3 batch 1 in a 4,240-row cache: FUSEC_KV_SOLO_KEYS=128 at 16-116 keys; FUSEC_KV_UNROLL=4 (clusters) at
#             512 and 2,048 tokens against the rule's 8 keys a group (~6 minutes)
#   step_kv   Qwen3-0.6B (batch 1, 8) and the Llama-1B shape (batch 1) decode steps: the default, without the attention's
#             cluster merge (FUSEC_KV_CLUSTER=0), without that and its older cache rows loaded before the PDL wait
#   step_sp   Qwen3-0.6B (batch 1, 8) decode steps: the spread rule against k groups over 1 and 2 times the warps
#             everywhere (FUSEC_GEMV_SPREAD)
#   step_kvs  Qwen3-0.6B batch 1 and 8 decode steps: splits of at least 64 cache rows (the default) against 32
#   kvtests   the decode attention's and the plans' GPU tests (kernels, PDL, generation, join)
#   kvh       the attention with its head_rope prologue (rope_attention): kernel bits, and the plans' GPU tests around it
#   step_ra   Qwen3-0.6B batch 1 and 8 decode steps: with rope_attention (the default) against without it
#   step_ra2  the same, each with and without the attention's cluster merge, and with 32-row splits
#   step_u    Qwen3-0.6B batch 1 and 8 decode steps: the attention's key groups loading 8 keys at a time (and before
#             the wait) against the layout's 4; with the unroll-8 attention's GPU tests first
#   step_u4   Qwen3-0.6B batch 1 and 8 decode steps: the unroll rule (the default) against 4 everywhere
#   step_lra  the Llama-3.2-1B shape, batch 1 (32-token prompt): with rope_attention (the default) against without it
#   bert_k    the attention alone at BERT-base's shape (B 32, S 128; key padding mask, none) by block shape and stages,
#             Nsight Compute of two, and the per-kernel profiles (CUPTI, graph replays) of BERT-base and GPT-2 small
#   bert_v    the bias + erf-GELU kernel's forms (benchmarks/gelu_bench.py), the attention's and elementwise kernels' GPU
#             tests, and BERT-base's per-kernel profile (~1 minute)
#   stream_t  the stream-form GEMM's blocks traced by phase (first slice, K loop, tile shared, stored) at Qwen3-0.6B's and
#             Llama-1B's prefill products by K split, then its times against cuBLAS (~2 minutes)
#   wgmma     the stream form's blocking on wgmma (sm_90a): its GPU tests, its times against cuBLAS and the mma.sync
#             stream form at Qwen3-0.6B's and Llama-1B's prefill products by K split, its blocks' phases (~4 minutes)
#   wg_ring   the wgmma form by K split and ring cap (8: the rule's deep ring where the blocks are one an SM; 4, 3:
#             shallow), alone against cuBLAS at Qwen3-0.6B's and Llama-1B's prefill products (~3 minutes)
#   rows_t    the GPU tests of the attention and the row kernels (norms, softmax, reductions)
#   plans_t   the GPU tests of whole plans (generation, families, serve, join, PDL, end to end, runtime, A/B, softcap):
#             with FUSEC_GEMM_STREAM set by the caller, what the products' back end changes
#   pre16     Qwen3-0.6B prefill at 16 tokens (caches of 32 and 4,240 rows) and at 128: times and per-kernel profiles
#   coop      the skinny products' norm in the block at 9-16 rows: GEMV GPU tests, 16-token prefill and batch 16 against
#             the rule before, batches 4 and 8 with it at 3-8 rows too (FUSEC_GEMV_COOP_NORM)
#   coop2     the norm in the block at 1-4 and 9-16 rows: GEMV GPU tests, batches 3-4 and the Llama-1B shape's 4 against
#             the rule before, a 16-token prefill with all ring stages before the wait (FUSEC_GEMV_COOP_PREWAIT=all)
#   norm8     the norm's roundings two a packed cvt: GEMV GPU tests, a 16-token prefill, Qwen3 decode at batches 1-16
#   gvm       the decode products alone at 1, 8 and 16 rows of x: register form, the rule's form, cuBLAS
#   prelong   Qwen3-0.6B prefill of 512 and 2,048 tokens: times and per-kernel profiles
#   causal    Qwen3-0.6B prefill at 128, 512 and 2,048 tokens (the attention causal, no mask): times, per-kernel profiles
#   ewvec     indexed elementwise chains in 16-byte vectors: elementwise GPU tests, the 2,048-token prefill
#   next28    the GEMV and A/B GPU tests changed after the twenty-eighth session's last run; prefill at 16, 128, 2,048
#   n29       multi-output elementwise and attention GPU tests; the attention alone in turns against the previous
#             template (benchmarks/ab_prev); prefill at 128 and 2,048 tokens; decode at batches 1 and 8
#   n29b      the attention's compares on the diagonal only: its GPU tests, the kernel alone against benchmarks/ab_prev,
#             the 2,048-token prefill, the whole-plan GPU tests (plans_t)
#   n29c      the attention alone by keys a tile (bn 64, 32) at the long prompt's, BERT's, Qwen3's and GPT-2's shapes
#   n29d      the attention's GPU tests with 32-key tiles, the kernel alone by launch bound, the 2,048-token prefill
#             against FUSEC_ATTN_BN=64
#   n29e      head_rope's rows a warp: GPU tests, prefill at 2,048 and 512 tokens against FUSEC_HEAD_ROPE_RPW=1, decode b1
#   n29f      the attention's one-barrier ring: GPU tests, alone against benchmarks/ab_prev, prefill 2,048 and 128,
#             compare.py bert-base gpt2-small
#   n29g      the same with the whole ring issued up front
#   l2b       how much of a decode step DRAM costs: Qwen3-0.6B (batches 1, 8) and the Llama-1B Q4_K_M shape (batch 1)
#             as compiled against every layer reading the first layer's weights (L2-hot; benchmarks/l2_bound.py)
#   drop      what a layer kernel costs a decode step: Qwen3-0.6B (batches 1, 8) and the Llama-1B Q4_K_M shape
#             (batch 1) without the o product, the attention, both, the down product in every layer (l2_bound.py --drop)
#   atr       the block trace of Qwen3-0.6B's decode step (batches 1, 8; context 128) with the attention's blocks that end
#             last (block_trace.py --blocks): where its ~3.3 us of fixed cost go, today
#   atr2      the same trace at batch 1, beside the plan whose PDL waits hold until the loads before them return
#             (FUSEC_PDL_PIN=value): is the attention's key loop waiting on its prefetched keys?
#   clock     the SMs' clock (clock64 cycles a globaltimer ns) alone and between decode steps (benchmarks/sm_clock.py)
#   l2ef      Qwen3-0.6B decode (batches 1, 8), its decode products' weights copied under an L2 evict-first policy (the
#             default) in turns against without it (FUSEC_GEMV_L2_EVICT_FIRST=0)
#   l2q       the Llama-1B shape's bf16 decode step (batch 1, context 32) in turns against FUSEC_GEMV_L2_EVICT_FIRST=0 (the
#             packed forms' plans have no bf16 product for the knob to change; in the thirty-second session's call 6
#             their codes loaded under the policy too: Q4_K_M gained nothing, Q8_0 lost 8-9 us a step, taken out)
#   l2w       Qwen3-0.6B and Llama-1B prefills of 128 and 32 tokens, the wgmma form's weight copies under the L2
#             evict-first policy (the default) in turns against without it (FUSEC_WGMMA_L2_EVICT_FIRST=0)
#   trig      Qwen3-0.6B decode (batches 1, 8): the attention letting the next kernel launch right after its wait (the
#             default) in turns against once its key groups are merged, and at its exit (FUSEC_KV_TRIGGER); the block
#             trace at batch 1 with the trigger at exit (the attention's phases without the o product's blocks beside)
#   qdq       the prefill's dequantizing kernel (stores staged through shared memory, thirty-third session): its GPU
#             tests and those of packed plans and generation, the kernel alone (benchmarks/dequant_bench.py), and the
#             Llama-1B Q4_K_M and Q8_0 prefills of 128 tokens
#   qfinal    every packed-weight GPU test, and the Llama-1B Q4_K_M and Q8_0 decode steps (batches 1, 8; context 32)
#             with their 32-token prefills (issue 22's table)
#   l2rate    the SMs' read rate from L2-resident buffers (8-48 MB) against HBM (4 GB) (benchmarks/l2_rate.py)
#   drop2     the same for Qwen3-0.6B's qkv and gate/up products
#   ctx4k     Qwen3-0.6B decode at a 4,096-token context, batches 1 and 32, with rooflines (issue 19's report)
#   ctx4k32   the same at batch 32 only (its ~15 GB cache compared by device digests: decode_step.py HOST_STATE_BYTES)
#   stream_ab built-in encoders at a few rows on cuBLAS against fusec's GEMM (benchmarks/stream_ab.py)
#   gemm_t    every GEMM GPU test (tests/test_kernels_gpu.py, test_pdl_gpu.py -k gemm: cuBLAS, the stream and wgmma forms)
#   stream    the GEMM GPU tests (the stream form: few rows, K split over clusters), then the Qwen3-0.6B and Llama-1B
#             prefills with their products on it (the default on sm_90) against cuBLAS (FUSEC_GEMM_STREAM=0), in turns
#   stream_k  the stream-form GEMM alone against cuBLAS at Qwen3-0.6B's and Llama-1B's prefill products, by K split, and
#             Nsight Compute of the first two Qwen3 shapes unsplit and split 4
#   step_final Qwen3-0.6B batch 1 and 8 decode steps as the defaults stand, with the per-kernel profile
#   trace     per-block timelines of the decode step's last layer (benchmarks/block_trace.py): Qwen3-0.6B batch 1 and
#             8 with PDL and with plain launches, the Llama-1B shape batch 1
#   step_l    the Llama-3.2-1B shape, batch 1, ring vs register form
#   peer      Qwen3-0.6B decode and prefill vs the gpt-fast-style torch peer (benchmarks/decode.py --quick)
#   kvm       the decode attention's key loop on tensor cores: the attention's GPU tests (every mode, the prologue's
#             bits), then Llama-1B Q4_K_M and Qwen3 at batch 1 and Qwen3 at batch 8, the rule against FUSEC_KV_MMA=0 and 1
#   kvmt      the block trace of Qwen3's attention at batches 1 and 8 with FUSEC_KV_MMA=1 against the rule
#   kvm7      the same knob and FUSEC_KV_TRIGGER=prologue on the 7B int4 step (benchmarks/int4_7b.py)
#   kvr       the GPU tests the tensor-core key loop's rule touches (attention, generation, PDL, head_rope pairs, families)
#   kvm1      the Llama-1B shape (GQA 4: the tensor-core loop by the rule) against FUSEC_KV_MMA=0: Q4_K_M at batches 1
#             and 8, bf16 at batch 1
#   kvtp      FUSEC_KV_TRIGGER=prologue, alone and with FUSEC_KV_MMA=1: the kvm steps
#   peer8     the same at batches 1 and 8 with the fp32 reference: greedy tokens against the peer's, and where a row
#             parts, whether its first differing tokens are a near-tie within bf16 rounding (issue 19's agreement)
#   quant     packed quantized weights: kernels and decode (benchmarks/quant_bench.py --quick)
#   quant_full  the same, every shape and format, the 16-layer decode models at batch 1 and 8
#   train     the training step vs PyTorch (benchmarks/train.py --no-compile --skip minilm)
#   train_full  the same with the torch.compile variant and the MiniLM fine-tune
#   qtests    the packed-weight GPU tests (kernels against the reference, generation token for token)
#   qtc       the tensor-core quantized GEMV against the exact sums (tests/test_quant_gpu.py -k tensor_core)
#   q14       the fourteenth session's dp4a rule (8 chunks a round at one row of x; 4-8 rows of x where tensor cores do
#             not apply): its GPU tests, then decode steps against the old choices (7B and 1B Q4_K_M batch 1 against
#             4 chunks; 1B Q8_0 batch 4 and 8 against the rule without dp4a, the FMA form there); about 6 minutes
#   q14b      a norm copied into each of the products that did not merge (passes/split_norms.py): the packed-weight
#             generation GPU tests and the families', then decode steps against disable=norm_copies (1B Q4_K_M batch 1
#             and 8, 7B batch 1)
#   q18       the dp4a norm prologue's weights loaded before the PDL wait: its bit test and the dp4a norm tests, then
#             decode steps in turns against FUSEC_QGEMV_DP4A_NORM_EARLY=0 (1B, then 7B Q4_K_M, batch 1; ~3 minutes)
#   q19       packed products at 4-8 rows of x through the dequantizing path (FUSEC_QGEMV_MAX_ROWS=4: dequantize to
#             scratch, then cuBLAS) against the quantized GEMV: its GPU test, then decode steps in turns, batch 8, 1B
#             Q8_0 and Q4_K_M (~3 minutes)
#   q42       the packed LM head sampling from its dp4a argmax partials (gemm_sample): its GPU tests and the packed
#             generation tests, then 1B and 7B Q4_K_M batch-1 decode steps in turns against disable=gemm_sample
#   q43       packed siblings (the q/k and v products of a Q6_K-v layer in one launch): their GPU tests and the packed
#             generation tests, then 1B and 7B Q4_K_M batch-1 decode steps in turns against disable=packed_siblings
#   q45       8-bit codes on the tensor-core quantized GEMV: its GPU tests (every format), then the Llama-1B Q8_0 decode
#             step at batches 4 and 8 in turns against FUSEC_QGEMV_FORM=dp4a, with per-kernel profiles (~4 minutes)
#   q47       every form of the quantized GEMV over Q8_0 on Llama-1B's shapes at 1-4 and 8 rows (quant_bench.py
#             --variants --formats q8_0: where the tensor-core form overtakes the dp4a form; ~4 minutes)
#   q48       the Llama-1B Q8_0 decode step at batches 4 and 8 in turns against FUSEC_QGEMV_FORM=tc (no dp4a form at 4
#             rows over many weight rows) and FUSEC_QGEMV_TC_MIN_WARPS=4 (8-bit codes on 4 warps), with profiles
#   q49       every quantized-GEMV form over Q4_K and Q6_K (quant_bench.py --variants), then the Llama-1B Q4_K_M decode
#             step at batches 4 and 8 in turns against FUSEC_QGEMV_TC_MIN_WARPS=8 and FUSEC_QGEMV_FORM=dp4a (~3 minutes)
#   kvwave    the decode attention's splits sized for 4 blocks an SM (FUSEC_KV_WAVE_BLOCKS, twenty-sixth session): its
#             GPU tests, then Qwen3-0.6B at batch 32 (context 128) in turns against FUSEC_KV_WAVE_BLOCKS=8
#   kvtrace   the block trace of Qwen3-0.6B at batch 32, context 1,024: where the step's attention (its head_rope
#             prologue, key loop, merge) spends the time it does not spend alone (250 against 153 us at 4,096)
#   q50       the tensor-core quantized GEMV's gated epilogue (FUSEC_QGEMV_TC_GATE, on since this A/B): its GPU tests,
#             then the Llama-1B Q4_K_M and Q8_0 decode steps at batches 4 and 8 in turns against FUSEC_QGEMV_TC_GATE=0
#   q20       where the decode attention's ~4 us go: the block trace with the blocks that end last of the attention
#             kernel (block_trace.py --blocks), Llama-1B Q4_K_M and Qwen3-0.6B bf16, batch 1 (~1 minute)
#   q21       the dp4a GPU tests (tests/test_quant_gpu.py -k dp4a), then the per-kernel profile of Llama-1B Q4_K_M at batch 1
#             and 8 with the defaults (decode_step.py; ~4 minutes)
#   q22       the PDL wait pinned after the weight loads' issue (the default since the sixteenth session) against after
#             their values (FUSEC_PDL_PIN=value): decode steps in turns, batch 1: Llama-1B Q4_K_M, 7B Q4_K_M, Llama-1B
#             Q8_0 (~5 minutes)
#   q24       the tensor-core quantized GEMV in runs (FUSEC_QGEMV_TC_RUNS; the 1B Q6_K down at batch 8): its GPU tests,
#             the 1B Q4_K_M batch-8 decode step against TC_RUNS=1, the attention's block trace with five phases
#             (~4 minutes)
#   q25       an 8-bit gated product at 4-8 rows of x on the dp4a form with the SwiGLU apart (the default since the
#             sixteenth session) against the FMA form with it (FUSEC_QGEMV_WIDE_GATE=fma): the 1B Q8_0 batch-8 step
#             (~1.5 minutes)
#   q26       the tensor-core form's lean prologue (one address a lane, constant offsets; bit planes in 16-byte copies)
#             and its bit planes spread by a multiply: its GPU tests and the packed plans' generation tests, the 1B
#             Q4_K_M batch-8 decode step with its per-kernel profile (~3 minutes)
#   q29       where a long context's attention time goes: Qwen3-0.6B batch 1 and 8 at context 512, in turns against 8 keys
#             a key group a round (FUSEC_KV_UNROLL=8: fewer rounds) and the global merge (FUSEC_KV_CLUSTER=0: more
#             splits than a cluster's 8), then qmerge (~4 minutes)
#   qmerge    the block trace of Qwen3-0.6B batch 1 at context 512, with the global merge's phases (4: the merging block
#             past its fence, 5: its merge loop done): where the merging blocks' ~5.4 us go (~1.5 minutes)
#   q7prof    the 7B Q4_K_M batch-1 decode step with its per-kernel profile (decode_step.py; ~2 minutes)
#   q30       long rows two a task where that makes fewer round trips (the FILL rule's new half: the 7B downs): its GPU
#             bit test, the 7B Q4_K_M batch-1 step in turns against FUSEC_QGEMV_DP4A_FILL=0 (with the per-kernel profile),
#             and the 7B block trace of both (where a product's time after the wait goes; ~5 minutes)
#   q32       x's digits written by a thread block cluster's blocks in turns (FUSEC_QGEMV_DP4A_CLUSTER): its GPU bit
#             test, then decode steps in turns against clusters of 1, 2 and 4 (7B and 1B Q4_K_M batch 1, 1B Q8_0 batch
#             8), and the 7B block trace with clusters of 4 (~7 minutes)
#   q33       the eighteenth session's kernels checked: the dp4a GPU tests (clusters of 2 at 4-8 rows of x, long rows two a
#             task), the decode attention's (its cluster helpers moved to common.cuh), then the Llama-1B Q8_0 batch 4 and
#             8 steps in turns against FUSEC_QGEMV_DP4A_CLUSTER=1 (~8 minutes)
#   q35       where a dp4a product's x phase goes: the block traces of the 7B and Llama-1B Q4_K_M steps at batch 1 against
#             clusters of 2 (half of x's digits a block; ~4 minutes)
#   q31       the attention's cluster cap at batch 8: Qwen3-0.6B at contexts 128, 256 and 384 in turns against the global
#             merge over every split (FUSEC_KV_CLUSTER=0; ~4 minutes)
#   qsrc      Nsight Compute's full set on the tensor-core form at 8 rows of x (1B Q4_K gate/up, Q6_K LM head, Q6_K down
#             in runs): the details page and the stall samples by SASS instruction (benchmarks/sass_stalls.py; ~3 minutes)
#   qvariants every form of the quantized GEMV on Llama-1B's shapes (quant_bench.py --variants)
#   qdecode   the packed-weight decode models alone (quant_bench.py --skip kernels,torch), the rule and the rule without dp4a
#   rows16    packed decode past 8 rows: the tensor-core GEMV's GPU tests (one and two tiles of x), then the Llama-1B
#             Q4_K_M step at batches 9, 12, 16, Q8_0 at 16 and the 7B Q4_K_M at 16, the default (two tiles of x) in
#             turns against the prefill's paths (--ab FUSEC_QGEMV_MAX_ROWS=8), with per-kernel profiles; the bf16
#             Llama-1B step at 16 beside them (~6 minutes)
#   qtab      issue 22's decode table in one run (quant_bench.py --skip kernels,torch: Q4_K_M, Q8_0, bf16; batches 1, 8)
#   q7b       the 7B Llama shape in Q4_K_M, batch 1 decode and its packed-weight roofline (quant_bench.py --7b)
#   qncu      Nsight Compute counters of the quantized GEMV's forms, stalls by source line (benchmarks/qgemv_ncu.py)
#   qncu8     Nsight Compute counters of the rule's forms at 8 rows of x (Q8_0 gate/up and down: the FMA form; qkv:
#             dp4a; Q6_K down: FMA; Q4_K gate/up: tensor cores) beside the dp4a form at one row (Q4_K gate/up, down)
#   pncu      Nsight Compute counters of one layer's skinny products as a Qwen3-0.6B batch-1 plan launches them (benchmarks/plan_ncu.py)
#   kvncu     Nsight Compute counters of the decode attention at batch 1 and 8 (benchmarks/kv_ncu.py)
#   minilm    the MiniLM fine-tune alone (weights from .minilm/, carried: an fp16 copy of the package's)
#   serve32   fusec serve at 32 clients only, 8 s (benchmarks/serve.py --clients 32)
#   serve_ab  fusec serve at 32 clients on h11 + asyncio, then on httptools + uvloop (.whl2) at 8 and 32
#   admit_prof the per-launch profile of the whole-batch prefill and the admit entry (batch 32, admit 8)
#   join_cost a join step's GPU and host time beside a decode step's, J = 1, 2, 4, and its per-launch profile (benchmarks/join_cost.py)
#   jtests    the join entry's and the row-indexed cache write's GPU tests
#   serve_join fusec serve at 8 and 32 clients with a join entry, then 32 without (same call)
#   serve_js  fusec serve at 32 clients with join entries of 1, 2 and 4 prompts a step
#   serve_prof fusec serve at 32 clients (join 2) sampled by py-spy (.whl3) for 8 s: where the server's threads spend it
#   serve_rb  fusec serve at 32 clients (join 2), tokens read back every step, then every 4, twice each
#   serve_final fusec serve at 8 and 32 clients with a join entry of 2, at 32 with 4, at 32 without
#   stests    the serve GPU tests (continuous batching, the admit entry)
#   serve_admit fusec serve at 32 clients without an admit entry, at 8 and 32 with one of batch/4 (where the time goes)
#   fam_tests the decoder families' GPU generation tests (fp32 token-exact, bf16 reported)
#   serve     fusec serve under 1/8/32 streaming clients (benchmarks/serve.py, --duration 10)
#   families  GGUF decoder families' decode speed (benchmarks/families_gpu.py --no-window-study)
#   mlp       the fused-MLP A/B (benchmarks/mlp_ab.py)
#   attn      the fp16/bf16 attention's block shapes (query warps x key splits): its GPU tests at every shape, then the
#             Qwen3-0.6B and Llama-1B prefills in turns against FUSEC_ATTN_QWARPS=4 (the one shape before) with their
#             per-kernel profiles (~3 minutes)
#   attn_k    the attention kernel alone at the Qwen3, Llama-1B and GPT-2 prefill shapes, each block shape, masked a row a
#             query, causal or neither (benchmarks/attn_bench.py), then Nsight Compute on the Qwen3 shape's variants
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
R=${OUT:-/tmp/gpu_session}; mkdir -p "$R"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.txt" 2>&1 || tail -5 "$R/install.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$R/device.txt"
python3 -c "import cupy, cuda.bindings; print('cupy', cupy.__version__, 'cuda-bindings', cuda.bindings.__version__)" | tee -a "$R/device.txt"
PT="python3 -m pytest -q -p no:cacheprovider -m gpu -rfE"
# qmerge: the block trace of Qwen3-0.6B batch 1 at context 512 (the attention's blocks that end last, with phases)
qmerge() {
  timeout 150 python3 benchmarks/block_trace.py "$R/qmerge" --model qwen3-0.6b --context 512 --blocks rope_atte \
    > "$R/qmerge.txt" 2>&1
  grep -E "^step|rope_atte|^\| [0-9]+ \| [0-9]+ \|" "$R/qmerge/block_trace.md" | head -n 14; tail -n 2 "$R/qmerge.txt"
}
# ab_step NAME TESTS BATCHES "AB ARGS" MODEL...: the packed-weight GPU tests selected by -k TESTS, then each model's
# decode step (context 32) in turns with decode_step.py's --ab variants
ab_step() {
  local name=$1 tests=$2 batches=$3 ab=$4 m
  shift 4
  timeout 80 $PT -n 8 tests/test_quant_gpu.py -k "$tests" > "$R/t_$name.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_$name.txt" | tail -n 12
  for m in "$@"; do
    # shellcheck disable=SC2086  # $ab is several arguments
    timeout 150 python3 benchmarks/decode_step.py "$R/${name}_$m" --model "$m" --batches "$batches" --context 32 \
      --windows 3 $ab > "$R/${name}_$m.txt" 2>&1
    grep -E "^\| [0-9]+ \|" "$R/${name}_$m.txt" | cut -c 1-1500
  done
}
# the Qwen3-0.6B (128 tokens) and Llama-1B (32) prefills, with $PREFILL_AB's variants in turns, and their profiles
prefill_ab() {
  # shellcheck disable=SC2086  # $PREFILL_AB is several arguments
  timeout 200 python3 benchmarks/prefill_step.py "$R/prefill_q" --model qwen3-0.6b $PREFILL_AB > "$R/prefill_q.txt" 2>&1
  tail -n 30 "$R/prefill_q.txt" | cut -c 1-3000
  # shellcheck disable=SC2086
  timeout 120 python3 benchmarks/prefill_step.py "$R/prefill_l" --model llama-1b --prompt 32 $PREFILL_AB > "$R/prefill_l.txt" 2>&1
  tail -n 24 "$R/prefill_l.txt" | cut -c 1-3000
}
# kv_short NAME --ab ...: the Llama-1B Q4_K_M (context 32) and Qwen3-0.6B (128) decode steps at batch 1, the variants in
# turns (the decode attention's knobs at short contexts)
# hw_tree ncu|step: this tree's 5/6-bit products (ncu) or decode steps (step) against $OLD_TREE's (default
# .old/tree: a git archive of an earlier commit, carried), in turns; results named after the old tree's folder; step:
# the models $HW_MODELS (default llama-1b-q4_k_m) at batches $HW_BATCHES (default 1,8)
hw_tree() {
  local old=${OLD_TREE:-.old/tree} tag
  tag=$(basename "$old")
  [ -d "$old" ] || { echo "hw: no $old (a git archive of an earlier commit, carried)"; return; }
  # the editable install maps fusec.templates, .models and .passes to this checkout (its import finder): without these
  # links the old tree's fusec rendered this tree's templates (the forty-second session's calls 1-3 compared nothing)
  for d in templates models passes; do [ -e "$old/fusec/$d" ] || ln -s "../$d" "$old/fusec/$d"; done
  (cd "$old" && PYTHONPATH="$PWD:$PYTHONPATH" python3 -c "import sys, fusec.codegen.render as r
sys.exit(0 if str(r._templates_dir()).startswith(sys.argv[1]) else 'the old tree renders ' + str(r._templates_dir()))" \
    "$PWD") || return
  local order="new old" t
  [ "$1" = step ] && order="new old new old"
  for t in $order; do
    local dir=.; [ "$t" = old ] && dir=$old
    if [ "$1" = ncu ]; then
      (cd "$dir" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 150 ncu --clock-control none -k regex:fc_qgemv \
        --section SpeedOfLight python3 benchmarks/qgemv_ncu.py --rule q6_k:8:128256x2048 --rule q6_k:8:2048x8192 --rule q5_k:8:2048x8192 \
        --rule q6_k:1:128256x2048 --rule q6_k:1:2048x8192 --rule q5_k:1:2048x8192 --rule q4_k:8:2048x8192 \
        > "$R/hw_ncu_${tag}_$t.txt" 2>&1)
      echo "tree $t ($tag)"; grep -E "^launch:|Duration|DRAM Throughput" "$R/hw_ncu_${tag}_$t.txt" | head -n 30
    else
      local m
      for m in ${HW_MODELS:-llama-1b-q4_k_m}; do
        (cd "$dir" && PYTHONPATH="$PWD:$PYTHONPATH" timeout 120 python3 benchmarks/decode_step.py "$R/hw_${tag}_${m}_$t" \
          --model "$m" --batches "${HW_BATCHES:-1,8}" --context 32 --windows 3 > "$R/hw_step_${tag}_${m}_$t.txt" 2>&1)
        echo "tree $t ($tag), $m"; grep -E "^\| (batch|[0-9]+) \|" "$R/hw_step_${tag}_${m}_$t.txt" | cut -c 1-400
      done
    fi
  done
}

kv_short() {
  local name=$1 m mname ctx
  shift
  for m in llama-1b-q4_k_m:32 qwen3-0.6b:128; do IFS=: read -r mname ctx <<< "$m"
    timeout 110 python3 benchmarks/decode_step.py "$R/${name}_$mname" --model "$mname" --batches 1 --context "$ctx" \
      --windows 3 "$@" > "$R/${name}_$mname.txt" 2>&1
    echo "$mname"; grep -E "^\| (batch|[0-9]+) \|" "$R/${name}_$mname.txt" | cut -c 1-900
  done
}
attn_ab() {
  # the attention alone (attn_bench.py) at each "SHAPE [options]" argument, two rounds; where benchmarks/ab_prev holds
  # templates (untracked, copied there for one call), the tree's and those in turns, the tree's put back after
  local v r sh f prev=()
  for f in benchmarks/ab_prev/*.jinja; do [[ -f $f ]] && prev+=("${f##*/}"); done
  mkdir -p /tmp/ab_new
  for f in "${prev[@]}"; do cp "templates/$f" /tmp/ab_new/; done
  for r in 1 2; do for v in new ${prev[@]:+prev}; do
    for f in "${prev[@]}"; do
      if [[ $v == prev ]]; then cp "benchmarks/ab_prev/$f" templates/; else cp "/tmp/ab_new/$f" templates/; fi
    done
    for sh in "$@"; do
      # shellcheck disable=SC2086  # $sh is a shape and its options
      echo "[$v round $r] $sh"; timeout 90 python3 benchmarks/attn_bench.py --shape $sh 2>&1 | grep -E "^\| [a-z]+ \|"
    done
  done; done
  for f in "${prev[@]}"; do cp "/tmp/ab_new/$f" templates/; done
}
qprefill() {
  # Qwen3-0.6B's prefill entry (prefill_step.py): NAME PROMPT[:CACHE ROWS] [prefill_step.py options]; prints its table
  # (times, launches, variants) and the per-kernel profile's top lines
  local name=$1 pc=$2 cache=()
  shift 2
  [[ $pc == *:* ]] && cache=(--cache "${pc##*:}")
  timeout 250 python3 benchmarks/prefill_step.py "$R/$name" --model qwen3-0.6b --prompt "${pc%%:*}" "${cache[@]}" "$@" \
    > "$R/$name.txt" 2>&1
  grep -E "^\|" "$R/$name.txt" | cut -c 1-400; grep -E "^ +[0-9.]+ us" "$R/$name.txt" | head -n 8 | cut -c 1-300
}
for step in "$@"; do
  t0=$(date +%s)
  case "$step" in
    kernels) timeout 300 $PT -n 8 tests/test_gemv_gpu.py tests/test_decode_kernels_gpu.py tests/test_pdl_gpu.py \
               tests/test_head_rope_pair.py tests/test_softcap.py tests/test_generation_gpu.py > "$R/t_kernels.txt" 2>&1
             tail -n 25 "$R/t_kernels.txt" ;;
    lt_t) timeout 120 $PT tests/test_lt_algo.py > "$R/t_lt.txt" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_lt.txt" | tail -n 6 ;;
    gpu_all) OUT="$R" timeout 570 bash benchmarks/gpu_check.sh ;;
    gpu_k) OUT="$R" GPU_PARTS=kernels timeout 570 bash benchmarks/gpu_check.sh ;;
    gpu_r) OUT="$R" GPU_PARTS="runtime families ab" timeout 570 bash benchmarks/gpu_check.sh ;;
    validate) timeout 300 $PT -n 8 tests/test_generation_gpu.py tests/test_generation_families_gpu.py tests/test_head_rope_pair.py \
                tests/test_gemv_gpu.py tests/test_serve_gpu.py tests/test_generation_join_gpu.py > "$R/t_validate.txt" 2>&1
              grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_validate.txt" | tail -n 12 ;;
    ktests) K=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_families -e test_conv -e test_ab_gpu \
                -e test_e2e_gpu -e test_generation_gpu -e test_runtime_gpu -e test_counters_gpu -e test_hostile_gpu \
                -e test_plan_contracts -e test_report_gpu -e test_cli_ -e test_softcap_generation)
            timeout 120 $PT -n 12 $K > "$R/t_k.txt" 2>&1; grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_k.txt" | tail -n 12 ;;
    gemv) timeout 150 python3 benchmarks/bench_decode_kernels.py "$R/bk" --only gemv > "$R/gemv.txt" 2>&1
          grep "^|" "$R/gemv.txt" | tail -n 45 ;;
    rings) timeout 300 python3 benchmarks/bench_decode_kernels.py "$R/rings" --only gemv --ms 1,8 \
             --rings 2x1,3x1,3x2,3x4,4x2,4x4,4x8 > "$R/rings.txt" 2>&1
           grep "^|" "$R/rings.txt" | head -n 24 ;;
    gncu) timeout 200 ncu --clock-control none -k regex:"fc_gemv|gemv|gemm|Kernel" --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
            python3 benchmarks/gemv_ncu.py > "$R/gncu.txt" 2>&1
          grep -E "^launch:|==PROF==|  [a-zA-Z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit|Dynamic Shared|Mem Busy|Max Bandwidth|L2 Hit|Stall|Waves" "$R/gncu.txt" | head -n 120 ;;
    gtests) timeout 200 $PT -n 8 tests/test_gemv_gpu.py > "$R/t_gemv.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_gemv.txt" | tail -n 12 ;;
    kv) timeout 240 python3 benchmarks/bench_decode_kernels.py "$R/bkv" --only kv > "$R/kv.txt" 2>&1
        grep "^|" "$R/kv.txt" | tail -n 25 ;;
    step_q) timeout 200 python3 benchmarks/decode_step.py "$R/step_q" --model qwen3-0.6b --batches 1,8 --gemv-forms ring,register > "$R/step_q.txt" 2>&1
            tail -n 6 "$R/step_q.txt" ;;
    step_kv) timeout 300 python3 benchmarks/decode_step.py "$R/step_kv" --model qwen3-0.6b --batches 1,8 --ab FUSEC_KV_CLUSTER=0 --ab FUSEC_KV_CLUSTER=0+FUSEC_KV_PREFETCH=0 > "$R/step_kv.txt" 2>&1
             tail -n 4 "$R/step_kv.txt" | cut -c 1-3000
             timeout 150 python3 benchmarks/decode_step.py "$R/step_kvl" --model llama-1b --batches 1 --context 32 --ab FUSEC_KV_CLUSTER=0 --ab FUSEC_KV_CLUSTER=0+FUSEC_KV_PREFETCH=0 > "$R/step_kvl.txt" 2>&1
             tail -n 3 "$R/step_kvl.txt" | cut -c 1-3000 ;;
    step_sp) timeout 300 python3 benchmarks/decode_step.py "$R/step_sp" --model qwen3-0.6b --batches 1,8 --ab FUSEC_GEMV_SPREAD=1 \
               --ab FUSEC_GEMV_SPREAD=2 > "$R/step_sp.txt" 2>&1
             tail -n 4 "$R/step_sp.txt" | cut -c 1-3000 ;;
    step_kvs) timeout 240 python3 benchmarks/decode_step.py "$R/step_kvs" --model qwen3-0.6b --batches 1,8 --windows 3 \
                --ab FUSEC_KV_SPLIT_KEYS=32 > "$R/step_kvs.txt" 2>&1
              tail -n 4 "$R/step_kvs.txt" | cut -c 1-3000 ;;
    kvtests) timeout 200 $PT -n 8 tests/test_decode_kernels_gpu.py tests/test_pdl_gpu.py tests/test_generation_gpu.py \
               tests/test_generation_join_gpu.py tests/test_generation_families_gpu.py > "$R/t_kv.txt" 2>&1
             grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kv.txt" | tail -n 12 ;;
    kvh) timeout 250 $PT -n 8 tests/test_kv_heads_gpu.py tests/test_head_rope_pair.py tests/test_pdl_gpu.py \
           tests/test_generation_gpu.py tests/test_decode_kernels_gpu.py tests/test_generation_join_gpu.py > "$R/t_kvh.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kvh.txt" | tail -n 15 ;;
    step_ra) timeout 280 python3 benchmarks/decode_step.py "$R/step_ra" --model qwen3-0.6b --batches 1,8 --windows 3 \
               --ab disable=rope_attention > "$R/step_ra.txt" 2>&1
             tail -n 4 "$R/step_ra.txt" | cut -c 1-3000 ;;
    step_ra2) timeout 400 python3 benchmarks/decode_step.py "$R/step_ra2" --model qwen3-0.6b --batches 1,8 --windows 3 \
               --ab disable=rope_attention --ab FUSEC_KV_CLUSTER=0 --ab disable=rope_attention+FUSEC_KV_CLUSTER=0 \
               --ab FUSEC_KV_SPLIT_KEYS=32 > "$R/step_ra2.txt" 2>&1
             tail -n 4 "$R/step_ra2.txt" | cut -c 1-3000 ;;
    step_u) timeout 120 $PT -n 8 tests/test_decode_kernels_gpu.py -k "kv_attention" > "$R/t_u.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_u.txt" | tail -n 8
            timeout 300 python3 benchmarks/decode_step.py "$R/step_u" --model qwen3-0.6b --batches 1,8 --windows 3 \
               --ab FUSEC_KV_UNROLL=8 > "$R/step_u.txt" 2>&1
            tail -n 4 "$R/step_u.txt" | cut -c 1-3000 ;;
    step_u4) timeout 300 python3 benchmarks/decode_step.py "$R/step_u4" --model qwen3-0.6b --batches 1,8 --windows 3 \
               --ab FUSEC_KV_UNROLL=4 > "$R/step_u4.txt" 2>&1
             tail -n 4 "$R/step_u4.txt" | cut -c 1-3000 ;;
    step_lra) timeout 300 python3 benchmarks/decode_step.py "$R/step_lra" --model llama-1b --batches 1 --context 32 \
                --windows 3 --ab disable=rope_attention > "$R/step_lra.txt" 2>&1
              tail -n 3 "$R/step_lra.txt" | cut -c 1-3000 ;;
    attn) timeout 150 $PT -n 8 tests/test_kernels_gpu.py -k "attention" > "$R/t_attn.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_attn.txt" | tail -n 12
          PREFILL_AB="--ab FUSEC_ATTN_QWARPS=4" prefill_ab ;;
    prefill) prefill_ab ;;
    attn_k) for sh in qwen3 llama gpt2; do timeout 60 python3 benchmarks/attn_bench.py --shape $sh 2>&1 | tail -n 12; done
            timeout 120 ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
              -k regex:fc_attn -c 9 python3 benchmarks/attn_bench.py --ncu > "$R/attn_ncu.txt" 2>&1
            grep -E "fc_attn|Duration|Warp Cycles Per Issued|Stall|Registers|Achieved Occupancy|Block Limit|Compute \(SM\)|Memory Throughput" "$R/attn_ncu.txt" | head -n 60 ;;
    bert_k) timeout 90 python3 benchmarks/attn_bench.py --shape bert --forms keys,none --stages 0,1 2>&1 | tail -n 14
            timeout 120 ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
              --section MemoryWorkloadAnalysis -k regex:fc_attn -c 4 python3 benchmarks/attn_bench.py --ncu --shape bert \
              --forms keys --qwarps 2,4 --stages 0,1 > "$R/bert_ncu.txt" 2>&1
            grep -E "fc_attn|Duration|Warp Cycles Per Issued|Stall|Registers|Achieved Occupancy|Block Limit|Compute \(SM\)|Memory Throughput|L2 Hit|DRAM Throughput" "$R/bert_ncu.txt" | head -n 80
            for m in bert-base gpt2-small; do
              sh=input_ids:32x128,attention_mask:32x128; [ $m = gpt2-small ] && sh=input_ids:8x128,attention_mask:8x128
              timeout 120 python3 -m fusec bench $m --dtype fp16 --shapes $sh --cuda-graph --per-kernel --top 12 > "$R/pk_$m.txt" 2>&1
              grep -A14 "by kind" "$R/pk_$m.txt"; grep -E "median|per-kernel|times:" "$R/pk_$m.txt"
            done ;;
    bert_v) timeout 90 python3 benchmarks/gelu_bench.py 2>&1 | tail -n 7
            timeout 200 $PT -n 8 tests/test_kernels_gpu.py -k "attention or gelu or elementwise" > "$R/t_bert_v.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_bert_v.txt" | tail -n 12
            for m in bert-base; do
              timeout 120 python3 -m fusec bench $m --dtype fp16 --shapes input_ids:32x128,attention_mask:32x128 \
                --cuda-graph --per-kernel --top 12 > "$R/pk_$m.txt" 2>&1
              grep -A14 "by kind" "$R/pk_$m.txt"; grep -E "median|per-kernel|times:" "$R/pk_$m.txt"
            done ;;
    stream_t) for sh in qwen3 llama; do timeout 100 python3 benchmarks/gemm_stream_bench.py --shapes $sh --trace \
                --splits 1,2,4,8 2>&1 | tail -n 18; done
              for sh in qwen3 llama; do timeout 100 python3 benchmarks/gemm_stream_bench.py --shapes $sh --splits 1,2,4,8 \
                2>&1 | tail -n 18; done ;;
    wgmma) timeout 200 $PT -n 8 tests/test_kernels_gpu.py -k "gemm_wgmma or gemm_stream" > "$R/t_wgmma.txt" 2>&1
           grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_wgmma.txt" | tail -n 14
           grep -E "^E " "$R/t_wgmma.txt" | head -n 12
           for sh in qwen3 llama; do timeout 150 python3 benchmarks/gemm_stream_bench.py --shapes $sh --splits 1,2,4,8 \
             --forms ${WG_FORMS:-wgmma} 2>&1 | tail -n 34; done
           timeout 100 python3 benchmarks/gemm_stream_bench.py --shapes qwen3 --trace --splits 1,2,4 --forms wgmma 2>&1 \
             | tail -n 12 ;;
    wg_ring) for sh in qwen3 llama; do timeout 200 python3 benchmarks/gemm_stream_bench.py --shapes $sh --splits 1,2,4,8 \
               --forms wgmma --max-stages 8,4,3 2>&1 | grep "^| "; done ;;
    rows_t) timeout 200 $PT -n 8 tests/test_kernels_gpu.py -k "attention or layernorm or rmsnorm or softmax or reduce" \
              > "$R/t_rows.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_rows.txt" | tail -n 12 ;;
    plans_t) timeout 400 $PT -n 8 tests/test_generation_gpu.py tests/test_generation_families_gpu.py tests/test_head_rope_pair.py \
               tests/test_gemv_gpu.py tests/test_serve_gpu.py tests/test_generation_join_gpu.py tests/test_pdl_gpu.py \
               tests/test_e2e_gpu.py tests/test_runtime_gpu.py tests/test_ab_gpu.py tests/test_softcap_generation.py \
               > "$R/t_plans.txt" 2>&1
             grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_plans.txt" | tail -n 14 ;;
    ctx4k) timeout 300 python3 benchmarks/decode_step.py "$R/ctx4k" --model qwen3-0.6b --batches 1,32 --context 4096 \
             --windows 2 > "$R/ctx4k.txt" 2>&1
           grep -E "^\| [0-9]+ \|" "$R/ctx4k.txt" | cut -c 1-400 ;;
    prof27) for m in qwen3-0.6b:1,8:128 llama-1b-q4_k_m:1:32; do IFS=: read -r name bs ctx <<< "$m"
              timeout 200 python3 benchmarks/decode_step.py "$R/p27_$name" --model $name --batches $bs --context $ctx \
                --windows 3 > "$R/p27_$name.txt" 2>&1
              grep -E "^\| [0-9]+ \|" "$R/p27_$name.txt" | cut -c 1-300; done ;;
    xprobe) timeout 120 python3 benchmarks/x_latency_probe.py --bytes 16384,32768,65536 > "$R/xprobe.txt" 2>&1; cat "$R/xprobe.txt" ;;
    kvmerge) [ -f .old/kv_attention.cu.jinja ] || { echo "kvmerge: no .old/kv_attention.cu.jinja (git show 4835680:templates/kv_attention.cu.jinja, carried)"; continue; }
             timeout 200 $PT -n 8 tests/test_decode_kernels_gpu.py tests/test_kv_heads_gpu.py -k "kv_attention or prologue" \
               > "$R/t_kvmerge.txt" 2>&1
             grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kvmerge.txt" | tail -n 12
             # the merge as committed against the one before it (.old/, carried), each its own process, in turns
             cp templates/kv_attention.cu.jinja /tmp/kv_new.jinja
             for form in new old new old; do cp /tmp/kv_$form.jinja templates/kv_attention.cu.jinja 2>/dev/null \
                 || cp .old/kv_attention.cu.jinja templates/kv_attention.cu.jinja
               timeout 100 python3 benchmarks/bench_decode_kernels.py "$R/kv_$form" --only kv --kv-batches 1,8 > "$R/kv_$form.txt" 2>&1
               echo "merge $form"; grep -E "^\| 1 \| (128|4096) \| (default|prefetch|x4|x16|nosplit) \|" "$R/kv_$form.txt" | cut -c 1-90
             done
             for form in new old; do cp /tmp/kv_$form.jinja templates/kv_attention.cu.jinja 2>/dev/null \
                 || cp .old/kv_attention.cu.jinja templates/kv_attention.cu.jinja
               timeout 150 python3 benchmarks/decode_step.py "$R/kvm_$form" --model qwen3-0.6b --batches 1 --context 4096 \
                 --windows 2 > "$R/kvm_$form.txt" 2>&1
               echo "step, merge $form"; grep -E "^\| [0-9]+ \|" "$R/kvm_$form.txt" | cut -c 1-200
             done
             cp /tmp/kv_new.jinja templates/kv_attention.cu.jinja ;;
    kvm2) [ -f .old/kv_u16.jinja ] || { echo "kvm2: no .old/kv_u16.jinja, kv_u4.jinja (the merge's unroll variants, carried)"; continue; }
          timeout 200 python3 benchmarks/block_trace.py "$R/kvt4k" --model qwen3-0.6b --batches 1 --context 4096 \
            --blocks rope_atte > "$R/kvt4k.txt" 2>&1
          grep -E "^step|rope_atte" "$R/kvt4k/block_trace.md" | cut -c 1-400 | head -n 12
          # the merge's loads a share: 8 at a time (committed) against 16 and 4 (.old/kv_u16.jinja, kv_u4.jinja), alone
          cp templates/kv_attention.cu.jinja /tmp/kv_u8.jinja
          for form in u8 u16 u4 u8 u16 u4; do cp /tmp/kv_$form.jinja templates/kv_attention.cu.jinja 2>/dev/null \
              || cp .old/kv_$form.jinja templates/kv_attention.cu.jinja
            timeout 100 python3 benchmarks/bench_decode_kernels.py "$R/kv_$form" --only kv --kv-batches 1 > "$R/kv_$form.txt" 2>&1
            echo "merge $form"; grep -E "^\| 1 \| 4096 \| (default|prefetch|x2|x16) \|" "$R/kv_$form.txt" | cut -c 1-90
          done
          cp /tmp/kv_u8.jinja templates/kv_attention.cu.jinja ;;
    kvT) for T in 272 1024 4096; do
           timeout 100 python3 benchmarks/bench_decode_kernels.py "$R/kvT$T" --only kv --kv-batches 1 --kv-cache $T > "$R/kvT$T.txt" 2>&1
           echo "cache $T"; grep -E "^\| 1 \| 128 \| (default|prefetch|cluster\+prefetch|nosplit) \|" "$R/kvT$T.txt" | cut -c 1-90
         done ;;
    kvcl) timeout 200 $PT -n 8 tests/test_decode_kernels_gpu.py tests/test_kv_heads_gpu.py -k "kv_attention or prologue" \
            > "$R/t_kvcl.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kvcl.txt" | tail -n 12
          for T in 1024 4096; do
            timeout 100 python3 benchmarks/bench_decode_kernels.py "$R/kvcl$T" --only kv --kv-batches 1 --kv-cache $T > "$R/kvcl$T.txt" 2>&1
            echo "cache $T"; grep -E "^\| 1 \| (128|4096) \| (prefetch|cluster\+prefetch) \|" "$R/kvcl$T.txt" | cut -c 1-90
          done
          timeout 200 python3 benchmarks/decode_step.py "$R/kvcl_s" --model qwen3-0.6b --batches 1 --context 128 --cache 4096 \
            --windows 3 --ab FUSEC_KV_CLUSTER_LEVELS=1 > "$R/kvcl_s.txt" 2>&1
          grep -E "^\| [0-9]+ \|" "$R/kvcl_s.txt" | cut -c 1-400
          timeout 250 python3 benchmarks/decode_step.py "$R/kvcl_l" --model qwen3-0.6b --batches 1 --context 4096 \
            --windows 2 --ab FUSEC_KV_CLUSTER_LEVELS=1 --ab FUSEC_KV_UNROLL=4 > "$R/kvcl_l.txt" 2>&1
          grep -E "^\| [0-9]+ \|" "$R/kvcl_l.txt" | cut -c 1-400 ;;
    solo) timeout 150 $PT -n 8 tests/test_decode_kernels_gpu.py tests/test_kv_heads_gpu.py -k "kv_attention or prologue" \
            > "$R/t_solo.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_solo.txt" | tail -n 12
          timeout 200 python3 benchmarks/decode_step.py "$R/solo" --model qwen3-0.6b --batches 1,2 --context 128 --cache 4240 \
            --windows 3 --ab FUSEC_KV_SOLO_KEYS=0 > "$R/solo.txt" 2>&1
          grep -E "^\| [0-9]+ \|" "$R/solo.txt" | cut -c 1-400 ;;
    next27) # what the twenty-seventh session left: one block a head at contexts of at most 128 keys (FUSEC_KV_SOLO_KEYS),
            # and the attention's form at mid contexts in a 4,240-row cache (the rule's 8 keys a group and global merge
            # against 4 keys a group in clusters of 8)
            timeout 150 python3 benchmarks/decode_step.py "$R/n27_solo" --model qwen3-0.6b --batches 1 --context 16 \
              --steps 100 --cache 4240 --windows 3 --ab FUSEC_KV_SOLO_KEYS=128 > "$R/n27_solo.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/n27_solo.txt" | cut -c 1-400
            for c in 512 2048; do
              timeout 200 python3 benchmarks/decode_step.py "$R/n27_$c" --model qwen3-0.6b --batches 1 --context $c \
                --cache 4240 --windows 2 --ab FUSEC_KV_UNROLL=4 > "$R/n27_$c.txt" 2>&1
              grep -E "^\| [0-9]+ \|" "$R/n27_$c.txt" | cut -c 1-400
            done ;;
    pre16)  # short prompts' prefill (time to first token): per-kernel profiles at 16 tokens in a small and a long cache,
            # and at 128 tokens
            for pc in 16:32 16:4240 128:144; do qprefill "pre_${pc/:/_}" "$pc" --rounds 9; done ;;
    coop)   # the skinny products' norm prologue in the block at 9-16 rows (FUSEC_GEMV_COOP_NORM): the GEMV GPU tests,
            # a 16-token prefill and batch-16 decode against the rule before (1-2), batches 4 and 8 with it at 3-8 rows
            timeout 200 $PT -n 8 tests/test_gemv_gpu.py > "$R/t_gemv.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_gemv.txt" | tail -n 12
            qprefill coop_pre16 16:32 --rounds 11 --ab FUSEC_GEMV_COOP_NORM=1-2
            timeout 200 python3 benchmarks/decode_step.py "$R/coop_b16" --model qwen3-0.6b --batches 16 --context 128 \
              --windows 2 --ab FUSEC_GEMV_COOP_NORM=1-2 > "$R/coop_b16.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/coop_b16.txt" | cut -c 1-400
            timeout 200 python3 benchmarks/decode_step.py "$R/coop_b48" --model qwen3-0.6b --batches 4,8 --context 128 \
              --windows 2 --ab FUSEC_GEMV_COOP_NORM=all > "$R/coop_b48.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/coop_b48.txt" | cut -c 1-400 ;;
    coop2)  # the norm in the block at 1-4 and 9-16 rows (the rule now): GEMV GPU tests; batches 3-4 against the rule before;
            # a 16-token prefill with every ring stage issued before the wait; the Llama-1B shape at batch 4
            timeout 200 $PT -n 8 tests/test_gemv_gpu.py > "$R/t_gemv2.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_gemv2.txt" | tail -n 12
            timeout 200 python3 benchmarks/decode_step.py "$R/coop_b34" --model qwen3-0.6b --batches 3,4 --context 128 \
              --windows 2 --ab FUSEC_GEMV_COOP_NORM=1-2 > "$R/coop_b34.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/coop_b34.txt" | cut -c 1-400
            qprefill coop_pw 16:32 --rounds 11 --ab FUSEC_GEMV_COOP_PREWAIT=all
            timeout 200 python3 benchmarks/decode_step.py "$R/coop_l4" --model llama-1b --batches 4 --context 32 \
              --windows 2 --ab FUSEC_GEMV_COOP_NORM=1-2 > "$R/coop_l4.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/coop_l4.txt" | cut -c 1-400 ;;
    norm8)  # the norm's roundings two values a packed cvt (gv_norm8): GEMV GPU tests, a 16-token prefill, Qwen3-0.6B decode
            # at batches 1, 4, 8 and 16 (compare with the coop and coop2 steps' runs)
            timeout 200 $PT -n 8 tests/test_gemv_gpu.py > "$R/t_gemv3.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_gemv3.txt" | tail -n 12
            qprefill n8_pre16 16:32 --rounds 11
            timeout 300 python3 benchmarks/decode_step.py "$R/n8_dec" --model qwen3-0.6b --batches 1,4,8,16 --context 128 \
              --windows 2 > "$R/n8_dec.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/n8_dec.txt" | cut -c 1-400 ;;
    gvm)    # the decode products alone by rows of x (1, 8, 16): register form, the rule's form, cuBLAS (bandwidth a shape)
            timeout 300 python3 benchmarks/bench_decode_kernels.py "$R/gvm" --only gemv --ms 1,8,16 > "$R/gvm.txt" 2>&1
            sed -n '/decode products, bf16/,$p' "$R/gvm/decode.md" | cut -c 1-300 ;;
    prelong) # long prompts' prefill (time to first token): per-kernel profiles at 512 and 2,048 tokens
            for pc in 512 2048; do qprefill "pre_$pc" $pc --rounds 5; done ;;
    causal) # prefill attention causal without a mask (right-padded prompts): prefill at 128, 512 and 2,048 tokens (compare
            # with the prelong and pre16 steps' runs)
            for pc in 128 512 2048; do qprefill "cz_$pc" $pc --rounds 5; done ;;
    ewvec)  # indexed elementwise chains over views in 16-byte vectors: the elementwise GPU tests, the 2,048-token prefill
            timeout 120 $PT -n 8 tests/test_kernels_gpu.py -k "elementwise" > "$R/t_ew.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_ew.txt" | tail -n 8
            qprefill ew_2048 2048 --rounds 5 ;;
    next28) # what the twenty-eighth session left unrun: the GPU tests it changed after its last run, and the prefill
            # at 16, 128 and 2,048 tokens as the tree stands (the SwiGLU in vectors, the causal attention, the block's norm)
            timeout 200 $PT -n 8 tests/test_gemv_gpu.py tests/test_ab_gpu.py > "$R/t_n28.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n28.txt" | tail -n 8
            timeout 120 $PT -n 8 tests/test_kernels_gpu.py -k elementwise > "$R/t_n28_ew.txt" 2>&1  # row_scale: new
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n28_ew.txt" | tail -n 8
            for pc in 16 128 2048; do qprefill "n28_$pc" $pc --rounds 5; done
            # the long prompt's attention (136 us a layer at 2,048 tokens): alone by block shape, and where it stalls
            timeout 120 python3 benchmarks/attn_bench.py --shape qwen3-2k --forms causal --qwarps 2,4 2>&1 | tail -n 6
            timeout 150 ncu --section SpeedOfLight --section WarpStateStats --section Occupancy -k regex:fc_attn -c 2 \
              python3 benchmarks/attn_bench.py --shape qwen3-2k --forms causal --qwarps 4 --ncu > "$R/n28_attn_ncu.txt" 2>&1
            grep -E "Duration|Warp Cycles Per Issued|Stall|Registers|Achieved Occupancy|Compute \(SM\)|Memory Throughput" \
              "$R/n28_attn_ncu.txt" | head -n 30 ;;
    n29) # the twenty-ninth session: multi-output elementwise kernels and the attention's ldmatrix .x4 fragments: their
         # GPU tests, the attention alone in turns against the previous template (benchmarks/ab_prev, untracked: the
         # session copies it there for this call), the prefill at 128 and 2,048 tokens, decode at batches 1 and 8
         timeout 150 $PT -n 8 tests/test_kernels_gpu.py -k "elementwise or attention or attn" > "$R/t_n29.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n29.txt" | tail -n 8
         attn_ab "qwen3-2k --forms causal --qwarps 2,4" "bert --forms keys --qwarps 4" \
           "qwen3 --forms causal --qwarps 2,4" "gpt2 --forms rows --qwarps 2"
         for pc in 128 2048; do qprefill "n29_$pc" $pc --rounds 5; done
         timeout 200 python3 benchmarks/decode_step.py "$R/n29_step" --model qwen3-0.6b --batches 1,8 --windows 3 \
           > "$R/n29_step.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/n29_step.txt" | cut -c 1-300 ;;
    n29b) # the attention's score compares only on the causal diagonal's slices: its GPU tests, the kernel alone in turns
          # against the previous templates (benchmarks/ab_prev: attention.cu.jinja and attention_mma.jinja), the
          # 2,048-token prefill, then the whole-plan GPU tests (plans_t)
         timeout 100 $PT -n 8 tests/test_kernels_gpu.py -k "attention or attn" > "$R/t_n29b.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n29b.txt" | tail -n 8
         attn_ab "qwen3-2k --forms causal --qwarps 2,4" "bert --forms keys --qwarps 4" "qwen3 --forms causal --qwarps 2"
         qprefill n29b_2048 2048 --rounds 5
         timeout 330 $PT -n 8 tests/test_generation_gpu.py tests/test_generation_families_gpu.py tests/test_head_rope_pair.py \
           tests/test_gemv_gpu.py tests/test_serve_gpu.py tests/test_generation_join_gpu.py tests/test_pdl_gpu.py \
           tests/test_e2e_gpu.py tests/test_runtime_gpu.py tests/test_ab_gpu.py tests/test_softcap_generation.py \
           > "$R/t_plans.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_plans.txt" | tail -n 14 ;;
    n29c) # the attention's keys a tile (AttentionSpec.bn 32 against the rule's 64: 166 against 176 registers at Qwen3's
          # D = 128, so 3 blocks an SM instead of 2), alone, two rounds
         attn_ab "qwen3-2k --forms causal --qwarps 2,4 --bn 64,32" "bert --forms keys --qwarps 2,4 --bn 64,32" \
           "qwen3 --forms causal --qwarps 2,4 --bn 64,32" "gpt2 --forms rows --qwarps 2,4 --bn 64,32" ;;
    n29d) # the attention's 32-key tiles in the plans: its GPU tests (32-key cases at 2 and 4 query warps), the kernel
          # alone with the launch bound at 4 blocks an SM (AttentionSpec.min_blocks: 128 registers, 84 bytes of
          # spills), then the 2,048-token prefill in turns against FUSEC_ATTN_BN=64
         timeout 150 $PT -n 8 tests/test_kernels_gpu.py -k "attention or attn" > "$R/t_n29d.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n29d.txt" | tail -n 8
         attn_ab "qwen3-2k --forms causal --qwarps 2,4 --bn 64,32"  # (call 5 also tried launch bounds of 3 and 4 blocks)
         qprefill n29d_2048 2048 --rounds 6 --ab FUSEC_ATTN_BN=64 ;;
    n29e) # head_rope's rows a warp: its GPU tests (and the decode attention's, whose prologue shares the row math), the
          # 2,048-token prefill in turns against FUSEC_HEAD_ROPE_RPW=1, the 512-token one, decode at batch 1
         timeout 200 $PT -n 8 tests/test_head_rope_pair.py tests/test_kv_heads_gpu.py tests/test_decode_kernels_gpu.py \
           > "$R/t_n29e.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n29e.txt" | tail -n 8
         qprefill n29e_2048 2048 --rounds 6 --ab FUSEC_HEAD_ROPE_RPW=1
         qprefill n29e_512 512 --rounds 6 --ab FUSEC_HEAD_ROPE_RPW=1
         timeout 150 python3 benchmarks/decode_step.py "$R/n29e_step" --model qwen3-0.6b --batches 1 --windows 3 \
           > "$R/n29e_step.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/n29e_step.txt" | cut -c 1-300 ;;
    n29f) # the attention's ring with one barrier a key tile: its GPU tests, the kernel alone in turns against the
          # previous template (benchmarks/ab_prev/attention_mma.jinja, copied there for this call), the prefill at 2,048
          # and 128 tokens, and BERT-base / GPT-2 small against torch (compare.py, issue 19's encoder targets)
         timeout 150 $PT -n 8 tests/test_kernels_gpu.py -k "attention or attn" > "$R/t_n29f.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n29f.txt" | tail -n 8
         attn_ab "qwen3-2k --forms causal --qwarps 4" "bert --forms keys --qwarps 4" \
           "qwen3 --forms causal --qwarps 2" "gpt2 --forms rows --qwarps 2"
         for pc in 2048 128; do qprefill "n29f_$pc" $pc --rounds 5; done
         timeout 280 python3 benchmarks/compare.py bert-base gpt2-small --json "$R/n29f_compare.json" > "$R/n29f_compare.txt" 2>&1
         grep -E "^\||fusec|ratio|agree" "$R/n29f_compare.txt" | grep -v '^{"peaks' | head -n 30 ;;
    n29g) # the attention's one-barrier ring, the whole ring issued up front (n29f's form issued one tile fewer before the
          # first step: short shapes lost): its GPU tests, alone in turns against benchmarks/ab_prev (the two-barrier
          # form), the prefill at 2,048 and 128 tokens
         timeout 150 $PT -n 8 tests/test_kernels_gpu.py -k "attention or attn" > "$R/t_n29g.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_n29g.txt" | tail -n 8
         attn_ab "qwen3-2k --forms causal --qwarps 4 --bn 32,64" "bert --forms keys --qwarps 4" \
           "qwen3 --forms causal --qwarps 2" "gpt2 --forms rows --qwarps 2"
         for pc in 2048 128; do qprefill "n29g_$pc" $pc --rounds 5; done ;;
    drop|drop2) [ "$step" = drop2 ] && M=("qwen3-0.6b --batches 1,8 --drop 0,3") || \
                  M=("qwen3-0.6b --batches 1,8 --drop 2,1,1+2,4" "llama-1b-q4_k_m --batches 1 --drop 1,0,0+1,3")
          for m in "${M[@]}"; do
            timeout 250 python3 benchmarks/l2_bound.py "$R/drop_${m%% *}" --model $m > "$R/drop_${m%% *}.txt" 2>&1
            grep -v "^{" "$R/drop_${m%% *}.txt" | tail -n 4 | cut -c 1-900
          done ;;
    atr) timeout 150 python3 benchmarks/block_trace.py "$R/atr" --model qwen3-0.6b --batches 1,8 --blocks rope_atte \
           > "$R/atr.txt" 2>&1
         cat "$R/atr/block_trace.md" | head -n 80 ;;
    atr2) timeout 150 python3 benchmarks/block_trace.py "$R/atr2" --model qwen3-0.6b --batches 1 --blocks rope_atte \
            --ab FUSEC_PDL_PIN=value > "$R/atr2.txt" 2>&1
          cat "$R/atr2/block_trace.md" | head -n 120 ;;
    clock) timeout 150 python3 benchmarks/sm_clock.py > "$R/clock.txt" 2>&1; tail -n 4 "$R/clock.txt" | cut -c 1-800 ;;
    l2ef) timeout 300 python3 benchmarks/decode_step.py "$R/l2ef" --model qwen3-0.6b --batches 1,8 --windows 3 \
            --ab FUSEC_GEMV_L2_EVICT_FIRST=0 > "$R/l2ef.txt" 2>&1
          tail -n 6 "$R/l2ef.txt" | cut -c 1-3000 ;;
    l2q) for m in "llama-1b --batches 1"; do
           timeout 240 python3 benchmarks/decode_step.py "$R/l2q_${m%% *}" --model $m --context 32 --windows 3 \
             --ab FUSEC_GEMV_L2_EVICT_FIRST=0 > "$R/l2q_${m%% *}.txt" 2>&1
           echo "$m"; tail -n 4 "$R/l2q_${m%% *}.txt" | cut -c 1-2000
         done ;;
    l2w) for m in "qwen3-0.6b --prompt 128" "llama-1b --prompt 32"; do
           timeout 200 python3 benchmarks/prefill_step.py "$R/l2w_${m%% *}" --model $m \
             --ab FUSEC_WGMMA_L2_EVICT_FIRST=0 > "$R/l2w_${m%% *}.txt" 2>&1
           echo "$m"; grep -E "^\| " "$R/l2w_${m%% *}.txt" | head -n 6 | cut -c 1-600; tail -n 3 "$R/l2w_${m%% *}.txt" | cut -c 1-600
         done ;;
    trig) timeout 300 python3 benchmarks/decode_step.py "$R/trig" --model qwen3-0.6b --batches 1,8 --windows 3 \
            --ab FUSEC_KV_TRIGGER=merged --ab FUSEC_KV_TRIGGER=end > "$R/trig.txt" 2>&1
          tail -n 4 "$R/trig.txt" | cut -c 1-3000
          timeout 150 python3 benchmarks/block_trace.py "$R/trig_tr" --model qwen3-0.6b --batches 1 --blocks rope_atte \
            --ab FUSEC_KV_TRIGGER=end > "$R/trig_tr.txt" 2>&1
          grep -E "^#|^\| #|^step" "$R/trig_tr/block_trace.md" | cut -c 1-400 ;;
    qdq) timeout 200 $PT -n 12 tests/test_quant_gpu.py -k "dequantiz or gather or prefill or generation or token or plan" \
           > "$R/t_qdq.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_qdq.txt" | tail -n 8
         timeout 150 python3 benchmarks/dequant_bench.py > "$R/dqb.txt" 2>&1; cat "$R/dqb.txt" | tail -n 14
         for m in llama-1b-q4_k_m llama-1b-q8_0; do
           timeout 200 python3 benchmarks/prefill_step.py "$R/qdq_$m" --model $m --prompt 128 > "$R/qdq_$m.txt" 2>&1
           echo "$m"; grep -E "^\| " "$R/qdq_$m/prefill_step.md" | head -n 4 | cut -c 1-400
         done ;;
    qgemm) timeout 200 $PT -n 12 tests/test_quant_gpu.py -k "tile or dequantiz or prefill or plan or generation or token" \
           > "$R/t_qgemm.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_qgemm.txt" | tail -n 8
         timeout 150 python3 benchmarks/qgemm_bench.py --rows ${QG_ROWS:-32,128} --tilings "${QG_TILINGS:-8,4,1;8,2,2;16,2,2;16,4,1}" \
           > "$R/qgb.txt" 2>&1
         tail -n 40 "$R/qgb.txt"
         for p in 32 128; do
           timeout 110 python3 benchmarks/prefill_step.py "$R/qg_$p" --model llama-1b-q4_k_m --prompt $p \
             --ab FUSEC_QGEMM=scratch > "$R/qg_$p.txt" 2>&1
           echo "q4_k_m $p"; grep -E "^\| " "$R/qg_$p/prefill_step.md" | head -n 4 | cut -c 1-300
         done ;;
    int4_7b) # shellcheck disable=SC2086  # $INT4_AB is several arguments
          timeout 560 python3 benchmarks/int4_7b.py "$R/int4_7b" ${INT4_AB:-} > "$R/int4_7b.txt" 2>&1
          grep -vE "^\s*$" "$R/int4_7b.txt" | tail -n 60 ;;
    gcl) # clusters of 2 for the gated product with the norm at one row (FUSEC_QGEMV_DP4A_CLUSTER=gated): the dp4a GPU
        # tests, then the 7B int4 step and the Llama-1B Q4_K_M step against the rule, in turns
        timeout 160 $PT -n 12 tests/test_quant_gpu.py -k "dp4a" > "$R/t_gcl.txt" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_gcl.txt" | tail -n 12
        timeout 320 python3 benchmarks/int4_7b.py "$R/int4_7b" --ab FUSEC_QGEMV_DP4A_CLUSTER=gated > "$R/int4_7b.txt" 2>&1
        grep -E "step_ms_median|pct_roofline|same_tokens|error|Error" "$R/int4_7b.txt" | head -n 12
        timeout 100 python3 benchmarks/decode_step.py "$R/gcl_q4km" --model llama-1b-q4_k_m --batches 1 --context 32 \
          --windows 3 --ab FUSEC_QGEMV_DP4A_CLUSTER=gated > "$R/gcl_q4km.txt" 2>&1
        grep -E "^\| [0-9]+ \|" "$R/gcl_q4km.txt" | cut -c 1-1500 ;;
    kvs) timeout 360 python3 benchmarks/int4_7b.py "$R/int4_7b_kvs" --ab FUSEC_KV_MAX_SPLITS=1 --ab FUSEC_KV_MAX_SPLITS=2 \
          --ab FUSEC_KV_MAX_SPLITS=3 > "$R/int4_7b_kvs.txt" 2>&1
        grep -E "step_ms_median|pct_roofline|same_tokens|error|Error" "$R/int4_7b_kvs.txt" | head -n 16
        kv_short kvs --ab FUSEC_KV_MAX_SPLITS=1 --ab FUSEC_KV_MAX_SPLITS=2 --ab FUSEC_KV_MAX_SPLITS=4 ;;
    tcst) # the tensor-core quantized GEMV's copy in commit groups (FUSEC_QGEMV_TC_STAGES): its GPU tests, the 1B
          # products at 8 rows alone under Nsight Compute (1, 2, 4 stages), then the 1B Q4_K_M step at batch 8
          timeout 200 $PT -n 12 tests/test_quant_gpu.py -k "tensor_core" > "$R/t_tcst.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_tcst.txt" | tail -n 20
          for st in 1 2 4; do
            FUSEC_QGEMV_TC_STAGES=$st timeout 120 ncu --clock-control none -k regex:fc_qgemv --section SpeedOfLight \
              python3 benchmarks/qgemv_ncu.py --rule q4_k:8:16384x2048:glu --rule q4_k:8:2048x8192 \
              --rule q6_k:8:2048x8192 --rule q6_k:8:128256x2048 --rule q4_k:8:3072x2048 --rule q4_k:8:2048x2048 \
              > "$R/tcst_ncu$st.txt" 2>&1
            echo "stages $st"; grep -E "^launch:|Duration|DRAM Throughput" "$R/tcst_ncu$st.txt" | head -n 30
          done
          timeout 200 python3 benchmarks/decode_step.py "$R/tcst_b8" --model llama-1b-q4_k_m --batches 8 --context 32 \
            --windows 3 --ab FUSEC_QGEMV_TC_STAGES=2 --ab FUSEC_QGEMV_TC_STAGES=4 > "$R/tcst_b8.txt" 2>&1
          grep -E "^\| (batch|[0-9]+) \|" "$R/tcst_b8.txt" | cut -c 1-900 ;;
    tcw8) # the tensor-core quantized GEMV on 8 warps a block of 16 rows everywhere (FUSEC_QGEMV_TC_MIN_WARPS=8: half
          # the chunks a warp, so half its scale table): the 1B Q4_K_M step at batches 1 and 8
          timeout 200 python3 benchmarks/decode_step.py "$R/tcw8" --model llama-1b-q4_k_m --batches 1,8 --context 32 \
            --windows 3 --ab FUSEC_QGEMV_TC_MIN_WARPS=8 > "$R/tcw8.txt" 2>&1
          grep -E "^\| (batch|[0-9]+) \|" "$R/tcw8.txt" | cut -c 1-900 ;;
    hw) # 5- and 6-bit codes' high bits byte-aligned with the code words (fusec/quant.py, plan format 3): the 5/6-bit
        # products alone under Nsight Compute, this tree against an earlier one ($OLD_TREE: a git archive, carried; run
        # after qtests, every packed GPU test)
        hw_tree ncu ;;
    hwstep) # the same two trees' decode steps ($HW_MODELS at $HW_BATCHES), each its own process, in turns
        hw_tree step ;;
    tctrace) # the tensor-core quantized GEMV's blocks in the 1B Q4_K_M step at batch 8 (block_trace.py, the last layer
             # and the LM head): when each block passed its wait, its first stage's copies landed (phase 1), its first
             # run was summed (2), every warp's sums were in shared memory (3), and it ended
        timeout 200 python3 benchmarks/block_trace.py "$R/tctrace" --model llama-1b-q4_k_m --batches 8 --context 32 \
          --blocks qgemv > "$R/tctrace.txt" 2>&1
        tail -n 3 "$R/tctrace.txt"; grep -E "^step|^\| " "$R/tctrace/block_trace.md" | cut -c 1-400 | head -n 60 ;;
    tcr) # issue 22's batch-8 ratio in one call: the Llama-1B shape's bf16 plan and its Q4_K_M plan at batch 8 (two
         # processes, one after the other)
         for mname in llama-1b llama-1b-q4_k_m; do
           timeout 100 python3 benchmarks/decode_step.py "$R/tcr_$mname" --model "$mname" --batches 8 --context 32 \
             --windows 3 > "$R/tcr_$mname.txt" 2>&1
           echo "$mname"; grep -E "^\| (batch|[0-9]+) \|" "$R/tcr_$mname.txt" | cut -c 1-400
         done ;;
    tcprof) # where the tensor-core quantized GEMV's warps stall at 8 rows: Nsight Compute's full set on the 1B Q4_K
            # gate/up and the Q6_K LM head, the details and the SASS with its stall samples
            timeout 200 ncu --clock-control none -k regex:fc_qgemv --set full --import-source yes -o "$R/tcprof" \
              python3 benchmarks/qgemv_ncu.py --rule q4_k:8:16384x2048:glu --rule q6_k:8:128256x2048 > "$R/tcprof.txt" 2>&1
            tail -n 3 "$R/tcprof.txt"
            ncu -i "$R/tcprof.ncu-rep" --page details --print-details all > "$R/tcprof_details.txt" 2>&1
            ncu -i "$R/tcprof.ncu-rep" --page source --csv --print-source sass > "$R/tcprof_sass.csv" 2>&1
            grep -E "Duration|Warp Cycles Per Issued|Stall|stall|Eligible|Occupancy|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth" \
              "$R/tcprof_details.txt" | head -n 80; wc -l "$R/tcprof_sass.csv"; rm -f "$R/tcprof.ncu-rep" ;;
    kvm) # the decode attention's key loop on tensor cores (FUSEC_KV_MMA): its GPU tests, then the short-context steps
         timeout 240 $PT -n 12 tests/test_decode_kernels_gpu.py tests/test_kv_heads_gpu.py -k "kv_attention or prologue" \
           > "$R/t_kvm.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kvm.txt" | tail -n 20
         kv_short kvm --ab FUSEC_KV_MMA=0 --ab FUSEC_KV_MMA=1
         timeout 110 python3 benchmarks/decode_step.py "$R/kvm_b8" --model qwen3-0.6b --batches 8 --context 128 \
           --windows 3 --ab FUSEC_KV_MMA=0 --ab FUSEC_KV_MMA=1 > "$R/kvm_b8.txt" 2>&1
         grep -E "^\| (batch|[0-9]+) \|" "$R/kvm_b8.txt" | cut -c 1-900 ;;
    kvmt) # the block trace of the attention (Qwen3-0.6B, context 128, batches 1 and 8) with FUSEC_KV_MMA=1 against the rule
          timeout 200 python3 benchmarks/block_trace.py "$R/kvmt" --model qwen3-0.6b --batches 1,8 --blocks rope_atte \
            --ab FUSEC_KV_MMA=1 > "$R/kvmt.txt" 2>&1
          cat "$R/kvmt/block_trace.md" | head -n 60 ;;
    kvm7) timeout 330 python3 benchmarks/int4_7b.py "$R/int4_7b_kvm" --ab FUSEC_KV_MMA=1 --ab FUSEC_KV_TRIGGER=prologue \
            > "$R/int4_7b_kvm.txt" 2>&1
          grep -E "step_ms_median|pct_roofline|same_tokens|error|Error" "$R/int4_7b_kvm.txt" | head -n 12 ;;
    kvr) # the tensor-core key loop as the rule: the attention's GPU tests, the generation and PDL tests, the families'
         timeout 330 $PT -n 12 tests/test_decode_kernels_gpu.py tests/test_kv_heads_gpu.py tests/test_generation_gpu.py \
           tests/test_pdl_gpu.py tests/test_head_rope_pair.py tests/test_generation_families_gpu.py > "$R/t_kvr.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kvr.txt" | tail -n 20 ;;
    kvm1) # the tensor-core key loop (the rule there) on the GQA-4 Llama-1B shape against the SIMT loop (FUSEC_KV_MMA=0):
          # Q4_K_M at batches 1 and 8, bf16 at 1
          for m in llama-1b-q4_k_m:1,8 llama-1b:1; do IFS=: read -r mname bs <<< "$m"
            timeout 150 python3 benchmarks/decode_step.py "$R/kvm1_$mname" --model "$mname" --batches "$bs" --context 32 \
              --windows 3 --ab FUSEC_KV_MMA=0 > "$R/kvm1_$mname.txt" 2>&1
            echo "$mname"; grep -E "^\| (batch|[0-9]+) \|" "$R/kvm1_$mname.txt" | cut -c 1-900
          done ;;
    kvtp) # the attention's PDL trigger once its prologue is in, alone and with the tensor-core key loop
          kv_short kvtp --ab FUSEC_KV_TRIGGER=prologue --ab FUSEC_KV_TRIGGER=prologue+FUSEC_KV_MMA=1
          timeout 110 python3 benchmarks/decode_step.py "$R/kvtp_b8" --model qwen3-0.6b --batches 8 --context 128 \
            --windows 3 --ab FUSEC_KV_TRIGGER=prologue --ab FUSEC_KV_TRIGGER=prologue+FUSEC_KV_MMA=1 > "$R/kvtp_b8.txt" 2>&1
          grep -E "^\| (batch|[0-9]+) \|" "$R/kvtp_b8.txt" | cut -c 1-900 ;;
    kvab) # the decode attention's merge knobs on the Llama-1B Q4_K_M (context 32) and Qwen3-0.6B (128) steps at batch 1
        kv_short kvab --ab FUSEC_KV_CLUSTER=0 --ab FUSEC_KV_SPLIT_KEYS=128 --ab FUSEC_KV_SPLIT_KEYS=32 ;;
    c1) timeout 90 $PT -n 8 tests/test_quant_gpu.py -k "cluster" > "$R/t_c1.txt" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_c1.txt" | tail -n 12
        timeout 300 python3 benchmarks/int4_7b.py "$R/int4_7b" --ab FUSEC_QGEMV_DP4A_CLUSTER=1 > "$R/int4_7b.txt" 2>&1
        grep -E "step_ms_median|pct_roofline|same_tokens|error" "$R/int4_7b.txt" | head -n 12
        for m in llama-1b-q4_k_m llama-7b-q4_k_m; do
          timeout 150 python3 benchmarks/decode_step.py "$R/c1_$m" --model $m --batches 1 --context 32 --windows 3 \
            --ab FUSEC_QGEMV_DP4A_CLUSTER=1 > "$R/c1_$m.txt" 2>&1
          grep -E "^\| [0-9]+ \|" "$R/c1_$m.txt" | cut -c 1-1500
        done ;;
    qgemm2) timeout 120 $PT -n 12 tests/test_quant_gpu.py -k "tile or prefill" > "$R/t_qgemm2.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_qgemm2.txt" | tail -n 8
          for m in llama-1b-q4_k_m llama-1b-q8_0; do
            timeout 200 python3 benchmarks/prefill_step.py "$R/qg2_$m" --model $m --prompt 32 \
              --ab FUSEC_QGEMM=scratch --ab FUSEC_QGEMM=tile > "$R/qg2_$m.txt" 2>&1
            echo "$m 32"; grep -E "^\| " "$R/qg2_$m/prefill_step.md" | head -n 5 | cut -c 1-200
          done ;;
    qgemm3) timeout 90 $PT -n 12 tests/test_quant_gpu.py -k "tile or prefill" > "$R/t_qgemm3.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_qgemm3.txt" | tail -n 8
          timeout 60 python3 benchmarks/qgemm_bench.py --rows 32 --formats q4_k --tilings "4,1,4" > "$R/qgb3.txt" 2>&1
          grep -E "^\| " "$R/qgb3.txt"
          timeout 100 python3 benchmarks/prefill_step.py "$R/qg3" --model llama-1b-q4_k_m --prompt 32 \
            --ab FUSEC_QGEMM=scratch > "$R/qg3.txt" 2>&1
          grep -E "^\| " "$R/qg3/prefill_step.md" | head -n 4 | cut -c 1-200 ;;
    qfinal) timeout 280 $PT -n 12 tests/test_quant_gpu.py > "$R/t_qfinal.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_qfinal.txt" | tail -n 8
            for m in llama-1b-q4_k_m llama-1b-q8_0; do
              timeout 150 python3 benchmarks/decode_step.py "$R/qf_$m" --model $m --batches 1,8 --context 32 --windows 2 \
                > "$R/qf_$m.txt" 2>&1
              echo "$m"; tail -n 3 "$R/qf_$m.txt" | cut -c 1-1200
            done ;;
    l2rate) timeout 120 python3 benchmarks/l2_rate.py > "$R/l2rate.txt" 2>&1; cat "$R/l2rate.txt" | tail -n 8 ;;
    l2b) for m in "qwen3-0.6b --batches 1,8" "llama-1b-q4_k_m --batches 1"; do
           timeout 200 python3 benchmarks/l2_bound.py "$R/l2b_${m%% *}" --model $m > "$R/l2b_${m%% *}.txt" 2>&1
           tail -n 4 "$R/l2b_${m%% *}.txt" | cut -c 1-600
         done ;;
    ctx4k32) timeout 500 python3 benchmarks/decode_step.py "$R/ctx4k32" --model qwen3-0.6b --batches 32 --context 4096 \
               --windows 2 > "$R/ctx4k32.txt" 2>&1
             grep -E "^\| [0-9]+ \|" "$R/ctx4k32.txt" | cut -c 1-400; tail -n 3 "$R/ctx4k32.txt" | cut -c 1-600 ;;
    stream_ab) timeout 300 python3 benchmarks/stream_ab.py > "$R/stream_ab.txt" 2>&1; tail -n 6 "$R/stream_ab.txt" ;;
    gemm_t) timeout 150 $PT -n 8 tests/test_kernels_gpu.py tests/test_pdl_gpu.py -k "gemm" > "$R/t_gemm.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_gemm.txt" | tail -n 12 ;;
    stream) timeout 120 $PT -n 8 tests/test_kernels_gpu.py -k "gemm" > "$R/t_stream.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_stream.txt" | tail -n 12
            PREFILL_AB="--ab FUSEC_GEMM_STREAM=0" prefill_ab ;;
    stream_k) for sh in qwen3 llama; do timeout 100 python3 benchmarks/gemm_stream_bench.py --shapes $sh --splits 1,2,4,8 \
                2>&1 | tail -n 20; done
              timeout 150 ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
                --section MemoryWorkloadAnalysis --section SchedulerStats -k regex:fc_gemm -c 4 \
                python3 benchmarks/gemm_stream_bench.py --ncu --splits 1,4 > "$R/stream_ncu.txt" 2>&1
              grep -E "fc_gemm|Duration|Warp Cycles Per Issued|Stall|Registers|Achieved Occupancy|Block Limit|Compute \(SM\)|Memory Throughput|L2 Hit|DRAM Throughput|Issued Warp|No Eligible|Cluster" "$R/stream_ncu.txt" | head -n 90 ;;
    step_final) timeout 200 python3 benchmarks/decode_step.py "$R/step_final" --model qwen3-0.6b --batches 1,8 --windows 3 \
                  > "$R/step_final.txt" 2>&1
                tail -n 4 "$R/step_final.txt" | cut -c 1-3000 ;;
    trace) timeout 300 python3 benchmarks/block_trace.py "$R/trace_q" --model qwen3-0.6b --batches 1,8 --modes pdl,plain \
             > "$R/trace_q.txt" 2>&1
           cat "$R/trace_q/block_trace.md"
           timeout 120 python3 benchmarks/block_trace.py "$R/trace_l" --model llama-1b --batches 1 --context 32 > "$R/trace_l.txt" 2>&1
           tail -n 12 "$R/trace_l.txt" ;;
    qfuse) timeout 200 python3 benchmarks/qfuse_ab.py > "$R/qfuse.txt" 2>&1; tail -n 4 "$R/qfuse.txt" ;;
    btests) timeout 200 $PT -n 8 tests/test_gemv_gpu.py -k "bulk or ring_equals" > "$R/t_bulk.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_bulk.txt" | tail -n 12 ;;
    step_ab) timeout 330 python3 benchmarks/decode_step.py "$R/step_ab" --model qwen3-0.6b --batches ${STEP_BATCHES:-1,8} --windows 3 \
               $STEP_AB > "$R/step_ab.txt" 2>&1
             tail -n 5 "$R/step_ab/decode_step.md"
             [ -n "$STEP_NOLLAMA" ] || timeout 150 python3 benchmarks/decode_step.py "$R/step_abl" --model llama-1b --batches 1 --context 32 --windows 3 \
               $STEP_AB > "$R/step_abl.txt" 2>&1
             tail -n 3 "$R/step_abl/decode_step.md" ;;
    trace_ab) timeout 200 python3 benchmarks/block_trace.py "$R/trace_ab" --model qwen3-0.6b --batches 1 $STEP_AB \
                > "$R/trace_ab.txt" 2>&1
              cat "$R/trace_ab/block_trace.md" ;;
    step_l) timeout 150 python3 benchmarks/decode_step.py "$R/step_l" --model llama-1b --batches 1 --context 32 --gemv-forms ring,register > "$R/step_l.txt" 2>&1
            tail -n 5 "$R/step_l.txt" ;;
    peer) timeout 270 python3 benchmarks/decode.py "$R/peer.json" --quick --batches 1 --contexts 128 --budget-s 180 --hf none --no-fp32-check > "$R/peer.txt" 2>&1
          tail -n 25 "$R/peer.txt" ;;
    peer8) timeout 420 python3 benchmarks/decode.py "$R/peer8.json" --quick --batches 1,8 --contexts 128 --budget-s 330 \
             --hf none > "$R/peer8.txt" 2>&1
           tail -n 25 "$R/peer8.txt" ;;
    step_diag) timeout 300 python3 benchmarks/decode_step.py "$R/step_d" --model qwen3-0.6b --batches 1 --windows 2 > "$R/step_d.txt" 2>&1
               tail -n 4 "$R/step_d.txt" ;;
    quant) timeout 150 python3 benchmarks/quant_bench.py "$R/quant" --quick > "$R/quant.txt" 2>&1
           tail -n 30 "$R/quant.txt" ;;
    quant_full) timeout 330 python3 benchmarks/quant_bench.py "$R/quant" > "$R/quant.txt" 2>&1
                tail -n 40 "$R/quant.txt" ;;
    train_full) timeout 400 python3 benchmarks/train.py "$R/train" > "$R/train.txt" 2>&1
                tail -n 30 "$R/train.txt" ;;
    rows16) timeout 200 $PT -n 12 tests/test_quant_gpu.py -k "tensor_core or batch_16 or dequantizing_path" \
              > "$R/t_rows16.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_rows16.txt" | tail -n 12
            for m in llama-1b-q4_k_m:9,12,16 llama-1b-q8_0:16 llama-7b-q4_k_m:16; do IFS=: read -r mname bs <<< "$m"
              timeout 150 python3 benchmarks/decode_step.py "$R/rows16_$mname" --model "$mname" --batches "$bs" \
                --context 32 --windows 3 --ab FUSEC_QGEMV_MAX_ROWS=8 > "$R/rows16_$mname.txt" 2>&1
              grep -E "^\| (batch|[0-9]+) \|" "$R/rows16_$mname.txt" | cut -c 1-400
            done
            timeout 100 python3 benchmarks/decode_step.py "$R/rows16_bf16" --model llama-1b --batches 16 --context 32 \
              --windows 3 > "$R/rows16_bf16.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/rows16_bf16.txt" | cut -c 1-200 ;;
    qtests) timeout 280 $PT -n 12 tests/test_quant_gpu.py > "$R/t_quant.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_quant.txt" | tail -n 12 ;;
    qtc) timeout 150 $PT -n 12 tests/test_quant_gpu.py -k tensor_core > "$R/t_qtc.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_qtc.txt" | tail -n 12 ;;
    q14) timeout 200 $PT -n 8 tests/test_quant_gpu.py -k "dp4a" > "$R/t_q14.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q14.txt" | tail -n 12
         for mb in llama-7b-q4_k_m:1 llama-1b-q4_k_m:1; do
           m=${mb%:*}
           timeout 200 python3 benchmarks/decode_step.py "$R/q14_$m" --model $m --batches ${mb#*:} --context 32 --windows 3 \
             --ab FUSEC_QGEMV_DP4A_CHUNKS=4 > "$R/q14_$m.txt" 2>&1
           tail -n 1 "$R/q14_$m.txt" | cut -c 1-1500
         done
         for m in llama-1b-q8_0; do
           timeout 200 python3 benchmarks/decode_step.py "$R/q14w_$m" --model $m --batches 4,8 --context 32 --windows 3 \
             --ab FUSEC_QGEMV_FORM=tc > "$R/q14w_$m.txt" 2>&1
           grep -E "^\| [48] \|" "$R/q14w_$m.txt" | cut -c 1-1500
         done ;;
    q14b) timeout 200 $PT tests/test_quant_gpu.py -k "generation or packed_decode or plan_with" tests/test_generation_families_gpu.py \
            > "$R/t_q14b.txt" 2>&1
          grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q14b.txt" | tail -n 12
          for mb in llama-1b-q4_k_m:1,8 llama-7b-q4_k_m:1; do
            m=${mb%:*}
            timeout 240 python3 benchmarks/decode_step.py "$R/q14b_$m" --model $m --batches ${mb#*:} --context 32 \
              --windows 3 --ab disable=norm_copies > "$R/q14b_$m.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/q14b_$m.txt" | cut -c 1-1500
          done ;;
    q18) ab_step q18 "norm_weights_loaded_early or (dp4a and norm)" 1 "--ab FUSEC_QGEMV_DP4A_NORM_EARLY=0" \
           llama-1b-q4_k_m llama-7b-q4_k_m ;;
    q42) ab_step q42 "argmax or heads_partials or generation" 1 "--ab disable=gemm_sample" llama-1b-q4_k_m \
           llama-7b-q4_k_m ;;
    q43) ab_step q43 "siblings or generation" 1 "--ab disable=packed_siblings" llama-1b-q4_k_m llama-7b-q4_k_m ;;
    q45) timeout 200 $PT -n 12 tests/test_quant_gpu.py -k tensor_core > "$R/t_q45.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q45.txt" | tail -n 12
         timeout 200 python3 benchmarks/decode_step.py "$R/q45" --model llama-1b-q8_0 --batches 4,8 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_FORM=dp4a > "$R/q45.txt" 2>&1
         grep -E "^\| [0-9]+ \||pdl_profile" "$R/q45.txt" | cut -c 1-2500 ;;
    q47) timeout 300 python3 benchmarks/quant_bench.py "$R/qvar8" --variants --formats q8_0 --skip torch,decode \
           > "$R/qvar8.txt" 2>&1
         grep "^| llama" "$R/qvar8.txt" | tail -n 80 ;;
    q48) timeout 200 python3 benchmarks/decode_step.py "$R/q48" --model llama-1b-q8_0 --batches 4,8 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_FORM=tc --ab FUSEC_QGEMV_TC_MIN_WARPS=4 > "$R/q48.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q48.txt" | cut -c 1-1500 ;;
    q49) timeout 200 python3 benchmarks/quant_bench.py "$R/qvar46" --variants --formats q4_k,q6_k --skip torch,decode \
           > "$R/qvar46.txt" 2>&1
         grep "^| llama" "$R/qvar46.txt" | grep -v "dp4a r1 w8 b[134]" | cut -d"|" -f3,5,6,7,8 | tail -n 140
         timeout 200 python3 benchmarks/decode_step.py "$R/q49" --model llama-1b-q4_k_m --batches 4,8 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_TC_MIN_WARPS=8 --ab FUSEC_QGEMV_FORM=dp4a > "$R/q49.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q49.txt" | cut -c 1-1500 ;;
    q50) timeout 150 $PT -n 12 tests/test_quant_gpu.py -k "gated_epilogue" > "$R/t_q50.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q50.txt" | tail -n 12
         for m in llama-1b-q4_k_m llama-1b-q8_0; do
           timeout 150 python3 benchmarks/decode_step.py "$R/q50_$m" --model $m --batches 4,8 --context 32 \
             --windows 3 --ab FUSEC_QGEMV_TC_GATE=0 > "$R/q50_$m.txt" 2>&1
           grep -E "^\| [0-9]+ \|" "$R/q50_$m.txt" | cut -c 1-1500
         done ;;
    kvwave) timeout 150 $PT -n 8 tests/test_decode_kernels_gpu.py tests/test_kv_heads_gpu.py -k "kv_attention or prologue" \
              > "$R/t_kvwave.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_kvwave.txt" | tail -n 12
            timeout 400 python3 benchmarks/decode_step.py "$R/kvwave" --model qwen3-0.6b --batches 32 --context 128 \
              --windows 3 --ab FUSEC_KV_WAVE_BLOCKS=8 > "$R/kvwave.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/kvwave.txt" | cut -c 1-1500 ;;
    kvtrace) timeout 300 python3 benchmarks/block_trace.py "$R/kvtrace" --model qwen3-0.6b --batches 32 --context 1024 \
               --blocks rope_atte > "$R/kvtrace.txt" 2>&1
             grep -E "^step|rope_atte" "$R/kvtrace/block_trace.md" | cut -c 1-400 | head -n 16 ;;
    q19) ab_step q19 "dequantizing_path" 8 "--ab FUSEC_QGEMV_MAX_ROWS=4" llama-1b-q8_0 llama-1b-q4_k_m ;;
    q20) for m in llama-1b-q4_k_m qwen3-0.6b; do
           timeout 120 python3 benchmarks/block_trace.py "$R/q20_$m" --model $m --context 32 --blocks rope_atte \
             > "$R/q20_$m.txt" 2>&1
           grep -A 20 "blocks that end last" "$R/q20_$m/block_trace.md" | head -n 22
         done ;;
    q21) timeout 200 $PT -n 8 tests/test_quant_gpu.py -k dp4a > "$R/t_q21.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q21.txt" | tail -n 12
         timeout 200 python3 benchmarks/decode_step.py "$R/q21" --model llama-1b-q4_k_m --batches 1,8 --context 32 \
           --windows 3 > "$R/q21.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q21.txt" | cut -c 1-1500 ;;
    q22) for m in llama-1b-q4_k_m llama-7b-q4_k_m llama-1b-q8_0; do
           timeout 150 python3 benchmarks/decode_step.py "$R/q22_$m" --model "$m" --batches 1 --context 32 --windows 3 \
             --ab FUSEC_PDL_PIN=value > "$R/q22_$m.txt" 2>&1
           grep -E "^\| [0-9]+ \|" "$R/q22_$m.txt" | cut -c 1-1500
         done ;;
    q24) timeout 150 $PT -n 8 tests/test_quant_gpu.py -k tensor_core > "$R/t_q24a.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q24a.txt" | tail -n 12
         timeout 120 python3 benchmarks/decode_step.py "$R/q24_b8" --model llama-1b-q4_k_m --batches 8 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_TC_RUNS=1 > "$R/q24_b8.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q24_b8.txt" | cut -c 1-1500
         timeout 120 python3 benchmarks/block_trace.py "$R/q24_trace" --model llama-1b-q4_k_m --context 32 \
           --blocks rope_atte > "$R/q24_trace.txt" 2>&1
         grep -E "^step|rope_atte" "$R/q24_trace/block_trace.md" | head -n 12 ;;
    q25) timeout 100 python3 benchmarks/decode_step.py "$R/q25_q8" --model llama-1b-q8_0 --batches 8 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_WIDE_GATE=fma > "$R/q25_q8.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q25_q8.txt" | cut -c 1-1500 ;;
    q26) timeout 150 $PT -n 8 tests/test_quant_gpu.py -k "tensor_core or generation or packed_decode or plan_with" \
           > "$R/t_q26.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q26.txt" | tail -n 12
         timeout 120 python3 benchmarks/decode_step.py "$R/q26_b8" --model llama-1b-q4_k_m --batches 8 --context 32 \
           --windows 3 > "$R/q26_b8.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q26_b8.txt" | cut -c 1-1500 ;;
    q29) timeout 250 python3 benchmarks/decode_step.py "$R/q29" --model qwen3-0.6b --batches 1,8 --context 512 \
           --windows 3 --ab FUSEC_KV_UNROLL=8 --ab FUSEC_KV_CLUSTER=0 > "$R/q29.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q29.txt" | cut -c 1-1500; tail -n 2 "$R/q29.txt"
         qmerge ;;
    qmerge) qmerge ;;
    q30) timeout 100 $PT -n 8 tests/test_quant_gpu.py -k "two_long_rows" > "$R/t_q30.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q30.txt" | tail -n 12
         timeout 200 python3 benchmarks/decode_step.py "$R/q30" --model llama-7b-q4_k_m --batches 1 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_DP4A_FILL=0 > "$R/q30.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q30.txt" | cut -c 1-1500; tail -n 2 "$R/q30.txt"
         timeout 200 python3 benchmarks/block_trace.py "$R/q30_trace" --model llama-7b-q4_k_m --context 32 \
           --ab FUSEC_QGEMV_DP4A_FILL=0 > "$R/q30_trace.txt" 2>&1
         grep -E "^step|^### |qgemv" "$R/q30_trace/block_trace.md" | cut -c 1-400 | head -n 30 ;;
    q31) for c in 128 256 384; do
           timeout 150 python3 benchmarks/decode_step.py "$R/q31_$c" --model qwen3-0.6b --batches 8 --context $c \
             --windows 3 --ab FUSEC_KV_CLUSTER=0 > "$R/q31_$c.txt" 2>&1
           grep -E "^\| [0-9]+ \|" "$R/q31_$c.txt" | cut -c 1-600; tail -n 1 "$R/q31_$c.txt"
         done ;;
    q32) timeout 120 $PT -n 8 tests/test_quant_gpu.py -k "cluster_writes or dp4a_qgemv_matches_reference" > "$R/t_q32.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q32.txt" | tail -n 12
         for mb in llama-7b-q4_k_m:1 llama-1b-q4_k_m:1 llama-1b-q8_0:8; do
           m=${mb%:*}
           timeout 200 python3 benchmarks/decode_step.py "$R/q32_$m" --model $m --batches ${mb#*:} --context 32 \
             --windows 3 --ab FUSEC_QGEMV_DP4A_CLUSTER=1 --ab FUSEC_QGEMV_DP4A_CLUSTER=2 --ab FUSEC_QGEMV_DP4A_CLUSTER=4 \
             > "$R/q32_$m.txt" 2>&1
           grep -E "^\| [0-9]+ \|" "$R/q32_$m.txt" | head -n 1 | cut -c 1-700; tail -n 1 "$R/q32_$m.txt"
         done
         timeout 150 python3 benchmarks/block_trace.py "$R/q32_trace" --model llama-7b-q4_k_m --context 32 \
           --ab FUSEC_QGEMV_DP4A_CLUSTER=4 > "$R/q32_trace.txt" 2>&1
         grep -E "^step|^### |qgemv|gated_ep" "$R/q32_trace/block_trace.md" | cut -c 1-330 | head -n 30 ;;
    q33) timeout 260 $PT -n 8 tests/test_quant_gpu.py -k dp4a > "$R/t_q33a.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q33a.txt" | tail -n 12
         timeout 150 $PT -n 8 tests/test_decode_kernels_gpu.py -k kv_attention > "$R/t_q33b.txt" 2>&1
         grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_q33b.txt" | tail -n 12
         timeout 150 python3 benchmarks/decode_step.py "$R/q33" --model llama-1b-q8_0 --batches 4,8 --context 32 \
           --windows 3 --ab FUSEC_QGEMV_DP4A_CLUSTER=1 > "$R/q33.txt" 2>&1
         grep -E "^\| [0-9]+ \|" "$R/q33.txt" | cut -c 1-700; tail -n 1 "$R/q33.txt" ;;
    q35) for m in llama-7b-q4_k_m llama-1b-q4_k_m; do
           timeout 140 python3 benchmarks/block_trace.py "$R/q35_$m" --model $m --context 32 \
             --ab FUSEC_QGEMV_DP4A_CLUSTER=2 > "$R/q35_$m.txt" 2>&1
           grep -E "^step|^### |qgemv|gated_ep|rope_att" "$R/q35_$m/block_trace.md" | cut -c 1-330 | head -n 30
         done ;;
    q7prof) timeout 200 python3 benchmarks/decode_step.py "$R/q7prof" --model llama-7b-q4_k_m --batches 1 --context 32 \
              --windows 3 > "$R/q7prof.txt" 2>&1
            grep -E "^\| [0-9]+ \|" "$R/q7prof.txt" | cut -c 1-1500 ;;
    qvariants) timeout 360 python3 benchmarks/quant_bench.py "$R/qvar" --variants --skip torch,decode > "$R/qvar.txt" 2>&1
               grep "^| llama" "$R/qvar.txt" | tail -n 70 ;;
    qdecode) timeout 250 python3 benchmarks/quant_bench.py "$R/qdec" --skip kernels,torch --qgemv-forms auto,tc > "$R/qdec.txt" 2>&1
             grep "^| 1b" "$R/qdec.txt" ;;
    qtab) # issue 22's table in one run: the Llama-1B Q4_K_M, Q8_0 and bf16 plans (the same weights) at batches 1 and 8
        timeout 330 python3 benchmarks/quant_bench.py "$R/qtab" --skip kernels,torch > "$R/qtab.txt" 2>&1
        grep -E "^\| " "$R/qtab.txt" | tail -n 12 ;;
    q7b) timeout 300 python3 benchmarks/quant_bench.py "$R/q7b" --7b --skip kernels,torch > "$R/q7b.txt" 2>&1
         tail -n 6 "$R/q7b.txt" ;;
    qncu) FUSEC_LINEINFO=1 timeout 150 ncu --clock-control none -k regex:fc_qgemv --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section SchedulerStats \
            --section MemoryWorkloadAnalysis_Tables --section SourceCounters \
            python3 benchmarks/qgemv_ncu.py > "$R/qncu.txt" 2>&1
          grep -E "^launch:|fc_qgemv|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|L1/TEX Hit|Mem Busy|Max Bandwidth|Waves Per SM" "$R/qncu.txt" | head -n 90 ;;
    qgncu) FUSEC_LINEINFO=1 timeout 200 ncu --clock-control none -k regex:fc_qgemm --launch-skip 1 --launch-count 1 \
             --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
             --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
             python3 benchmarks/qgemm_ncu.py --tile ${QG_TILE:-4,1,4} > "$R/qgncu.txt" 2>&1
           grep -E "Duration|Throughput|Achieved Occ|Registers Per|Warp Cycles Per Issued|Issued Warp|No Eligible|Active Warps|Eligible Warps|Stall|stall|L1/TEX Hit|L2 Hit|Waves" "$R/qgncu.txt" | head -n 60
           grep -B2 -A14 "Warp State" "$R/qgncu.txt" | head -n 60 ;;
    qsrc) FUSEC_LINEINFO=1 timeout 300 ncu --clock-control none -k regex:fc_qgemv --set full --import-source yes -f \
            -o "$R/tc8" python3 benchmarks/qgemv_ncu.py --rule q4_k:8:16384x2048 --rule q6_k:8:128256x2048 \
            --rule q6_k:8:2048x8192 > "$R/tc8_run.txt" 2>&1
          tail -n 4 "$R/tc8_run.txt"
          ncu -i "$R/tc8.ncu-rep" --page details --print-details all > "$R/tc8_details.txt" 2>&1
          ncu -i "$R/tc8.ncu-rep" --page source --csv --print-source sass > "$R/tc8_sass.csv" 2>&1
          rm -f "$R/tc8.ncu-rep"
          grep -E "^launch:|Duration|DRAM Throughput|L1/TEX Hit|L2 Hit|Warp Cycles Per Issued|Achieved Occ|Stall" \
            "$R/tc8_details.txt" | head -n 80
          python3 benchmarks/sass_stalls.py "$R/tc8_sass.csv" --top 25 2>&1 | head -n 120 ;;
    qncu8) timeout 200 ncu --clock-control none -k regex:fc_qgemv --section SpeedOfLight --section Occupancy \
             --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section LaunchStats \
             python3 benchmarks/qgemv_ncu.py --rule q8_0:8:16384x2048:norm:glu --rule q8_0:8:2048x8192 \
             --rule q8_0:8:3072x2048:norm --rule q6_k:8:2048x8192 --rule q4_k:8:16384x2048 \
             --rule q4_k:1:16384x2048:norm:glu --rule q4_k:1:2048x8192 > "$R/qncu8.txt" 2>&1
           grep -E "^launch:|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Waves Per SM|Stall" "$R/qncu8.txt" | head -n 120 ;;
    pncu) timeout 200 ncu --clock-control none -k regex:fc_gemv --launch-skip 20 --launch-count 4 --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
            --section SchedulerStats python3 benchmarks/plan_ncu.py 1 > "$R/pncu.txt" 2>&1
          FUSEC_GEMV_FORM=register timeout 200 ncu --clock-control none -k regex:fc_gemv --launch-skip 20 \
            --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
            --section LaunchStats --section SchedulerStats python3 benchmarks/plan_ncu.py 1 > "$R/pncu_reg.txt" 2>&1
          grep -E "fc_gemv|Duration|DRAM Throughput|Warp Cycles Per Issued|Stall" "$R/pncu_reg.txt" | head -n 60
          grep -E "^decode launches|fc_gemv|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit|Waves Per SM|No Eligible|Stall|L2 Hit|Mem Busy|Max Bandwidth|Dynamic Shared" "$R/pncu.txt" | head -n 120 ;;
    kvncu) timeout 150 ncu --clock-control none -k regex:fc_kvattn --section SpeedOfLight --section Occupancy \
             --section WarpStateStats --section LaunchStats --section SchedulerStats python3 benchmarks/kv_ncu.py > "$R/kvncu.txt" 2>&1
           grep -E "^launch:|fc_kvattn|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit|Waves Per SM|Cluster|No Eligible|Stall" "$R/kvncu.txt" | head -n 80 ;;
    minilm) timeout 300 python3 benchmarks/train.py "$R/train_minilm" --skip speed,parity,accuracy --minilm-dir .minilm > "$R/minilm.txt" 2>&1
            tail -n 5 "$R/minilm.txt" ;;
    serve32) timeout 75 python3 benchmarks/serve.py "$R/serve" --clients 32 --duration 8 > "$R/serve.txt" 2>&1
             tail -n 8 "$R/serve.txt" ;;
    serve_admit) timeout 100 python3 benchmarks/serve.py "$R/serve_a0" --clients 32 --duration 8 > "$R/serve_a0.txt" 2>&1
                 grep "^| 32" "$R/serve_a0.txt"
                 timeout 160 python3 benchmarks/serve.py "$R/serve_a4" --clients 8,32 --admit-div 4 --duration 8 > "$R/serve_a4.txt" 2>&1
                 grep -E "^\| (8|32) " "$R/serve_a4.txt" ;;
    serve_ab) timeout 100 python3 benchmarks/serve.py "$R/serve_h11" --clients 32 --admit-div 4 --duration 8 > "$R/serve_h11.txt" 2>&1
              grep -E "^\| 32 " "$R/serve_h11.txt"
              python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl2/*.whl
              PYTHONPATH=/tmp/site2:$PYTHONPATH timeout 160 python3 benchmarks/serve.py "$R/serve_fast" --clients 8,32 --admit-div 4 --duration 8 > "$R/serve_fast.txt" 2>&1
              grep -E "^\| (8|32) " "$R/serve_fast.txt" ;;
    admit_prof) timeout 250 python3 benchmarks/admit_profile.py "$R/admit_prof" --admit 8 > "$R/admit_prof.txt" 2>&1
                tail -n 30 "$R/admit_prof.txt" ;;
    join_cost) timeout 240 python3 benchmarks/join_cost.py "$R/join_cost" --joins 1,2,4 > "$R/join_cost.txt" 2>&1
               grep -E "^J=" "$R/join_cost.txt"; tail -n 14 "$R/join_cost.txt" ;;
    jtests) timeout 150 $PT -n 4 tests/test_generation_join_gpu.py tests/test_decode_kernels_gpu.py -k "join or cache_write" > "$R/t_join.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_join.txt" | tail -n 8 ;;
    serve_js) for j in 1 2 4; do
                timeout 100 python3 benchmarks/serve.py "$R/serve_j$j" --clients 32 --join $j --duration 8 > "$R/serve_j$j.txt" 2>&1
                echo "J=$j"; grep -E "^\| 32 " "$R/serve_j$j.txt"; done ;;
    serve_final) timeout 160 python3 benchmarks/serve.py "$R/serve_j2" --clients 8,32 --join 2 --duration 8 > "$R/serve_j2.txt" 2>&1
                 grep -E "^\| (8|32) " "$R/serve_j2.txt"
                 timeout 100 python3 benchmarks/serve.py "$R/serve_j4" --clients 32 --join 4 --duration 8 > "$R/serve_j4.txt" 2>&1
                 grep -E "^\| 32 " "$R/serve_j4.txt"
                 timeout 100 python3 benchmarks/serve.py "$R/serve_j0" --clients 32 --duration 8 > "$R/serve_j0.txt" 2>&1
                 grep -E "^\| 32 " "$R/serve_j0.txt" ;;
    serve_prof) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/spy .whl3/*.whl
                timeout 120 python3 benchmarks/serve.py "$R/prof" --clients 32 --join 2 --duration 10 > "$R/prof.txt" 2>&1 &
                for i in $(seq 1 200); do grep -q "serving on port" "$R/prof.txt" 2>/dev/null && break; sleep 0.5; done
                pid=$(pgrep -f "fusec serve" | head -1); sleep 1
                timeout 30 /tmp/spy/bin/py-spy record -p "$pid" --duration 8 --rate 400 --format raw --threads --idle \
                  --nonblocking -o "$R/spy.txt" > "$R/spy_log.txt" 2>&1
                wait; grep -E "^\| 32 " "$R/prof.txt"; tail -n 3 "$R/spy_log.txt" ;;
    serve_rb) for k in 1 4 1 4; do
                timeout 100 python3 benchmarks/serve.py "$R/serve_rb$k" --clients 32 --join 2 --readback-every $k --duration 8 > "$R/serve_rb$k.txt" 2>&1
                echo "readback every $k"; grep -E "^\| 32 " "$R/serve_rb$k.txt"; done ;;
    serve_join) timeout 160 python3 benchmarks/serve.py "$R/serve_join" --clients 8,32 --join 1 --duration 8 > "$R/serve_join.txt" 2>&1
                grep -E "^\| (8|32) " "$R/serve_join.txt"
                timeout 100 python3 benchmarks/serve.py "$R/serve_nojoin" --clients 32 --duration 8 > "$R/serve_nojoin.txt" 2>&1
                grep -E "^\| 32 " "$R/serve_nojoin.txt" ;;
    stests) timeout 60 $PT -x tests/test_serve_gpu.py > "$R/t_serve.txt" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_serve.txt" | tail -n 6 ;;
    fam_tests) timeout 200 $PT -n 6 tests/test_generation_families_gpu.py tests/test_softcap_generation.py > "$R/t_fam.txt" 2>&1
               grep -E "^(FAILED|ERROR)|passed|failed" "$R/t_fam.txt" | tail -n 12 ;;
    train) timeout 300 python3 benchmarks/train.py "$R/train" --no-compile --skip minilm > "$R/train.txt" 2>&1
           tail -n 30 "$R/train.txt" ;;
    serve) timeout 240 python3 benchmarks/serve.py "$R/serve" --duration 10 > "$R/serve.txt" 2>&1
           tail -n 20 "$R/serve.txt" ;;
    families) timeout 240 python3 benchmarks/families_gpu.py "$R/families.json" --no-window-study > "$R/families.txt" 2>&1
              tail -n 20 "$R/families.txt" ;;
    mlp) timeout 150 python3 benchmarks/mlp_ab.py --out "$R/mlp" > "$R/mlp.txt" 2>&1
         tail -n 20 "$R/mlp.txt" ;;
    sass) timeout 60 python3 benchmarks/sass_check.py "$R/sass" 2>&1 | tail -n 60 ;;
    *) echo "unknown step $step" ;;
  esac
  echo "[$step: $(( $(date +%s) - t0 )) s]"
done
# at most 8 files come back from a device call: everything in one archive (the summaries are in the output above)
if [ -n "$OUT" ]; then
  (cd "$R" && tar czf /tmp/gpu_session.tgz --exclude=gpu_session.tgz . && find . -mindepth 1 -delete && mv /tmp/gpu_session.tgz .)
fi
