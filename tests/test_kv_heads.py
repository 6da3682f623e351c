"""The decode attention with its layer's head_rope group as the prologue (``rope_attention``): the q and
k norms and RoPEs and the K/V cache writes run inside the attention's launch.

CPU: the fused decode graphs (one launch per layer for the heads and the attention, GQA / MQA / MHA,
with and without q/k norm) agree with the unfused graph on the reference; the rule turned off gives
the two launches back; the compiled Qwen3-shaped decode step has five launches per layer; the spec
refuses parts that do not fit the attention; what cannot be one kernel (head_dim 32) keeps the
attention alone. GPU: tests/test_kv_heads_gpu.py.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from fusec import reference  # noqa: E402
from fusec.codegen import kernels as K  # noqa: E402
from fusec.codegen import specs as S  # noqa: E402
from fusec.codegen.build_decode import kv_attention_spec  # noqa: E402
from fusec.dtypes import DType  # noqa: E402
from fusec.models import get_config  # noqa: E402
from fusec.passes.base import PassOptions  # noqa: E402
from fusec.passes.fusion import describe_kernels, records  # noqa: E402
from fusec.passes.pipeline import optimize  # noqa: E402
from test_decode_kernels import heads_parts  # noqa: E402
from test_head_rope_pair import CASES, _cfg  # noqa: E402  (the same families and head layouts)


def _model(cfg):  # noqa: ANN001, ANN202
    from fusec.genmodel import GenModel
    from fusec.models.generate import SharedWeights
    from fusec.models.weights import RandomWeights

    return GenModel(cfg, SharedWeights(RandomWeights(1)), None, (), cfg.name)


def _decode(cfg, batch: int = 3):  # noqa: ANN001, ANN202
    from fusec.genmodel import build_graphs

    return build_graphs(_model(cfg), batch, 32, 8, [])["decode"]


def _optimized(g, disabled=()):  # noqa: ANN001, ANN202
    return optimize(g, PassOptions(disabled_fusions=frozenset(disabled)))[0]


def _feeds(g, cfg) -> dict[str, np.ndarray]:  # noqa: ANN001
    rng = np.random.default_rng(4)
    fixed = {"pos": np.array([8, 5, 30]), "cur": np.array([8, 5, 30]), "done": np.zeros(3, bool),
             "seed": np.array([3, 4, 5]), "lengths": np.array([8, 5, 30]),
             "temperature": np.zeros(3, np.float32), "top_k": np.zeros(3, np.int64), "top_p": np.ones(3, np.float32)}
    return {v.name: fixed[v.name] if v.name in fixed
            else rng.standard_normal(v.shape).astype(np.float32) if v.dtype == DType.F32
            else rng.integers(0, cfg.vocab_size, v.shape) for v in g.inputs}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_attention_takes_the_heads_as_its_prologue(case: str) -> None:
    """One rope_siblings+rope_attention kernel per layer, no RoPE, head_rope or attention launch of its
    own: one launch fewer per layer than with the rule off, and the same tokens, caches and states as
    that graph on the reference (the fused body runs there as the nodes it holds)."""
    cfg = _cfg(case)
    g0 = _decode(cfg)
    g, off = _optimized(g0), _optimized(g0, ("rope_attention",))
    ks, ks_off = describe_kernels(g), describe_kernels(off)
    fused = [k for k in ks if k.startswith("rope_siblings+rope_attention:")]
    assert len(fused) == cfg.num_layers and all(k.endswith("+kv_attention") for k in fused), ks
    assert not [k for k in ks if ("rope" in k or "kv_attention" in k) and k not in fused], ks
    assert len(ks_off) == len(ks) + cfg.num_layers
    assert sum(k == "kv_attention" for k in ks_off) == cfg.num_layers
    applied = [r for r in records(g) if r.rule == "rope_attention"]
    assert len(applied) == cfg.num_layers and all(r.applied and r.legal for r in applied)
    feeds = _feeds(g0, cfg)
    want, got = reference.run(off, feeds), reference.run(g, feeds)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_qwen3_decode_step_is_five_launches_per_layer() -> None:
    """A compiled one-row decode step of a Qwen3-shaped model (bf16, sm_90): per layer the QKV product
    (its norm inside), the attention (the heads inside), o, gate/up (norm and SwiGLU inside) and down;
    the attention kernel's source holds the prologue, and nothing else rotates or writes a K/V cache."""
    from fusec.compiler import compile_generation

    cfg = _cfg("qwen3-gqa")
    plans = {d: compile_generation(_model(cfg), batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90",
                                   eos_ids=[], disabled_fusions=d) for d in ((), ("rope_attention",))}
    launches = {d: p.manifest["entries"]["decode"]["launches"] for d, p in plans.items()}
    assert len(launches[()]) == len(launches[("rope_attention",)]) - cfg.num_layers
    plan = plans[()]
    man = plan.manifest
    mods = {m["id"]: m for m in man["modules"]}
    layer = [L for L in launches[()] if "kernel" in L and any(t in L["label"] for t in ("norm_gemm", "gemv", "rope"))]
    # + the LM head's product and the merge of its blocks' argmax
    assert len(layer) == 5 * cfg.num_layers + 2, [L["label"] for L in layer]
    attn = [L for L in launches[()] if "rope_attention" in L["label"]]
    assert len(attn) == cfg.num_layers
    for L in attn:
        mod = mods[man["kernels"][L["kernel"]]["module"]]
        src = plan._blobs[mod["source"]].decode()
        assert mod["template"] == "kv_attention.cu.jinja" and "hr_row0(" in src and "hr_row1(" in src
    assert not [L for L in launches[()] if "head_rope" in L["label"] or L["label"].endswith("kv_attention")]


def test_spec_refuses_heads_that_do_not_fit_the_attention() -> None:
    """Each mismatch between the prologue's parts and the attention is a one-line error naming it."""
    B, Hq, Hkv, Sq, T, D, dt = 2, 8, 2, 1, 64, 64, DType.BF16
    q, k, v = heads_parts(B, Hq, Hkv, Sq, T, D, dt, True)
    ok = kv_attention_spec(B, Hq, Hkv, Sq, T, D, dt, 0.1, heads=(q, k, v))
    r, src = K.prepare(ok)
    assert r.params == ("xq", "wq", "xk", "wk", "xv", "cos", "sin", "pos", "out_k", "out_v", "part", "sync", "out")
    # the step's rows are read from shared memory, so the older rows keep the read-only path
    assert "__shared__ __align__(16) T q_s" in src and "knew_s[jn]" in src and "#define KV_LD fc_ldg16" in src
    bad = {
        "the q part": (dataclasses.replace(q, H=Hkv), k, v),
        "the k part": (q, dataclasses.replace(k, cache_len=T - 1), v),
        "the v part": (q, k, dataclasses.replace(v, rotate=True)),
        "share cos/sin": (q, dataclasses.replace(k, cs_strides=(0, D)), v),
        "HeadRopeSpec parts": (q, k),
    }
    for what, parts in bad.items():
        with pytest.raises(ValueError, match=what):
            S.KVAttentionSpec(B, Hq, Hkv, Sq, T, D, dt, 0.1, heads=parts)
    with pytest.raises(ValueError, match="the k part"):  # the caches hold the attention's positions dtype
        S.KVAttentionSpec(B, Hq, Hkv, Sq, T, D, dt, 0.1, pos_dtype=DType.I32, heads=(q, k, v))
    three = heads_parts(B, Hq, Hkv, 3, T, D, dt, True)  # a window narrower than the step's rows
    with pytest.raises(ValueError, match="at most the window's 2 rows a step, got 3"):
        S.KVAttentionSpec(B, Hq, Hkv, 3, T, D, dt, 0.1, window=2, heads=three)
    assert S.KVAttentionSpec(B, Hq, Hkv, 3, T, D, dt, 0.1, window=3, heads=three).window == 3
    many = heads_parts(B, Hq, Hkv, 64, T, D, dt, True)  # 64 rows a step: 16 KB of k and v rows, no more
    with pytest.raises(ValueError, match="at most 16384 bytes of shared memory"):
        S.KVAttentionSpec(B, Hq, Hkv, 65, T, D, dt, 0.1, heads=heads_parts(B, Hq, Hkv, 65, T, D, dt, True))
    assert S.KVAttentionSpec(B, Hq, Hkv, 64, T, D, dt, 0.1, heads=many).heads == many
    plain = S.KVAttentionSpec(B, Hq, Hkv, Sq, T, D, dt, 0.1)
    assert "heads" not in repr(plain)  # kernels without a prologue keep their names


def test_head_dim_32_keeps_the_attention_alone() -> None:
    """qwen3-tiny's head_dim 32 has no head_rope kernel (D must be a multiple of 64), so no group is
    there to be a prologue: the attention stays a launch of its own and no rope_attention is recorded."""
    cfg = get_config("qwen3-tiny")
    g = _optimized(_decode(cfg))
    assert sum(k == "kv_attention" for k in describe_kernels(g)) == cfg.num_layers
    assert not [r for r in records(g) if r.rule == "rope_attention"]


def test_generation_disabled_fusions_are_checked() -> None:
    from fusec.compiler import compile_generation
    from fusec.errors import InputError

    with pytest.raises(InputError, match="unknown fusion rule.*'rope_atention'"):
        compile_generation(_model(_cfg("qwen3-gqa")), batch=1, max_seq_len=32, prefill_len=8, dtype="bf16",
                           arch="sm_90", eos_ids=[], disabled_fusions=("rope_atention",))
