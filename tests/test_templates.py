"""Every template renders for each dtype and a few configs, refuses unsafe values, and compiles
with NVRTC for sm_80 and sm_90 (no GPU needed): the specs here and the decode-step specs of
test_decode_kernels go through one parametrized test. Compiles share the test run's cache dir
(conftest.py)."""

from __future__ import annotations

import jinja2
import pytest

from fusec import ops as O
from fusec.codegen import copyspecs as C
from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.codegen.build_topk import TopKSpec
from fusec.codegen.elementwise import Apply, Const, In
from fusec.codegen.render import CCode, Ident, ctype, float_lit, render
from fusec.codegen.specs_quant import QDequantSpec, QGemmSpec, QGemvSpec
from fusec.dtypes import DType
from fusec.lower.tf32_split import Tf32SplitSpec

F16, BF16, F32, I64, I32, BOOL = DType.F16, DType.BF16, DType.F32, DType.I64, DType.I32, DType.BOOL
FLOATS = [F32, F16, BF16]


def _gelu_bias(dt: DType) -> S.ElementwiseSpec:
    e = Apply(O.Op.GELU, (Apply(O.Op.ADD, (In(0), In(1))),), O.GeluAttrs("tanh"))
    return S.elementwise_spec(e, [(4, 6, 24), (24,)], [dt, dt], (4, 6, 24))


def _mlp_spec() -> S.MlpSpec:
    hidden = Apply(O.Op.GELU, (Apply(O.Op.ADD, (In(0), In(1))),), O.GeluAttrs("none"))
    out = Apply(O.Op.ADD, (In(0), In(1)))
    ops = (S.MlpOperand(BF16, "acc"), S.MlpOperand(BF16, "col"))
    return S.MlpSpec(40, 72, 136, 48, BF16, hidden, ops, out, (S.MlpOperand(BF16, "acc"), S.MlpOperand(BF16, "full")),
                     BF16, w1_nk=True)


def _specs(dt: DType) -> list:
    tc_attn = dt if dt != F32 else F32
    return [
        _gelu_bias(dt),
        S.elementwise_spec(Apply(O.Op.WHERE, (In(0), In(1), Const(-1.5, dt))), [(3, 1, 5), (3, 7, 5)], [BOOL, dt], (3, 7, 5)),
        S.ElementwiseSpec(Apply(O.Op.NEG, (In(0),)), (4, 8), (S.Operand(dt, (8, 1)), S.Operand(I64, (0, 1))), dt, 1,
                          ((Apply(O.Op.GREATER, (In(0), Const(0.5, dt))), BOOL), (In(1), I64))),  # multi-output
        S.RowReduceSpec("add_layernorm", 10, 768, dt, w_dtype=dt, has_bias=True),
        S.RowReduceSpec("add_rmsnorm", 3, 1000, dt, w_dtype=dt, eps=1e-6, weight_offset=1.0),
        S.RowReduceSpec("softmax", 2 * 3 * 5, 77, dt, scale=0.125, mask_dtype=dt, rows_shape=(2, 3, 5),
                        mask_row_strides=(77, 0, 0), mask_col_stride=1),
        S.RowReduceSpec("mean", 4, 9, dt, inner=3),
        S.RowReduceSpec("layernorm", 4096, 768, dt, w_dtype=dt, has_bias=True),  # a warp a row: BERT's LayerNorm
        S.RowReduceSpec("add_rmsnorm", 530, 1000, dt, w_dtype=dt, eps=1e-6),  # a warp a row, the last block partial
        S.RowReduceSpec("softmax", 2 * 3 * 89, 77, dt, scale=0.125, mask_dtype=dt, rows_shape=(2, 3, 89),
                        mask_row_strides=(77, 0, 0), mask_col_stride=1),
        S.RowReduceSpec("max", 601, 45, dt), S.RowReduceSpec("prod", 601, 45, dt),
        S.CumsumSpec(3, 7, 2, dt, exclusive=True, reverse=True),
        S.EmbeddingSpec(7, 50, 40, dt, pos_vocab=16, id_dtype=I32),
        S.RopeSpec(2, 3, 5, 64, 32, dt, (960, 320, 64), (960, 320, 64), (0, 32)),
        S.HeadRopeSpec(2, 3, 1, 128, dt, (1152, 128, 384), (3 * 40 * 128, 40 * 128, 128), (128, 0), dt,
                       norm=True, eps=1e-6, w_dtype=dt, cache_len=40),  # q/k norm + RoPE + cache write
        S.AttentionSpec(2, 4, 2, 37, 45, 64, tc_attn, 0.125, causal=True, mask="additive", mask_dtype=dt,
                        mask_strides=(45, 0, 0, 1)),
        S.GemmSpec(70, 90, 40, dt, batch=2, trans_b=True, epilogue=S.Epilogue(bias=True, activation="gelu", residual=True)),
        S.GemvSpec(3, 100, 64, dt, epilogue=S.Epilogue(bias=True, activation="silu")),
        S.GemvSpec(13, 96, 1048, dt, norm=True, eps=1e-6, weight_offset=1.0, glu="silu",
                   epilogue=S.Epilogue(bias=True, residual=True)),  # norm prologue + gated epilogue, K tail
        S.GemvSpec(1, 1000, 64, dt, norm=True, argmax=True), S.GemvSpec(3, 512, 4160, dt, norm=True),  # 2 k groups  # LM head + greedy partials
        S.GemvSpec(1, 1000, 2048, dt, norm=True, argmax=True, stages=4, tiles_per_block=8),  # the ring, LM head
        S.GemvSpec(9, 2 * 300, 4160, dt, norm=True, glu="silu", stages=3, tiles_per_block=2),  # the ring, k groups
        S.GemvSpec(8, 4096, 1024, dt, norm=True, stages=3, tiles_per_block=2, spread=2),  # batch 8's spread
        S.GemvSpec(8, 2 * 300, 3072, dt, norm=True, glu="silu", stages=3, tiles_per_block=1, spread=4),
        *([S.GemvSpec(1, 1000, 64, dt, norm=True, argmax=True, coop_norm=True),  # x normalized once in the block:
           S.GemvSpec(3, 512, 1024, dt, norm=True, stages=3, tiles_per_block=2, coop_norm=True,
                      prewait=1),  # static, dynamic
           S.GemvSpec(16, 2 * 300, 1024, dt, norm=True, glu="silu", stages=3, spread=2, coop_norm=True)]
          if dt in S.HALFS else []),
        C.gather((10, 8), (2, 3), 0, dt, I64),
    ]


def _all_specs() -> list[tuple[str, object]]:
    out = []
    for dt in FLOATS:
        for s in _specs(dt):
            out.append((f"{type(s).__name__}-{dt.value}", s))
    extra = [
        S.RowReduceSpec("sum", 5, 11, I64), S.RowReduceSpec("max", 5, 11, I32, inner=2),
        S.AttentionSpec(1, 8, 1, 1, 300, 128, BF16, 0.088, causal=True),  # MQA decode
        S.AttentionSpec(1, 16, 8, 128, 128, 128, BF16, 0.088, causal=True, qwarps=1),  # Qwen3's prefill: key splits
        S.AttentionSpec(1, 16, 8, 128, 128, 128, BF16, 0.088, mask="additive", mask_dtype=BF16,
                        mask_strides=(16384, 0, 128, 1), qwarps=1, mask_vec=True),  # the generation prefill's mask
        S.AttentionSpec(2, 4, 2, 37, 45, 64, F16, 0.125, mask="bool", mask_dtype=BOOL, mask_strides=(45, 0, 0, 1),
                        qwarps=2),  # two query groups x two key splits, one stage
        S.AttentionSpec(32, 12, 12, 128, 128, 64, F16, 0.125, mask="additive", mask_dtype=F16,
                        mask_strides=(128, 0, 0, 1), mask_vec=True),  # BERT's key padding mask: one row a tile
        S.AttentionSpec(2, 2, 2, 20, 20, 80, F16, 0.1, mask="bool", mask_dtype=BOOL, mask_strides=(400, 0, 20, 1)),
        S.AttentionSpec(1, 2, 2, 9, 9, 32, F16, 0.2),
        S.AttentionSpec(2, 8, 2, 77, 77, 128, F32, 0.088, causal=True, fp32_math="3xtf32"),  # BN 32
        S.AttentionSpec(2, 4, 4, 64, 64, 64, F32, 0.125, fp32_math="tf32"),
        S.AttentionSpec(2, 4, 4, 64, 64, 64, F32, 0.125, fp32_math="simt"),
        S.GemmSpec(64, 128, 64, F16, trans_a=True, b_batch_stride=0, batch=2),
        S.GemmSpec(33, 17, 13, BF16),  # K, N not multiples of 8: element-copy path
        C.transpose((2, 3, 4), (2, 0, 1), I64), C.tile((2, 3), (2, 2), BOOL),
        C.slice_((5, 6), (1,), (5,), (0,), (-2,), F16), *C.concat([(2, 3), (2, 5)], 1, F32),
        C.gather_elements((3, 4), (3, 2), 1, F32, I32), C.gather_nd((2, 3, 4), (2, 1, 2), 1, F32, I64),
        *C.scatter_nd((4, 5), (3, 1), F32, I64), C.trilu((3, 4, 5), True, 1, F16), C.expand((3, 1), (2, 3, 4), F32),
        TopKSpec(3, 500, 2, 8, F16, largest=False), S.RowReduceSpec("prod", 5, 11, I64, inner=2),
        Tf32SplitSpec(7, 36), Tf32SplitSpec(3, 5, vec=1),
        _mlp_spec(),  # a whole MLP in one kernel; GPT-2/BERT shapes and odd sizes in test_mlp
        QGemvSpec(3, 77, 512, "q4_k", 32, BF16, epilogue=S.Epilogue(bias=True, activation="silu", residual=True)),
        QGemvSpec(5, 77, 512, "q6_k", 16, F16, epilogue=S.Epilogue(bias=True), tc=True, warps=4),  # on tensor cores
        QGemvSpec(2, 154, 512, "q4_k", 32, BF16, epilogue=S.Epilogue(residual=True), dp4a=True, norm=True, glu="silu",
                  warps=8, blocks=2),  # integer dot products over x quantized per 32
        QDequantSpec(77, 512, "q6_k", 16, F16, row0=16, rows=40),  # more formats: tests/test_quant_kernels.py
        QGemmSpec(40, 77, 512, "q4_k", 32, BF16, epilogue=S.Epilogue(residual=True), mt=5, rw=2, kw=2),  # prefill
    ]
    out += [(f"{type(s).__name__}-extra{i}", s) for i, s in enumerate(extra)]
    return out


ALL = _all_specs()


def _cases() -> list[tuple[str, object, str]]:
    """(label, spec, arch): every spec here and every decode-step spec for sm_90; for sm_80 (A100)
    one config per template here (the PTX features used, cp.async, ldmatrix, mma.sync and
    cvt.rn.bf16, all exist there) and every decode-step spec but those merging through a thread
    block cluster (sm_90 only)."""
    from test_decode_kernels import decode_specs

    decode = decode_specs()
    sm80 = [(a, s) for a, s in ALL if a.endswith("-bf16") or a.endswith("extra0")]
    return [(a, s, "sm_90") for a, s in ALL + decode] + [(a, s, "sm_80") for a, s in sm80 + decode
                                                          if not getattr(s, "cluster", False)]  # clusters: sm_90


CASES = _cases()


@pytest.mark.parametrize("label,spec,arch", CASES, ids=[f"{a}-{arch}" for a, _, arch in CASES])
def test_renders_and_compiles(label: str, spec: object, arch: str) -> None:
    ck = K.build(spec, arch)
    assert ck.cubin[:4] == b"\x7fELF" and len(ck.cubin) > 1000
    assert arch in ck.binary.log
    assert "__launch_bounds__" in ck.source and ck.name in ck.source
    # prefill attention may spill a little (its tiles are sized for registers on the widest head)
    assert ck.binary.spill_bytes == 0 or "AttentionSpec" in label, ck.binary.log
    assert ck.binary.static_smem <= 48 * 1024
    assert all(1 <= x for x in ck.grid + ck.block) and ck.block[0] <= 1024
    assert ck.grid[1] <= 65535 and ck.grid[2] <= 65535


def test_each_template_is_covered() -> None:
    from pathlib import Path

    import fusec.templates as t

    files = {p.name for p in Path(t.__file__).parent.glob("*.cu.jinja")}
    used = {K.prepare(s)[0].template for _, s in ALL}
    from test_decode_kernels import decode_specs  # the decode-step templates are compiled there

    used |= {K.prepare(s)[0].template for _, s in decode_specs()}
    from test_train_kernels import SPECS as train_specs  # the training kernels are compiled there

    used |= {K.prepare(s)[0].template for s in train_specs}
    assert files == used


def test_vectorization_chosen_at_render_time() -> None:
    assert _gelu_bias(F16).vec == 8 and _gelu_bias(F32).vec == 4
    odd = S.elementwise_spec(Apply(O.Op.ADD, (In(0), In(1))), [(5, 7), (7,)], [F16, F16], (5, 7))
    assert odd.vec == 1
    src = K.prepare(_gelu_bias(F16))[1]
    assert "fc_vec<fc_half, 8>" in src


def test_broadcast_dims_are_merged() -> None:
    sp = S.elementwise_spec(Apply(O.Op.ADD, (In(0), In(1))), [(2, 3, 4, 5), (4, 5)], [F32, F32], (2, 3, 4, 5))
    assert sp.shape == (6, 20)
    assert sp.inputs[1].strides == (0, 1)


def test_rejects_non_identifiers_and_plain_strings() -> None:
    for bad in ["1abc", "a-b", "x;system()", "", "a" * 65, 'a"', "名前"]:
        with pytest.raises(ValueError):
            Ident(bad)
    with pytest.raises(TypeError, match="templates take only"):
        render("copy.cu.jinja", name="evil(); //")  # a plain str never reaches a template
    with pytest.raises(TypeError):
        render("copy.cu.jinja", name=Ident("k"), t=3.5)  # floats must go through float_lit


def test_rejects_dtypes_outside_the_allow_list() -> None:
    with pytest.raises(ValueError):
        ctype("float")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        S.AttentionSpec(1, 1, 1, 4, 4, 64, I64, 0.1)
    with pytest.raises(ValueError):
        S.RowReduceSpec("layernorm", 2, 8, BOOL, w_dtype=F32)


def test_strict_undefined_catches_missing_variables() -> None:
    with pytest.raises(jinja2.UndefinedError):
        render("embedding.cu.jinja", name=Ident("k"), t=ctype(F16))


def test_float_literals_are_checked() -> None:
    assert float_lit(1e-5) == "1e-05f" and float_lit(2) == "2.0f"
    for bad in [float("nan"), float("inf"), 1e39]:
        with pytest.raises(ValueError):
            float_lit(bad)
    with pytest.raises(ValueError):
        S.RowReduceSpec("layernorm", 2, 8, F16, w_dtype=F16, eps=float("nan"))


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="multiple of Hkv"):
        S.AttentionSpec(1, 6, 4, 8, 8, 64, F16, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        S.AttentionSpec(1, 2, 2, 8, 8, 72, F16, 0.1)
    with pytest.raises(ValueError, match="M <= 16"):
        S.GemvSpec(17, 8, 8, F16)
    with pytest.raises(ValueError, match="multiple of 8"):
        S.GemvSpec(1, 8, 12, F16)
    with pytest.raises(ValueError, match="own activation"):
        S.GemvSpec(1, 8, 16, F16, glu="silu", epilogue=S.Epilogue(activation="relu"))
    with pytest.raises(ValueError, match="stages must be"):
        S.GemvSpec(1, 8, 16, F16, stages=1)
    with pytest.raises(ValueError, match="need the ring"):
        S.GemvSpec(1, 8, 16, F16, tiles_per_block=2)
    with pytest.raises(ValueError, match="activation"):
        S.Epilogue(activation="swish; x")
    with pytest.raises(ValueError, match="out_dtype"):
        S.ElementwiseSpec(In(0), (4,), (S.Operand(F16, (1,)),), F32)
    with pytest.raises(ValueError, match="`more` output"):
        S.ElementwiseSpec(In(0), (4,), (S.Operand(F16, (1,)),), F16, more=((In(0), F32),))


def test_code_emitted_from_the_op_table_only() -> None:
    # CCode is produced by fusec's tables; node names never appear in source
    spec = _gelu_bias(BF16)
    _, src = K.prepare(spec)
    assert "fc_gelu_tanh" in src and "fc_round_bf16" in src
    with pytest.raises(TypeError):
        render("copy.cu.jinja", name=Ident("k"), t=ctype(F16), block=[CCode("ok"), "not ok"])


def test_attention_math_variant_choice() -> None:
    """fp32 attention runs on tf32 tensor cores split into big + small parts unless told otherwise
    (or head_dim > 128, where the fragments no longer fit in registers); halfs use mma.sync."""
    assert S.AttentionSpec(1, 2, 2, 8, 8, 64, F32, 0.1).math() == "3xtf32"
    assert S.AttentionSpec(1, 2, 2, 8, 8, 160, F32, 0.1).math() == "simt"
    assert S.AttentionSpec(1, 2, 2, 8, 8, 64, F32, 0.1, fp32_math="tf32").math() == "tf32"
    assert S.AttentionSpec(1, 2, 2, 8, 8, 64, F16, 0.1).math() == "mma16"
    with pytest.raises(ValueError, match="tf32 attention"):
        S.AttentionSpec(1, 2, 2, 8, 8, 64, F16, 0.1, fp32_math="3xtf32")
    with pytest.raises(ValueError, match="tf32 attention"):
        S.AttentionSpec(1, 2, 2, 8, 8, 160, F32, 0.1, fp32_math="tf32")
    srcs = {m: K.build(S.AttentionSpec(1, 2, 2, 8, 8, 64, F32, 0.1, fp32_math=m), "sm_90").source
            for m in ("3xtf32", "tf32", "simt")}
    assert srcs["3xtf32"].count("fc_mma1688(c,") == 3 and srcs["tf32"].count("fc_mma1688(c,") == 1
    assert "fc_mma1688" not in srcs["simt"]


def test_every_template_waits_in_kernel_so_every_launch_may_overlap() -> None:
    """Each kernel waits for the one before it in-kernel (PDL), the decode product too (its wait
    pinned below its weight loads): a template that did not would be launched plainly."""
    for label, spec in _all_specs():
        assert K.prepare(spec)[0] is not None
        assert K.waits_in_kernel(K.prepare(spec)[1]), label


@pytest.mark.parametrize("rows,cols,warp", [(4096, 768, True), (528, 2048, True), (527, 768, False),
                                            (4096, 2056, False), (128, 1024, False)])
def test_short_rows_take_a_warp_each(rows: int, cols: int, warp: bool) -> None:
    """The row kernel's two forms: a warp a row (four rows a block) where a row is at most 8 vectors a lane and the
    rows give every SM a block; else a block a row. The grid and block follow."""
    r, src = K.prepare(S.RowReduceSpec("layernorm", rows, cols, F16, w_dtype=F16, has_bias=True))
    if warp:
        assert r.block == (128, 1, 1) and r.grid == (-(-rows // 4), 1, 1) and "#define RPB 4 " in src
    else:
        assert r.grid == (rows, 1, 1) and "#define RPB 1 " in src
