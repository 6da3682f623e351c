"""Kernel specs over packed quantized weights (``fusec.quant``): the quantized GEMV of decode
steps and the dequantization a prefill's cuBLAS product reads (``fusec.codegen.build_quant``).

The format is named by ``fmt`` (a ``fusec.quant.FORMATS`` key) and checked here, so a spec holds
only fusec's own names, ints and allow-listed dtypes."""

from __future__ import annotations

import dataclasses

from fusec.codegen.spec_base import FLOATS, SMS, _pos, _req
from fusec.codegen.specs_gemm import Epilogue, check_norm_glu
from fusec.dtypes import DType

QGEMV_MAX_M = 16
QNORM_SMEM = 32 << 10  # the FMA form's normalized copy of x (static shared memory)
# the dp4a form's rows of x: at 3 blocks an SM (85 registers a thread) 4 rows spilled; at 2 (128 registers) up to 8
# rows compile without spills at one weight row a task and 2 chunks a round, without a gated unit (ptxas, sm_80 and
# sm_90, the Llama-1B and 7B shapes; tests/test_quant_kernels.py). The rule (fusec.lower.qgemv_form.gemv_form) takes it
# that far only where the tensor-core form does not apply.
DP4A_MAX_M = 8
DP4A_SMEM = 48 << 10  # static shared memory of a block


def dp4a_smem(m: int, k: int, norm: bool, warps: int = 8) -> int:
    """The dp4a form's shared memory: x's two 8-bit digits (2 * m * k bytes), each chunk's unit and
    sums (12 bytes a chunk a row), and with ``norm`` the warps' sums of squares."""
    return 2 * m * k + 12 * m * (k // 32) + (4 * warps * m if norm else 0)


def dp4a_fits(m: int, k: int, norm: bool, dtype: DType, warps: int = 8) -> bool:
    """Whether the dp4a form takes this product: fp16/bf16 x (its two 8-bit digits per value are an
    approximation that fp32 plans, compared with the reference token for token, do not take), at most
    DP4A_MAX_M rows, its shared memory within DP4A_SMEM."""
    return dtype in (DType.F16, DType.BF16) and m <= DP4A_MAX_M and dp4a_smem(m, k, norm, warps) <= DP4A_SMEM


def dp4a_tasks(n: int, rows: int, glu: bool) -> int:
    """The dp4a form's tasks over an [n, K] weight: ``rows`` weight rows each (gated: rows / 2 pairs j, F + j)."""
    return -(-(n // 2) // (rows // 2)) if glu else -(-n // rows)


def _check_format(fmt: str, n: int, k: int, group: int, scale_dtype: DType) -> None:
    from fusec.quant import FORMATS, SCALE_DTYPES, check_layout

    _req(fmt in FORMATS, f"unknown quantized format {fmt!r}")
    try:
        check_layout(FORMATS[fmt], n, k, group)
    except ValueError as e:
        raise ValueError(str(e)) from None
    _req(scale_dtype in SCALE_DTYPES, f"scales are f16 or f32, got {scale_dtype}")


@dataclasses.dataclass(frozen=True)
class QSibling:
    """A further product of a dp4a quantized GEMV launch (``QGemvSpec.siblings``): the same x (and norm) times
    another packed weight [N, K] in its own format, written to its own output; its tasks run in blocks of their own,
    ``rows`` weight rows a task, ``chunks`` 32-weight chunks a lane a round (the rule's form for it alone)."""

    N: int
    fmt: str
    group: int
    scale_dtype: DType = DType.F16
    rows: int = 2
    chunks: int = 4


@dataclasses.dataclass(frozen=True)
class _QProduct:
    """What every product over a packed weight names: C[M, N] = epilogue(x[M, K] @ W^T), W [N, K] packed in ``fmt``
    (groups of ``group``), its scales of ``scale_dtype``, x and C of ``dtype``."""

    M: int
    N: int
    K: int
    fmt: str
    group: int
    dtype: DType
    scale_dtype: DType = DType.F16
    epilogue: Epilogue = Epilogue()


@dataclasses.dataclass(frozen=True)
class QGemvSpec(_QProduct):
    """C[M, N] = epilogue(x[M, K] @ W^T), W [N, K] packed in ``fmt`` (groups of ``group``).
    ``rows``: output rows per warp (1, 2 or 4); ``fold``: scale each 8 weights' partial dot once
    instead of every weight. ``tc``: the tensor-core form instead (templates/qgemv_tc.cu.jinja: 4- to 8-bit
    formats, M <= 8, fp16/bf16; ``warps`` per block of 16 rows, ``passes`` runs of chunks a warp copies into
    shared memory in turn, ``stages`` commit groups each run's copy is issued in, so that a warp sums a stage's
    chunks while the later stages are still in flight; rows and fold unused). ``dp4a``: integer
    dot products instead (templates/qgemv_dp4a.cu.jinja: x as two 8-bit digits per value, per 32 values, in the block,
    ``fusec.quant.dp4a_blocks``; fp16/bf16 x, M <= DP4A_MAX_M; ``rows`` a warp's task, ``warps`` a block,
    ``blocks`` an SM: the grid, and the registers a thread gets (its launch bounds); ``chunks`` the 32-weight chunks
    a lane loads a round over its rows (2, 4 or 8); ``norm_early`` (the dp4a form with the norm): the norm's weights
    loaded before the PDL wait where x is one batch of a thread's pieces (else after it, beside x); ``cluster``: on
    sm_90, blocks a thread block cluster whose warps take turns writing x's digits, each into every block's shared
    memory (1: every block writes all of them; elsewhere always 1); fold unused).
    FMA and dp4a forms: ``norm``, x RMS-normalized over K first as ``Op.RMSNORM`` computes it (weight ``g``
    [K], ``eps``, ``weight_offset``; the FMA form normalizes x once into shared memory, M * K elements of
    at most ``QNORM_SMEM`` bytes, the dp4a form as it writes x's digits); ``glu``, a gated unit over the two halves of the product (as
    ``GemvSpec.glu``: C[m, j] = glu(y[m, j]) * y[m, F + j], ``glu_swap`` activating the second half,
    Nout = F = N / 2; a warp's two rows are j and F + j, so ``rows`` is 2; the dp4a form's may be 4, two such
    pairs). ``argmax`` (the dp4a form, no gated unit; a sampler reads the product: the LM head): each warp also keeps,
    per x row, the best (score, column) of the outputs it stored, as ``GemvSpec.argmax`` scores them (the stored logit
    for a greedy row, its Gumbel score for a sampled one), and writes it to ``part`` [M][parts][value, index bits]
    (``parts``: one a warp of the grid), which the sampler merges instead of reading the logits.
    Params: x, the packed operands (the format's order), [g], [bias], [residual], C, [seed, counter, temperature,
    part]."""

    rows: int = 2
    fold: bool = True
    tc: bool = False
    warps: int = 8
    passes: int = 1
    stages: int = 1
    dp4a: bool = False
    blocks: int = 2
    chunks: int = 4
    norm_early: bool = False
    cluster: int = 1
    norm: bool = False
    eps: float = 1e-6
    weight_offset: float = 0.0
    glu: str = ""
    glu_swap: bool = False
    argmax: bool = False
    seed_dtype: DType = DType.I64
    counter_dtype: DType = DType.I64
    siblings: tuple[QSibling, ...] = ()

    @property
    def n_out(self) -> int:
        return self.N // 2 if self.glu else self.N

    @property
    def segment_tasks(self) -> tuple[int, ...]:
        """The dp4a form's tasks of the product and of each sibling (``dp4a_tasks``)."""
        return (dp4a_tasks(self.N, self.rows, bool(self.glu)),) + tuple(dp4a_tasks(s.N, s.rows, False)
                                                                         for s in self.siblings)

    @property
    def segment_blocks(self) -> tuple[int, ...]:
        """The dp4a form's blocks of the product and of each sibling. Alone: one wave (``blocks`` an SM) or fewer where
        the tasks are fewer, whole clusters. With siblings: each as many as its tasks need; where together they pass
        one wave, the wave shared in proportion to their weight bytes (at least one block each)."""
        from fusec.quant import FORMATS

        need = [-(-t // self.warps) for t in self.segment_tasks]
        wave = self.blocks * SMS
        if not self.siblings:
            return (max(self.cluster, min(need[0], wave) // self.cluster * self.cluster),)
        if sum(need) <= wave:
            return tuple(need)
        fmts = [(self.N, self.fmt, self.group)] + [(s.N, s.fmt, s.group) for s in self.siblings]
        nbytes = [n * FORMATS[f].bits_per_weight(g) for n, f, g in fmts]
        return tuple(max(1, min(nd, int(wave * b / sum(nbytes)))) for nd, b in zip(need, nbytes))

    @property
    def grid(self) -> int:
        """The dp4a form's blocks: every segment's."""
        return sum(self.segment_blocks)

    @property
    def parts(self) -> int:
        """``argmax``: the (score, column) pairs a row of x gets, one a warp of the grid."""
        return self.grid * self.warps if self.argmax else 0

    @property
    def part_floats(self) -> int:
        return self.M * self.parts * 2

    def __post_init__(self) -> None:
        _pos(("M", self.M), ("N", self.N), ("K", self.K), ("group", self.group))
        _req(self.M <= QGEMV_MAX_M, f"the quantized gemv handles M <= {QGEMV_MAX_M}")
        _req(self.dtype in FLOATS, "the quantized gemv is float")
        _req(self.rows in (1, 2, 4), "rows per warp must be 1, 2 or 4")
        _check_format(self.fmt, self.N, self.K, self.group, self.scale_dtype)
        if self.tc:
            _req(tc_fits(self.M, self.fmt, self.dtype), "the tensor-core quantized gemv takes 4- to 8-bit "
                 f"formats, M <= {QGEMV_MAX_M}, fp16/bf16")
            _req(self.warps in (4, 8, 16), "the tensor-core quantized gemv has 4, 8 or 16 warps")
        _req(self.passes in (1, 2, 3, 4) and (self.passes == 1 or self.tc),
             "passes (1 to 4) are the tensor-core quantized gemv's runs of chunks a warp copies in turn")
        _req(self.stages in (1, 2, 3, 4) and (self.stages == 1 or self.tc),
             "stages (1 to 4) are the tensor-core quantized gemv's commit groups a run's copy is split into")
        if self.dp4a:
            _req(not self.tc, "a quantized gemv has one form: tc or dp4a")
            _req(self.warps == 8, "the dp4a quantized gemv has 8 warps")
            _req(self.blocks in (1, 2, 3, 4) and self.blocks * self.warps <= 32,
                 "the dp4a quantized gemv runs 1 to 4 blocks an SM, at most 32 warps")
            _req(self.chunks in (2, 4, 8), "the dp4a quantized gemv's lanes load 2, 4 or 8 chunks a round")
            _req(dp4a_fits(self.M, self.K, self.norm, self.dtype, self.warps), "the dp4a quantized gemv takes fp16/bf16 x, "
                 f"M <= {DP4A_MAX_M}, and its shared memory (x's two digits) within {DP4A_SMEM} bytes")
        _req(self.cluster in (1, 2, 4) and (self.cluster == 1 or self.dp4a),
             "cluster (1, 2 or 4 blocks splitting the writing of x's digits) is the dp4a quantized gemv's")
        _req(not self.norm_early or (self.dp4a and self.norm),
             "norm_early is the dp4a quantized gemv's, with the norm prologue")
        if self.norm:
            _req(not self.tc, "the quantized gemv's norm prologue is the FMA and dp4a forms'")
        check_norm_glu(self, "quantized gemv")
        if self.norm and not self.dp4a:  # the FMA form's copy of x (the dp4a form writes x's digits instead)
            _req(self.M * self.K * self.dtype.itemsize <= QNORM_SMEM,
                 f"the quantized gemv normalizes x in shared memory: M * K * {self.dtype.itemsize} <= {QNORM_SMEM} bytes")
        if self.siblings:
            _req(self.dp4a and not self.glu and not self.argmax and self.cluster == 1 and self.epilogue == Epilogue(),
                 "a quantized gemv's siblings are the dp4a form's, without a gated unit, argmax partials, clusters or "
                 "an epilogue")
            for sib in self.siblings:
                _req(isinstance(sib, QSibling), "siblings are QSibling records")
                _pos(("sibling N", sib.N), ("sibling group", sib.group))
                _check_format(sib.fmt, sib.N, self.K, sib.group, sib.scale_dtype)
                _req(sib.rows in (1, 2, 4) and sib.chunks in (2, 4, 8), "a sibling's rows (1, 2, 4) and chunks (2, 4, 8)")
        if self.argmax:
            _req(self.dp4a and not self.glu, "the quantized gemv's argmax partials are the dp4a form's, without a "
                 "gated unit")
            _req(self.seed_dtype in (DType.I64, DType.I32) and self.counter_dtype in (DType.I64, DType.I32),
                 "the quantized gemv's sampler state: seed and counter are int32/int64")
        if self.glu:
            _req(self.rows == 2 or (self.dp4a and self.rows == 4),
                 "a gated quantized gemv needs 2 rows a warp (the dp4a form: 2 or 4, one or two gated pairs)")


def tc_fits(m: int, fmt: str, dtype: DType) -> bool:
    """Whether the tensor-core form takes this product: 4- to 8-bit codes (one LOP3 makes a 16-bit
    number of a code; high words OR in bits 4-5; bf16's 8-bit codes take a second operand for bit 7), at
    most QGEMV_MAX_M rows of x (one or two tiles of 8, the mma's n), fp16/bf16 activations (the mma's types)."""
    from fusec.quant import FORMATS

    return FORMATS[fmt].bits in (4, 5, 6, 8) and m <= QGEMV_MAX_M and dtype in (DType.F16, DType.BF16)


QGEMM_MAX_MT = 16  # the dequantize-in-tile GEMM's n8 tiles of x a block (128 rows: 64 accumulators a lane)
QGEMM_SMEM_LIMIT = 227 << 10  # a block's shared memory on sm_90 (sm_80: 163 KB; the rule stays within 100 KB)


def qgemm_smem(mt: int, rw: int, kw: int) -> int:
    """The dequantize-in-tile GEMM's shared memory: x's ring [kw][3][8 mt][72] and the warps' weight tiles
    [rw kw][16][72] of 16-bit values; the partial sums [kw][16 rw][8 mt + 1] of fp32 reuse it."""
    return max((kw * 3 * 8 * mt + rw * kw * 16) * 72 * 2, kw * 16 * rw * (8 * mt + 1) * 4)


@dataclasses.dataclass(frozen=True)
class QGemmSpec(_QProduct):
    """C[M, N] = epilogue(x[M, K] @ W^T) for a prefill, W [N, K] packed in ``fmt``, dequantized in the tile
    (templates/qgemm_tc.cu.jinja): blocks of ``rw`` x ``kw`` warps own 16 ``rw`` weight rows and 8 ``mt`` rows of x,
    warp (rw, kw) the 64-wide k tiles kw, kw + kw_count, ...; ``blocks`` an SM its launch bounds budget registers
    for; the weight's loads run ``depth`` tiles ahead; ``ks`` > 1 (sm_90 only): K is split further over the ``ks``
    blocks of a thread block cluster, which add their sums through distributed shared memory. Each lane dequantizes
    its 32-weight chunk of a tile exactly as QDequantSpec does (the same bits), and mma.m16n8k16 sums it with x in
    fp32. fp16/bf16 x, K a multiple of 64. Params: x, the packed operands (the format's order), [bias], [residual],
    C."""

    mt: int = 8
    rw: int = 4
    kw: int = 1
    blocks: int = 2
    depth: int = 2
    ks: int = 1

    def __post_init__(self) -> None:
        _pos(("M", self.M), ("N", self.N), ("K", self.K), ("group", self.group))
        _req(self.blocks in range(1, 9), "blocks (an SM, the launch bounds' registers) is 1 to 8")
        _req(self.depth in range(1, 7), "depth (tiles the weight loads run ahead) is 1 to 6")
        _req(self.ks in (1, 2, 4, 8), "ks (blocks of a cluster splitting K, sm_90) is 1, 2, 4 or 8")
        _req(self.smem <= QGEMM_SMEM_LIMIT, f"the block's shared memory ({self.smem} bytes: x's ring of 3 tiles of "
             f"8 mt rows a K warp, and the warps' weight tiles) is over {QGEMM_SMEM_LIMIT}")
        _req(self.dtype in (DType.F16, DType.BF16), "the dequantize-in-tile GEMM multiplies fp16/bf16 x (mma)")
        _req(self.K % 64 == 0, "the dequantize-in-tile GEMM takes K a multiple of 64 (its k tiles)")
        _req(self.mt in range(1, QGEMM_MAX_MT + 1), f"mt (n8 tiles of x a block) is 1 to {QGEMM_MAX_MT}")
        _req(self.rw in (1, 2, 4) and self.kw in (1, 2, 4) and self.rw * self.kw <= 8,
             "rw and kw (warps a block over weight rows and over K) are 1, 2 or 4, at most 8 warps")
        _check_format(self.fmt, self.N, self.K, self.group, self.scale_dtype)

    @property
    def smem(self) -> int:
        return qgemm_smem(self.mt, self.rw, self.kw)


@dataclasses.dataclass(frozen=True)
class QDequantSpec:
    """Rows [row0, row0 + rows) of W [N, K] packed in ``fmt`` -> a contiguous [rows, K] matrix of
    ``dtype``; with ``ids`` > 0, rows ids[0 .. ids) instead (QGATHER: an embedding lookup; an id
    outside [-N, N) writes a NaN row, negative ids count from the end). Params: [ids], the packed
    operands (of the whole weight), out."""

    N: int
    K: int
    fmt: str
    group: int
    dtype: DType
    scale_dtype: DType = DType.F16
    row0: int = 0
    rows: int = 0  # 0: all N
    ids: int = 0  # > 0: gather these many rows by index
    id_dtype: DType = DType.I64

    def __post_init__(self) -> None:
        _pos(("N", self.N), ("K", self.K), ("group", self.group))
        _req(self.dtype in FLOATS, "dequantization writes floats")
        _req(isinstance(self.row0, int) and isinstance(self.rows, int) and 0 <= self.row0
             and 0 <= self.rows and self.row0 + (self.rows or self.N) <= self.N, "rows outside the weight")
        _req(isinstance(self.ids, int) and self.ids >= 0 and self.id_dtype in (DType.I32, DType.I64),
             "ids: a count >= 0 of int32/int64 indices")
        _check_format(self.fmt, self.N, self.K, self.group, self.scale_dtype)
