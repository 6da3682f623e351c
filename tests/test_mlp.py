"""The fused MLP on the CPU (``fusec.lower.mlp``, ``templates/mlp.cu.jinja``): the capability query
accepts GPT-2's and BERT's MLPs and declines, with a reason, what the kernel cannot do; the fused
node's reference equals the unfused graph; gpt2-small's MLPs are legal, off-by-default candidates
that ``--enable-fusion mlp`` applies as one launch each; the kernel renders and compiles with
NVRTC for sm_80 and sm_90 at GPT-2 small's and BERT-base's shapes and at odd sizes."""

from __future__ import annotations

import numpy as np
import pytest

import fusec
from fusec import reference
from fusec.builder import GraphBuilder
from fusec.codegen import kernels as K
from fusec.codegen.specs_mlp import MLP_SMEM
from fusec.dtypes import DType
from fusec.inputs import random_inputs
from fusec.loader import load_graph
from fusec.lower import mlp
from fusec.lower.fused_plan import can_fuse
from fusec.ops import Op
from fusec.passes.base import PassOptions
from fusec.passes.pipeline import optimize

from mlp_graphs import body_of, mlp_graph

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
pytestmark = pytest.mark.usefixtures("module_cache_dir")


# ---- the capability query ----------------------------------------------------------------------

@pytest.mark.parametrize("dt,lead,k,f,n,act,nk", [
    (F16, (8, 128), 768, 3072, 768, "gelu_tanh", False),  # GPT-2 small, b8 s128 (Conv1D weights: [K, F])
    (F16, (32, 128), 768, 3072, 768, "gelu", True),  # BERT-base, b32 s128 (nn.Linear weights read [N, K])
    (BF16, (1, 1), 64, 256, 64, "quick_gelu", False),  # one row; an activation spelled as a chain of ops
    (F16, (77,), 72, 200, 40, "silu", True),
])
def test_capability_accepts_mlps(dt: DType, lead: tuple[int, ...], k: int, f: int, n: int, act: str, nk: bool) -> None:
    body = body_of(mlp_graph(dt, lead, k, f, n, act=act, w1_nk=nk, w2_nk=nk)).body
    cap = can_fuse(body)
    assert cap.kernel == "mlp", cap.reason
    p = mlp.plan(body)
    spec = p.spec()
    assert (spec.M, spec.K, spec.F, spec.N) == (int(np.prod(lead)), k, f, n) and (spec.w1_nk, spec.w2_nk) == (nk, nk)
    assert [o.kind for o in p.hidden_operands].count("acc") == 1 and "col" in [o.kind for o in p.hidden_operands]
    kinds = sorted(o.kind for o in p.out_operands)  # product, bias, residual (one row: a residual is a vector)
    assert kinds == (["acc", "col", "full"] if spec.M > 1 else ["acc", "col", "col"])
    assert spec.tiles is not None and spec.tiles.smem <= MLP_SMEM


def _declined(g) -> str:  # type: ignore[no-untyped-def]
    cap = can_fuse(body_of(g).body)
    assert not cap and cap.kernel is None
    return cap.reason


def test_capability_declines_with_reasons() -> None:
    assert "fp16/bf16" in _declined(mlp_graph(F32, (4,), 64, 128, 64))
    assert "K = 68 is not a multiple of 8" in _declined(mlp_graph(F16, (4,), 68, 128, 64))
    assert "F = 100 is not a multiple of 8" in _declined(mlp_graph(F16, (4,), 64, 100, 64))
    assert "does not fit" in _declined(mlp_graph(F16, (4,), 8192, 64, 64, bias=False, residual=False))

    def custom(hidden, w1_const: bool = True):  # type: ignore[no-untyped-def]
        rng = np.random.default_rng(1)
        b = GraphBuilder("custom")
        x = b.input("x", (64, 64), F16)  # square: the hidden tile may be read transposed
        w1 = b.const(rng.standard_normal((64, 64)), name="w1", dtype=F16) if w1_const else b.input("w1", (64, 64), F16)
        h = hidden(b, b.emit(Op.MATMUL, x, w1))
        b.output(b.emit(Op.MATMUL, h, b.const(rng.standard_normal((64, 32)), name="w2", dtype=F16)), "y")
        return b.build()

    assert "constant" in _declined(custom(lambda b, t: b.emit(Op.RELU, t), w1_const=False))
    assert "softmax" in _declined(custom(lambda b, t: b.emit(Op.SOFTMAX, t, axis=1)))
    # the hidden tile read transposed: not elementwise on the tile the block computes
    assert "not transpose" in _declined(custom(lambda b, t: b.emit(Op.RELU, b.emit(Op.TRANSPOSE, t, perm=(1, 0)))))
    # a per-row operand ([M, 1]): the kernel indexes vectors over the columns only
    rows = np.ones((64, 1), np.float16)
    assert "neither a scalar" in _declined(custom(lambda b, t: b.emit(Op.MUL, t, b.const(rows, name="rows", dtype=F16))))
    # no activation between the products: nothing for one kernel to keep on chip but a plain product
    assert "activation between" in _declined(custom(lambda b, t: t))


def test_gated_mlp_is_declined_with_its_reason() -> None:
    """Llama's gated MLP (a merged gate/up product, sliced, SiLU, multiplied) is no elementwise
    activation of one hidden tile: recorded illegal with the codegen's reason."""
    g = load_graph("llama-tiny", None)
    out, _ = optimize(g, PassOptions(storage_dtype="f16", enabled_fusions=frozenset({"mlp"})))
    recs = [r for r in out.meta["fusions"] if r["rule"] == "mlp"]
    assert recs and all(not r["legal"] and r["decision"] == "rejected" and "gated unit" in r["reason"] for r in recs)
    assert not any(n.op == Op.FUSED and n.attrs.rule == "mlp" for n in out.nodes)


# ---- fusion records and the plan ----------------------------------------------------------------

def test_fused_reference_equals_the_unfused_graph() -> None:
    g = load_graph("gpt2-tiny", None)
    off, _ = optimize(g, PassOptions(storage_dtype="f16"))
    on, _ = optimize(g, PassOptions(storage_dtype="f16", enabled_fusions=frozenset({"mlp"})))
    fused = [n for n in on.nodes if n.op == Op.FUSED and n.attrs.rule == "mlp"]
    assert len(fused) == 2 and all([m.op for m in n.attrs.body.nodes].count(Op.MATMUL) == 2 for n in fused)
    assert all(n.kernel is not None and n.kernel.family == "mlp" for n in fused)  # select_kernels' record
    feeds = random_inputs(g, 20261123)
    a, b = reference.run(off, feeds), reference.run(on, feeds)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_hf_gpt2_export_reads_through_its_reshapes() -> None:
    """HF GPT-2's exported MLP flattens rows around each product ([B, S, F] <-> [B*S, F] reshapes
    inside the candidate): they keep the flat order and the last dimension, so the body is still
    one kernel; enabled, the fused graph's reference equals the unfused one."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_models

    path, inputs, _ = hf_models.export_hf("gpt2", "legacy")
    g = load_graph(path, {k: v.shape for k, v in inputs.items()})
    off, _ = optimize(g, PassOptions(storage_dtype="f16"))
    on, _ = optimize(g, PassOptions(storage_dtype="f16", enabled_fusions=frozenset({"mlp"})))
    fused = [n for n in on.nodes if n.op == Op.FUSED and n.attrs.rule == "mlp"]
    assert len(fused) == 2 and all(Op.RESHAPE in [m.op for m in n.attrs.body.nodes] for n in fused)
    a, b = reference.run(off, inputs), reference.run(on, inputs)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_gpt2_small_mlps_are_legal_candidates() -> None:
    from fusec.ab.regions import pre_fusion
    from fusec.passes import fusion

    pre = pre_fusion(load_graph("gpt2-small", None), "f16")
    recs = [r for r in fusion.records(fusion.run(pre, PassOptions(storage_dtype="f16")).graph) if r.rule == "mlp"]
    assert len(recs) == 12
    for r in recs:
        assert r.legal and r.decision == "candidate" and r.reason.startswith("off by default"), r
        assert len(r.members) == 6  # matmul, bias, gelu, matmul, bias, residual


def test_enable_fusion_mlp_makes_one_launch_per_mlp(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fusec.cli import main
    from fusec.plan import Plan

    default = fusec.compile("gpt2-tiny", dtype="fp16", arch="sm_90")
    assert main(["-q", "compile", "gpt2-tiny", "--dtype", "fp16", "--arch", "sm_80", "--enable-fusion", "mlp",
                 "-o", str(tmp_path / "p.fplan")]) == 0
    on = Plan.open(tmp_path / "p.fplan")
    labels = [L["label"] for L in on.manifest["launches"]]
    assert sum(1 for x in labels if x.endswith(" mlp")) == 2
    assert not any(x.endswith(" mlp") for x in (L["label"] for L in default.manifest["launches"]))
    assert len(labels) == len(default.manifest["launches"]) - 2  # two products' launches become one, per layer
    recs = [r for r in on.manifest["report"]["fusions"] if r["rule"] == "mlp"]
    assert len(recs) == 2 and all(r["decision"] == "applied" and r["reason"] == "enabled by option" for r in recs)


# ---- the kernel compiles -------------------------------------------------------------------------

def _spec(dt: DType, lead: tuple[int, ...], k: int, f: int, n: int, act: str = "gelu_tanh", nk: tuple[bool, bool] = (False, False),
          x_vec: bool = True, **kw: bool):  # type: ignore[no-untyped-def]
    g = mlp_graph(dt, lead, k, f, n, act=act, w1_nk=nk[0], w2_nk=nk[1], **kw)
    return mlp.plan(body_of(g).body).spec(x_vec=x_vec)


SPECS = [
    ("gpt2-small-f16", _spec(F16, (8, 128), 768, 3072, 768)),
    ("gpt2-small-bf16", _spec(BF16, (8, 128), 768, 3072, 768)),
    ("bert-base-f16", _spec(F16, (32, 128), 768, 3072, 768, act="gelu", nk=(True, True))),
    ("odd-nk-unaligned-x", _spec(F16, (77,), 72, 200, 40, act="silu", nk=(True, True), x_vec=False)),
    ("odd-mixed-bf16", _spec(BF16, (3, 11), 136, 328, 104, act="quick_gelu", nk=(False, True), residual=False)),
    ("decode-row-relu", _spec(F16, (1,), 64, 256, 64, act="relu", nk=(True, False), bias=False)),
]


@pytest.mark.parametrize("label,spec", SPECS, ids=[a for a, _ in SPECS])
def test_kernel_compiles_sm90(label: str, spec) -> None:  # type: ignore[no-untyped-def]
    ck = K.build(spec, "sm_90")
    assert ck.cubin[:4] == b"\x7fELF" and ck.binary.spill_bytes == 0, ck.binary.log
    assert ck.block == (256, 1, 1) and 0 < ck.shared_mem <= MLP_SMEM and ck.pdl
    t = spec.tiles
    assert ck.grid == (-(-spec.N // t.bn), -(-spec.M // t.bm), 1)
    assert ck.params[:3] == ("x", "W1", "W2") and ck.params[-1] == "out"
    assert ("fc_cp_async16(xs" in ck.source) == spec.x_vec


SM80 = [s for s in SPECS if s[0] in ("gpt2-small-bf16", "bert-base-f16", "odd-nk-unaligned-x")]


@pytest.mark.parametrize("label,spec", SM80, ids=[a for a, _ in SM80])
def test_kernel_compiles_sm80(label: str, spec) -> None:  # type: ignore[no-untyped-def]
    ck = K.build(spec, "sm_80")
    assert ck.cubin[:4] == b"\x7fELF" and ck.binary.spill_bytes == 0 and "sm_80" in ck.binary.log


def test_tiling_at_gpt2_small_is_a_real_tensor_core_tiling() -> None:
    """The tiling the GPT-2 small MLP gets: 8 warps, several blocks per output row (each recomputes its
    rows' hidden activation), three cp.async stages, within the portable shared-memory budget."""
    t = SPECS[0][1].tiles
    assert t.warps_m * t.warps_n == 8 and t.stages == 3 and t.bm in (16, 32, 64) and t.bn < 768
    assert (1024 // t.bm) * (768 // t.bn) >= 64  # enough blocks to occupy most of an H100's 132 SMs
