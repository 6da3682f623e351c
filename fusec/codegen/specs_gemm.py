"""The matrix products' specs (``fusec.codegen.specs`` re-exports them: ``S.GemmSpec``, ``S.GemvSpec``):
the epilogue applied to an fp32 accumulator, fusec's GEMM (``build_gemm``; its stream and wgmma forms for
few rows), and the skinny product of decode (M <= 16) with its weight-streaming geometry."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fusec.codegen.spec_base import FLOATS, HALFS, _ints, _pos, _req
from fusec.dtypes import DType

ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """Applied to the fp32 accumulator before the store: + bias[n], activation, + residual[m, n]."""

    bias: bool = False
    activation: str = "none"
    residual: bool = False

    def __post_init__(self) -> None:
        _req(self.activation in ACTIVATIONS, f"activation must be one of {ACTIVATIONS}")


GEMM_STREAM_MAX_M = 128  # rows of A the stream form takes (a block holds them all)
GEMM_STREAM_BK = 64  # its K slices


@dataclasses.dataclass(frozen=True)
class GemmSpec:
    """C[b] = epilogue(A[b] @ B[b]); A [M, K] (or [K, M] if trans_a), B [K, N] (or [N, K] if trans_b).

    Operands are row-major with the given batch strides (0 broadcasts); C is [batch, M, N]
    contiguous. Params: A, B, [bias (N)], [residual (batch, M, N)], C.
    """

    M: int
    N: int
    K: int
    dtype: DType
    batch: int = 1
    trans_a: bool = False
    trans_b: bool = False
    a_batch_stride: int = -1  # -1: contiguous
    b_batch_stride: int = -1
    epilogue: Epilogue = Epilogue()
    out_dtype: DType | None = None
    splits: int = 1  # the stream (or wgmma) form's K split over a thread-block cluster (sm_90): 1, 2, 4 or 8 blocks
    # sm_90: the stream form's blocking with the products on wgmma (gemm_wgmma.jinja); B [N, K] (trans_b)
    wgmma: bool = False
    # the wgmma form's columns a block (32, 64 or 128; kernel selection's ``build_gemm.wgmma_tiling``), 0: that rule's
    bn: int = 0
    # the wgmma form's gated epilogue (a SwiGLU after a gate/up product): B's rows [0, F) and [F, 2F) (F = N / 2) are
    # the unit's halves, C [M, F] = act(y[:, j]) * y[:, F + j] (``glu_swap``: the second half activated), each step
    # rounded as the unfused nodes store it
    glu: str = ""
    glu_swap: bool = False
    # the wgmma form's B copies carry an L2 evict-first policy (each byte read once a launch; kernel selection's
    # ``select_kernels._gemm_params``)
    l2_evict_first: bool = False

    def __post_init__(self) -> None:
        _pos(("M", self.M), ("N", self.N), ("K", self.K), ("batch", self.batch))
        _req(not self.l2_evict_first or self.wgmma, "gemm l2_evict_first is the wgmma form's (its B copies)")
        _req(self.dtype in FLOATS and (self.out_dtype or self.dtype) in FLOATS, "gemm is float")
        _ints((self.a_batch_stride, self.b_batch_stride), "batch strides", -1)
        _req(self.splits in (1, 2, 4, 8), f"gemm splits must be 1, 2, 4 or 8, got {self.splits}")
        _req(not self.wgmma or (self._few_rows and self.trans_b),
             "the wgmma form takes fp16/bf16, one batch, A [M, K] with M <= 128, B [N, K] (trans_b), K a multiple of "
             "64 and N of 8")
        _req(self.bn in (0, 32, 64, 128) and (self.bn == 0 or self.wgmma),
             f"gemm bn (the wgmma form's columns a block) must be 32, 64 or 128, got {self.bn}")
        _req(self.glu in ("",) + GLU_ACTS and (self.glu or not self.glu_swap),
             f"gemm glu must be one of {GLU_ACTS} or empty (glu_swap with it)")
        # (the wgmma form's N, a multiple of 8, splits into halves of a multiple of 4: its 4-column stores)
        _req(not self.glu or (self.wgmma and self.epilogue == Epilogue()),
             "a gated gemm is the wgmma form's, with no other epilogue")
        _req(self.splits == 1 or ((self.stream or self.wgmma) and self.K % (GEMM_STREAM_BK * self.splits) == 0),
             "a K split needs the stream form (fp16/bf16, one batch, A and B not transposed, M <= 128, K a multiple "
             "of 64, N of 8) or the wgmma form, and K a multiple of 64 x splits")

    @property
    def _few_rows(self) -> bool:
        """What the stream and wgmma forms take: fp16/bf16, one batch, A [M, K] with M <= 128, K whole 64-slices, N a
        multiple of 8 (they differ in B's layout)."""
        return (self.dtype in HALFS and self.batch == 1 and not self.trans_a and self.M <= GEMM_STREAM_MAX_M
                and self.K % GEMM_STREAM_BK == 0 and self.N % 8 == 0)

    @property
    def stream(self) -> bool:
        """The stream form (gemm_stream.jinja): few rows of A against a weight [K, N] streamed once."""
        return self._few_rows and not self.trans_b

    @property
    def a_bs(self) -> int:
        return self.M * self.K if self.a_batch_stride < 0 else self.a_batch_stride

    @property
    def b_bs(self) -> int:
        return self.K * self.N if self.b_batch_stride < 0 else self.b_batch_stride


GLU_ACTS = ("silu", "gelu", "gelu_tanh", "relu")
GEMV_MAX_M = 16
GEMV_MAX_STAGES = 4  # 4 stages of the largest (33 KB) fit the 163 KB of shared memory an sm_80 block may have
GEMV_SPREADS = (1, 2, 4)


def gemv_geometry(K: int, dtype: DType, spread: int = 1) -> tuple[int, int, int, int]:
    """The skinny product's block shape for a row length K: (warps, chunks a lane holds per k
    group, k groups, 64-wide k chunks). A k group spans at most 8 warps x 4 chunks (fp32: 2) of 64;
    ``spread`` s > 1 spreads it over up to s times the warps, each lane holding 1/s of the chunks
    (at least 1): more warps, each with a shorter chain of loads and products."""
    nch = -(-K // 64)  # 64-wide k chunks
    cmax = 4 if dtype in HALFS else 2  # chunks a lane holds per k group: 64 (fp32 128) bytes, x 2 buffers
    kg = -(-nch // (8 * cmax))  # k groups of at most 8 warps
    lane = max(1, cmax // spread)
    warps = max(4, -(-nch // (lane * kg)))  # >= 4: the epilogue takes one thread per output of a tile
    return warps, -(-nch // (warps * kg)), kg, nch


def gemv_group(K: int, dtype: DType, spread: int = 1) -> int:
    """Elements of K one k group of the skinny product covers (the ring's stage of a weight row)."""
    warps, ch, _, _ = gemv_geometry(K, dtype, spread)
    return warps * ch * 64


def check_norm_glu(spec: Any, what: str) -> None:
    """The norm prologue's and the gated epilogue's fields of a skinny product's spec (``GemvSpec``,
    ``QGemvSpec``): eps, weight_offset, glu, N and the epilogue's activation."""
    _req(math.isfinite(spec.eps) and spec.eps >= 0 and math.isfinite(spec.weight_offset),
         f"{what} norm: eps must be finite and >= 0, weight_offset finite")
    _req(spec.glu in ("",) + GLU_ACTS, f"{what} glu must be one of {GLU_ACTS} or empty")
    if spec.glu:
        _req(spec.N % 2 == 0, f"a gated {what} needs an even number of weight rows")
        _req(spec.epilogue.activation == "none", f"a gated {what} applies its own activation")


@dataclasses.dataclass(frozen=True)
class GemvSpec:
    """Skinny product for M <= 16 (decode): C[M, Nout] = epilogue(xn[M, K] @ W^T), W stored [N, K]
    (k contiguous: the layout decode reads). fp16/bf16 run on tensor cores, fp32 on FMA.

    ``norm``: xn is x RMS-normalized over K as ``Op.RMSNORM`` computes it (weight ``g`` [K], ``eps``,
    ``weight_offset``; rounded to the storage dtype as the unfused node stores it); else xn = x.
    ``glu``: a gated unit over the two halves of the product (F = N / 2 weight rows each):
    C[m, j] = glu(y[m, j]) * y[m, F + j] (``glu_swap``: the second half is activated), Nout = F;
    the epilogue's bias covers all N rows, its activation must be "none". ``argmax``: the kernel also
    writes each tile's best (score, column) per row to ``part`` (``part_floats`` fp32 words:
    [M][tiles][value, index bits]), score = the stored output for a greedy row (temperature 0), its
    Gumbel score (fusec/sampling.py, from the row's seed and counter) for a sampled one: what
    ``SampleSpec`` merges instead of reading C (params seed, counter, temperature after C).
    A tile is 8 weight rows (4 rows of each half for ``glu``). ``stages`` 0: one block per tile, its
    weights read through two register buffers; ``stages`` S >= 2: a block computes up to
    ``tiles_per_block`` tiles, streaming their weights through an S-stage shared-memory ring
    (cp.async; S - 1 stages in flight). ``spread``: a k group over more warps (``gemv_geometry``).
    ``bulk``: the ring's copies are TMA bulk copies from one thread, one per weight row and stage,
    completing on an mbarrier (on sm_90 and later; older archs compile the cp.async form); K must be a
    multiple of the k group (a row's part of a stage is then contiguous).
    ``coop_norm``: the block normalizes x once (``norm``; half dtypes, one k group: x's rows whole in the
    block) into shared memory, rather than in the lanes' fragments or tile by tile; kernel selection
    decides it (``build_gemm.gemv_form``, rule ``gemv_coop_norm``).
    Params: x, W, [g], [bias], [residual], C,
    [seed, counter, temperature, part]."""

    M: int
    N: int
    K: int
    dtype: DType
    epilogue: Epilogue = Epilogue()
    norm: bool = False
    eps: float = 1e-6
    weight_offset: float = 0.0
    glu: str = ""
    glu_swap: bool = False
    argmax: bool = False
    seed_dtype: DType = DType.I64
    counter_dtype: DType = DType.I64
    stages: int = 0
    tiles_per_block: int = 1
    spread: int = 1
    bulk: bool = False
    coop_norm: bool = False
    prewait: int = 0  # ring stages issued before the PDL wait (build_gemm.gemv_prewait); 0: all S - 1
    l2_evict_first: bool = False  # the ring's copies carry an L2 evict-first policy (build_gemm.gemv_form)

    def __post_init__(self) -> None:
        _pos(("M", self.M), ("N", self.N), ("K", self.K), ("tiles_per_block", self.tiles_per_block))
        _req(isinstance(self.prewait, int) and 0 <= self.prewait <= max(0, self.stages - 1),
             f"gemv prewait must be 0 (all S - 1) or 1..S - 1 ring stages, got {self.prewait} "
             f"with stages {self.stages}")
        if self.coop_norm:
            _req(self.norm and self.dtype in HALFS and gemv_geometry(self.K, self.dtype, self.spread)[2] == 1,
                 "gemv coop_norm normalizes x in the block: it needs the norm prologue, fp16/bf16 and one k group "
                 f"(K {self.K} spread {self.spread} has {gemv_geometry(self.K, self.dtype, self.spread)[2]})")
        _req(not self.l2_evict_first or self.stages > 0, "gemv l2_evict_first is a policy of the ring's copies "
             "(stages >= 2)")
        if self.bulk:
            _req(self.stages > 0, "gemv bulk copies fill the shared-memory ring (stages >= 2)")
            _req(self.K % gemv_group(self.K, self.dtype, self.spread) == 0,
                 f"gemv bulk copies need K a multiple of the k group ({gemv_group(self.K, self.dtype, self.spread)})")
        _req(self.spread in GEMV_SPREADS, f"gemv spread must be one of {GEMV_SPREADS}")
        _req(gemv_geometry(self.K, self.dtype, self.spread)[0] <= 32,
             f"gemv spread {self.spread} over K {self.K} needs more than 32 warps a block")
        _req(self.M <= GEMV_MAX_M, f"gemv handles M <= {GEMV_MAX_M}")
        _req(self.stages == 0 or 2 <= self.stages <= GEMV_MAX_STAGES,
             f"gemv stages must be 0 (register buffers) or 2..{GEMV_MAX_STAGES} (a shared-memory ring)")
        _req(self.stages > 0 or self.tiles_per_block == 1, "gemv: several tiles per block need the ring (stages >= 2)")
        _req(self.dtype in FLOATS, "gemv is float")
        _req(self.K % (16 // self.dtype.itemsize) == 0, "gemv reads 16-byte slices of each weight row: K must be "
             f"a multiple of {16 // self.dtype.itemsize} for {self.dtype.value}")
        check_norm_glu(self, "gemv")

    @property
    def n_out(self) -> int:
        return self.N // 2 if self.glu else self.N

    @property
    def tiles(self) -> int:
        return -(-self.n_out // 4) if self.glu else -(-self.N // 8)

    @property
    def grid(self) -> int:
        return -(-self.tiles // self.tiles_per_block)

    @property
    def part_floats(self) -> int:
        """One (score, column) pair per row and tile."""
        return self.M * self.tiles * 2 if self.argmax else 0
