"""The decoder families on the GPU: the windowed decode-attention kernel against the reference,
and generation plans of every family against the reference backend (same graphs, same weights):
token-exact in fp32; bf16 generates and its agreement with fp32 is reported (``record_property``
and printed with ``-s``), not asserted, since bf16 rounding may flip a near-tie of random weights.

    pytest -m gpu tests/test_generation_families_gpu.py -s
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.gpu

from test_decode_kernels_gpu import FLOATS, check, dev, host, poisoned, rand, run_kv_attention  # noqa: E402
from test_generation_gpu import assert_no_host_work  # noqa: E402

from fusec import ops as O  # noqa: E402
from fusec import reference  # noqa: E402
from fusec.codegen import specs as S  # noqa: E402
from fusec.ops import Op  # noqa: E402
from fusec.runtime.generation import generate_with_plan  # noqa: E402

KV = [(sq, splits, window) for sq, splits in ((1, 1), (1, 4), (3, 3)) for window in (5, 64)]


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("sq, splits, window", KV, ids=[f"S{s}-x{n}-w{w}" for s, n, w in KV])
def test_windowed_kv_attention_matches_the_reference(dt: Any, sq: int, splits: int, window: int) -> None:
    B, Hq, Hkv, T, D = 2, 8, 2, 256, 64
    q, k, v = rand((B, Hq, sq, D), dt), rand((B, Hkv, T, D), dt), rand((B, Hkv, T, D), dt)
    pos = np.array([200, 37], np.int64)
    scale = 1.0 / math.sqrt(D)
    f = lambda a: a.astype(np.float32)  # noqa: E731
    want = reference.IMPL[Op.KV_ATTENTION](O.KVAttentionAttrs(scale, window=window), f(q), f(k), f(v), pos)
    bare = reference.IMPL[Op.KV_ATTENTION](O.KVAttentionAttrs(scale), f(q), f(k), f(v), pos)
    assert np.abs(want - bare).max() > 1e-2  # the window matters at these positions
    kn, vn = k.copy(), v.copy()  # keys no query of the row sees hold NaN: reading them would show
    for b in range(B):
        kn[b, :, : max(0, pos[b] - window + 1)] = np.nan
        vn[b, :, : max(0, pos[b] - window + 1)] = np.nan
        kn[b, :, pos[b] + sq:] = np.nan
        vn[b, :, pos[b] + sq:] = np.nan
    spec = S.KVAttentionSpec(B, Hq, Hkv, sq, T, D, dt, scale, splits, window=window)
    out = poisoned((B, Hq, sq, D), dt)
    run_kv_attention(spec, [dev(q), dev(kn), dev(vn), dev(pos)], out)
    check(host(out, dt), want, dt)


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
NEW = 12


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families_gpu")


def _sources(name: str, root: Path) -> list[Path]:
    import decoder_families as DF

    d, model = DF.checkpoint(name, root)
    out = [d]
    try:
        import gguf  # noqa: F401  (the GPU machine may not have it: the HF directory alone then)
    except ImportError:
        return out
    out.append(DF.write_gguf(name, model, root / f"{name}.gguf"))
    return out


FAMILIES = ["llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_generates_on_the_gpu_as_the_reference(name: str, root: Path, record_property: Any) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs, load_generation_model
    from fusec.compiler import compile_generation

    longest = max(map(len, PROMPTS))
    t_max = longest + NEW
    for source in _sources(name, root):
        gm = load_generation_model(source)
        want = generate(ReferenceEngine(build_graphs(gm, 3, t_max, longest, eos_ids=[])), PROMPTS, NEW,
                        gm.config.vocab_size).new_ids
        got = {}
        for dt in ("fp32", "bf16"):
            plan = compile_generation(load_generation_model(source), batch=3, max_seq_len=t_max, prefill_len=longest,
                                      dtype=dt, eos_ids=[])
            got[dt] = generate_with_plan(plan, PROMPTS, max_new_tokens=NEW).new_ids
        assert got["fp32"] == want, f"{source.name} fp32"
        same = sum(a == b for x, y in zip(got["bf16"], want) for a, b in zip(x, y)) / (3 * NEW)
        first = sum(x[0] == y[0] for x, y in zip(got["bf16"], want)) / 3
        record_property(f"{source.name}_bf16_token_agreement", same)
        print(f"\n{name} {source.name}: fp32 token-exact; bf16 agrees on {same:.0%} of tokens "
              f"({first:.0%} of first tokens)")
        assert all(len(n) == NEW and all(0 <= t < gm.config.vocab_size for t in n) for n in got["bf16"])


def test_decode_steps_of_a_windowed_model_do_no_host_work(root: Path) -> None:
    pytest.importorskip("transformers")
    from fusec.genmodel import load_generation_model
    from fusec.compiler import compile_generation

    d = _sources("gemma2", root)[0]
    plan = compile_generation(load_generation_model(d), batch=2, max_seq_len=64, prefill_len=16, dtype="bf16",
                              eos_ids=[])
    res = generate_with_plan(plan, [[5, 6, 7, 8, 9, 10, 11, 12, 13], [8, 9]], max_new_tokens=24, measure=True)
    assert_no_host_work(res.stats["decode"], 23)


