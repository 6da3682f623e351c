"""Builder for the attention template (one launch for all batches and heads)."""

from __future__ import annotations

from fusec.codegen import specs as S
from fusec.codegen.kernels import Rendered, builder, cdiv, kernel_name
from fusec.codegen.render import Ident, ctype, float_lit
from fusec.codegen.spec_base import SMS
from fusec.dtypes import DType


@builder(S.AttentionSpec)
def _attention(spec: S.AttentionSpec) -> Rendered:
    math = spec.math()
    tc = math == "mma16"
    tf32 = math in ("3xtf32", "tf32")
    qs, ks, vs, os_ = spec.strides()
    ctx = {
        "name": kernel_name("attn", spec), "tc": tc, "tf32": tf32, "split": math == "3xtf32",
        "BN": (spec.bn or 64) if tc else 64 if spec.D <= 64 else 32, "D": spec.D, "S": spec.S, "T": spec.T,
        "group": spec.Hq // spec.Hkv, "t": ctype(spec.dtype), "scale": float_lit(spec.scale, "scale"),
        "softcap": float_lit(spec.softcap, "softcap") if spec.softcap else None,
        "causal": spec.causal, "mask": Ident(spec.mask),
        "mask_t": ctype(spec.mask_dtype) if spec.mask_dtype else None, "ms": spec.mask_strides,
        "qs": qs, "ks": ks, "vs": vs, "os": os_, "mask_vec": tc and spec.mask_vec,
        # a mask without a query stride (an encoder's key padding mask): one row a tile, read by every query row
        "mask_keys": tc and spec.mask != "none" and spec.mask_strides[2] == 0,
    }
    rows_per_block = 16 * spec.qwarps if tc else 64 if tf32 else 4
    grid = (cdiv(spec.S, rows_per_block), spec.Hq, spec.B)
    _req_grid(grid)
    params = ("q", "k", "v") + (("mask",) if spec.mask != "none" else ()) + ("out",)
    smem = 0
    if tc:  # Q, then a (K, V) tile pair a stage (two where a block walks more than one tile), then the mask's tiles
        bn = ctx["BN"]
        stages = spec.stages or (2 if cdiv(spec.T, bn) > 1 else 1)
        ctx.update(qw=spec.qwarps, stages=stages)
        smem = 2 * (spec.D + 8) * (rows_per_block + stages * 2 * bn)
        if spec.mask_dtype is not None and spec.mask != "none":
            smem += stages * (1 if ctx["mask_keys"] else rows_per_block) * bn * spec.mask_dtype.itemsize
    return Rendered("attention.cu.jinja", ctx, grid, (128, 1, 1), params, shared_mem=smem)


def query_warps(b: int, hq: int, s: int) -> int:
    """The kernel selection's choice for ``AttentionSpec.qwarps`` at q [b, hq, s, D] (FUSEC_ATTN_QWARPS overrides
    it): two warps a block along the query rows (32 rows a block), two more splitting each key tile, unless those
    blocks would take more than one wave (about four resident a SM): then four (64 rows a block), whose K/V copies
    serve twice the rows. Measured alone (H200, benchmarks/attn_bench.py, RESULTS.md): two was the fastest or within
    0.5 us of it at the Qwen3-0.6B (128 tokens) and Llama-1B (32 tokens) prefill shapes and at GPT-2 small's (batch
    8: 384 blocks; 7.0 us against 7.2 with its mask a row a query); at BERT-base's (batch 32: 1,536 blocks) four took
    12.8 us against 15.4 with its key padding mask, 12.2 against 15.1 unmasked (twenty-second session)."""
    from fusec import knobs

    forced = knobs.forced_count("FUSEC_ATTN_QWARPS")
    return forced if forced is not None else 4 if cdiv(s, 64) * hq * b >= 2 * SMS else 2


def key_tile(d: int, qwarps: int) -> int:
    """The kernel selection's keys a K/V tile (``AttentionSpec.bn``; FUSEC_ATTN_BN overrides it): 32 at four query warps
    and a head dimension past 64, else 64. There the 64-key tile's scores and addresses took 176 registers a thread
    (two 4-warp blocks an SM; the ring's 87 KB of shared memory allowed two as well), 32 keys take 166 and 52 KB
    (three): the 2,048-token Qwen3-0.6B prefill's attention alone took 109.3-109.5 us against 128.1-128.7 (H200,
    attn_bench.py --bn, twenty-ninth session). At two query warps (one wave: occupancy is not what holds it) and at
    D = 64 the 32-key tile lost (Qwen3 128 tokens 4.65 us against 4.20; BERT-base 13.8 against 12.4)."""
    from fusec import knobs

    forced = knobs.forced_count("FUSEC_ATTN_BN")
    return forced if forced is not None else 32 if qwarps == 4 and d > 64 else 64


def _req_grid(grid: tuple[int, int, int]) -> None:
    if grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"attention grid {grid} exceeds the y/z launch limits")


def unsupported(b: int, hq: int, hkv: int, s: int, t: int, d: int, dtype: DType, scale: float = 1.0) -> str:
    """Why the attention kernel cannot take q [b, hq, s, d], k/v [b, hkv, t, d] stored as ``dtype``
    (read contiguously, or through views whose strides are multiples of d), or "" when it can.
    The explicit legality check recognition asks before it makes an ATTENTION node: the spec's
    own rules and the launch grid's, so what recognition accepts the lowering emits."""
    if min(b, hq, hkv, s, t, d) <= 0:
        return "attention over an empty dimension"
    try:
        S.AttentionSpec(b, hq, hkv, s, t, d, dtype, scale)
        _req_grid((1, hq, b))
    except ValueError as e:
        return f"attention kernel: {e}"
    return ""
