"""A GGUF file's q/k/v and gate/up weights of one format are repacked into one buffer per operand
(models/gguf.py), so passes/merge_gemms.py merges them as a view of it (``fusec.bulk.concat_rows``)
instead of holding a second, concatenated copy while compiling: the plan is byte for byte the one
made without the buffers."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from test_gguf import Q, write_gguf  # noqa: E402

from fusec.bulk import concat_rows  # noqa: E402


def test_concat_rows_views_adjacent_slices_and_copies_the_rest():
    buf = np.arange(24, dtype=np.float32).reshape(6, 4)
    v = concat_rows([buf[0:2], buf[2:5]])
    np.testing.assert_array_equal(v, buf[0:5])
    assert np.shares_memory(v, buf) and not v.flags.writeable
    for parts in ([buf[0:2], buf[3:5]], [buf[2:4], buf[0:2]], [buf[0:2], buf[2:5].copy()], [buf[:, :2], buf[:, 2:]]):
        got = concat_rows(parts)  # a gap, the wrong order, another owner, not contiguous: a copy
        np.testing.assert_array_equal(got, np.concatenate(parts, axis=0))
        assert not np.shares_memory(got, buf)


def _plan(path, monkeypatch, grouped: bool):
    import fusec.models.gguf as G
    from fusec.compiler import compile_generation

    if not grouped:
        monkeypatch.setattr(G, "_MERGE_GROUPS", ())
    plan = compile_generation(str(path), batch=1, max_seq_len=32, prefill_len=8, dtype="bf16", arch="sm_90",
                              eos_ids=())
    monkeypatch.undo()
    return plan


def test_grouped_weights_make_the_same_plan(tmp_path, monkeypatch):
    # q, k, gate, up Q4_K (two merge groups, q/k un-permuted rows); v Q6_K (merged with nothing)
    types = {f"blk.{i}.attn_v.weight": Q.Q6_K for i in range(2)}
    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, types=types)
    a, b = _plan(path, monkeypatch, True), _plan(path, monkeypatch, False)
    assert a.manifest["entries"] == b.manifest["entries"]
    for name in sorted(set(a.blobs()) | set(b.blobs())):
        assert hashlib.sha256(bytes(a.blob(name))).digest() == hashlib.sha256(bytes(b.blob(name))).digest(), name


def test_a_merge_group_is_one_buffer(tmp_path):
    from fusec.models.gguf import load_gguf

    path = write_gguf(tmp_path / "m.gguf", Q.Q4_K, types={"blk.0.attn_k.weight": Q.Q6_K})
    w = load_gguf(path).weights
    d = w.cfg.hidden_size
    q, k, v = (w.get_packed(f"layers.0.self_attn.{n}_proj.weight", s) for n, s in
               (("q", (w.cfg.num_heads * w.cfg.head_dim, d)), ("k", (w.cfg.num_kv_heads * w.cfg.head_dim, d)),
                ("v", (w.cfg.num_kv_heads * w.cfg.head_dim, d))))
    for qa, va in zip(q.arrays, v.arrays):  # q and v (Q4_K) share a buffer, k (Q6_K) stands alone
        np.testing.assert_array_equal(concat_rows([qa, va]), np.concatenate([qa, va]))
        assert np.shares_memory(concat_rows([qa, va]), qa)
    assert not any(np.shares_memory(ka, qa) for ka in k.arrays for qa in q.arrays)
