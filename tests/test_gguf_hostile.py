"""Hostile GGUF files (fusec.models.gguf): counts past the end of the file, huge arrays, huge layer
counts, impossible head sizes, tensor offsets that wrap around, NaN/negative floats. Each must be one
``ModelError`` (one ``fusec: error:`` line, exit 1), quickly: the cases that used to hang run under
``_deadline``, so a regression fails instead of hanging the suite.

The files are written here by a small raw GGUF writer (``_gguf``); ``_tiny_llama`` is a 1-layer F32
llama without a tokenizer (``load_gguf(..., tokenizer=False)`` needs none).
"""

from __future__ import annotations

import contextlib
import math
import signal
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hostile_helpers import fails

from fusec.errors import ModelError
from fusec.models import gguf as fg
from fusec.models import gguf_file as gf

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
_FMT = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
SECONDS = 2.0


@contextlib.contextmanager
def _deadline(seconds: float = SECONDS) -> Iterator[None]:
    """Fail (TimeoutError) instead of hanging when the body runs past ``seconds``."""
    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"took more than {seconds} s (the old reader looped over a declared count)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- a raw GGUF writer -------------------------------------------------------------------------------

def _s(x: str | bytes) -> bytes:
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def _val(t: int, v: Any) -> bytes:
    if t == STR:
        return _s(v)
    if t == ARR:
        sub, items = v
        return struct.pack("<IQ", sub, len(items)) + b"".join(_val(sub, x) for x in items)
    return struct.pack("<" + _FMT[t], v)


def kv(key: str, t: int, v: Any) -> bytes:
    return _s(key) + struct.pack("<I", t) + _val(t, v)


def _gguf(path: Path, kvs: list[bytes], tensors: list[tuple[str, list[int], int, bytes]] = (), *,
          align: int = 32) -> dict[str, int]:
    """Write a GGUF v3 file: ``kvs`` from ``kv()``, ``tensors`` as (name, GGUF dims, type, data).
    Returns {tensor name: byte position of its offset field} and {"<data>": the data section's start}."""
    hdr = struct.pack("<IIQQ", 0x46554747, 3, len(tensors), len(kvs)) + b"".join(kvs)
    where: dict[str, int] = {}
    blobs, off = b"", 0
    for name, dims, ttype, data in tensors:
        pad = (-off) % align
        blobs, off = blobs + b"\0" * pad, off + pad
        hdr += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        where[name] = len(hdr) + 4
        hdr += struct.pack("<IQ", ttype, off)
        blobs, off = blobs + data, off + len(data)
    hdr += b"\0" * ((-len(hdr)) % align)
    where["<data>"] = len(hdr)
    path.write_bytes(hdr + blobs)
    return where


def _tiny_llama(path: Path, *, d: int = 16, heads: int = 2, kv_heads: int = 1, ff: int = 32, vocab: int = 8,
                hd: int | None = None, over: dict[str, tuple[int, Any]] | None = None,
                drop: tuple[str, ...] = (), q4k_noise: bool = False) -> dict[str, int]:
    """A 1-layer F32 llama (no tokenizer); ``over`` replaces or adds metadata keys, ``drop`` removes them;
    ``q4k_noise``: its projections are Q4_K blocks of random bytes (NaN/inf scales included)."""
    hd = hd if hd is not None else d // heads
    md: dict[str, tuple[int, Any]] = {
        "general.architecture": (STR, "llama"), "llama.block_count": (U32, 1), "llama.embedding_length": (U32, d),
        "llama.feed_forward_length": (U32, ff), "llama.attention.head_count": (U32, heads),
        "llama.attention.head_count_kv": (U32, kv_heads), "llama.context_length": (U32, 64),
        "llama.attention.layer_norm_rms_epsilon": (F32, 1e-5), "llama.rope.freq_base": (F32, 10000.0)}
    md.update(over or {})
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "blk.0.attn_norm.weight": (d,),
              "blk.0.ffn_norm.weight": (d,), "blk.0.attn_q.weight": (heads * hd, d),
              "blk.0.attn_k.weight": (kv_heads * hd, d), "blk.0.attn_v.weight": (kv_heads * hd, d),
              "blk.0.attn_output.weight": (d, heads * hd), "blk.0.ffn_gate.weight": (ff, d),
              "blk.0.ffn_up.weight": (ff, d), "blk.0.ffn_down.weight": (d, ff)}
    rng = np.random.default_rng(0)
    tensors = [(n, list(reversed(s)), 0, (rng.standard_normal(s) * 0.1).astype(np.float32).tobytes())
               for n, s in shapes.items()]
    if q4k_noise:  # Q4_K (type 12): 144 bytes per 256 weights
        tensors = [(n, dims, 12, rng.integers(0, 256, math.prod(dims) // 256 * 144, dtype=np.uint8).tobytes())
                   if len(dims) == 2 and n != "token_embd.weight" else (n, dims, t, data)
                   for n, dims, t, data in tensors]
    return _gguf(path, [kv(k, t, v) for k, (t, v) in md.items() if k not in drop], tensors)


def _refused(path: Path, *needles: str) -> str:
    with _deadline(), pytest.raises(ModelError) as e:
        fg.load_gguf(path, tokenizer=False)
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    assert "\n" not in msg
    return msg


def _header(n_kv: int = 1, n_tensors: int = 0) -> bytes:
    return struct.pack("<IIQQ", 0x46554747, 3, n_tensors, n_kv)


def test_the_tiny_llama_loads(tmp_path) -> None:
    p = tmp_path / "ok.gguf"
    _tiny_llama(p)
    m = fg.load_gguf(p, tokenizer=False)
    assert (m.config.num_layers, m.config.head_dim, m.config.norm_eps) == (1, 8, np.float32(1e-5).item())


# ---- 1, 2: metadata arrays ---------------------------------------------------------------------------

def test_an_array_declaring_2_62_items_past_the_end_is_refused(tmp_path) -> None:
    p = tmp_path / "trunc_array.gguf"  # 49 bytes: the reader appended empty reads 2**62 times
    p.write_bytes(_header() + _s("x") + struct.pack("<IIQ", ARR, U8, 2**62))
    with _deadline(), pytest.raises(ModelError, match=r"metadata key 'x' is an array of 4611686018427387904 items.*"
                                                      r"at most 4194304"):
        gf._open(p)


def test_a_nested_array_declaring_2_40_items_is_refused(tmp_path) -> None:
    p = tmp_path / "nested.gguf"
    p.write_bytes(_header() + _s("x") + struct.pack("<IIQ", ARR, ARR, 1) + struct.pack("<IQ", I32, 2**40))
    with _deadline(), pytest.raises(ModelError, match="metadata key 'x' is an array of 1099511627776 items"):
        gf._open(p)


@pytest.mark.parametrize("sub, n, needle", [
    (U8, 1_000_000, "1000000 UINT8 items of at least 1 bytes"),
    (I32, 1_000_000, "1000000 INT32 items of at least 4 bytes"),
    (STR, 1_000_000, "1000000 STRING items of at least 8 bytes"),
    (ARR, 1_000_000, "1000000 ARRAY items of at least 12 bytes"),
])
def test_an_array_longer_than_the_bytes_left_is_refused_before_reading(tmp_path, sub, n, needle) -> None:
    p = tmp_path / "short.gguf"
    p.write_bytes(_header() + _s("tokens") + struct.pack("<IIQ", ARR, sub, n) + b"\0" * 64)
    with _deadline(), pytest.raises(ModelError, match="metadata key 'tokens'") as e:
        gf._open(p)
    assert needle in str(e.value)


def test_a_string_array_that_ends_early_names_the_item(tmp_path) -> None:
    p = tmp_path / "strings.gguf"  # 8 bytes an item fit, but the third string's length runs off the end
    p.write_bytes(_header() + _s("t") + struct.pack("<IIQ", ARR, STR, 4) + _s("a") + _s("b") + struct.pack("<Q", 99)
                  + b"\0" * 9)
    with _deadline(), pytest.raises(ModelError, match="item 2 of metadata key 't' \\(99 bytes\\)"):
        gf._open(p)


def test_a_large_valid_array_is_read_quickly(tmp_path) -> None:
    n = 3_000_000  # the old reader made one numpy view per item: ~35 s and 2.5 GB
    p = tmp_path / "amp_array.gguf"
    p.write_bytes(_header() + _s("junk.bytes") + struct.pack("<IIQ", ARR, U8, n) + bytes(range(256)) * (n // 256)
                  + b"\7" * (n % 256))
    with _deadline():
        md = gf.read_metadata(gf._open(p), p)
    assert len(md["junk.bytes"]) == n and md["junk.bytes"][:3] == [0, 1, 2] and md["junk.bytes"][-1] == 7


def test_an_array_over_the_item_cap_is_refused(tmp_path) -> None:
    n = gf.MAX_ARRAY_ITEMS + 1
    p = tmp_path / "big.gguf"
    p.write_bytes(_header() + _s("junk") + struct.pack("<IIQ", ARR, U8, n) + b"\0" * n)
    with _deadline(), pytest.raises(ModelError, match=f"'junk' is an array of {n} items.*at most {n - 1} per array"):
        gf._open(p)


def test_counts_of_keys_and_tensors_past_the_end_are_refused(tmp_path) -> None:
    p = tmp_path / "kv.gguf"
    p.write_bytes(_header(n_kv=2**63))
    with _deadline(), pytest.raises(ModelError, match="9223372036854775808 metadata keys do not fit"):
        gf._open(p)
    p.write_bytes(_header(n_kv=0, n_tensors=60_000) + b"\0" * 64)
    with _deadline(), pytest.raises(ModelError, match="60000 tensor descriptions do not fit"):
        gf._open(p)
    p.write_bytes(_header(n_kv=0, n_tensors=1) + _s("t") + struct.pack("<I", 2**32 - 1) + b"\0" * 64)
    with _deadline(), pytest.raises(ModelError, match="tensor 't' has 4294967295 dimensions"):
        gf._open(p)


def test_metadata_matches_ggufreader(tmp_path) -> None:
    """The parser replaced gguf.GGUFReader for the header: same values, same Python types (a guard for
    the rewrite; it passed before it too)."""
    gguf = pytest.importorskip("gguf")
    p = tmp_path / "types.gguf"
    kvs = [kv("u8", U8, 200), kv("i8", I8, -5), kv("u16", U16, 60000), kv("i16", I16, -300), kv("u32", U32, 2**31),
           kv("i32", I32, -2**31), kv("f32", F32, 1e-5), kv("b", BOOL, True), kv("s", STR, "h\u00e9llo \U0001f642"),
           kv("u64", U64, 2**63), kv("i64", I64, -2**62), kv("f64", F64, math.pi), kv("empty", ARR, (U32, [])),
           kv("a_f32", ARR, (F32, [0.1, -2.5, 3e38])), kv("a_str", ARR, (STR, ["a", "", "\u00e9\u00e8"])),
           kv("a_bool", ARR, (BOOL, [True, False])), kv("a_i64", ARR, (I64, [-1, 2**62]))]
    _gguf(p, kvs, [("w", [32, 2], 0, np.ones(64, np.float32).tobytes())])
    ours = gf.read_metadata(gf._open(p), p)
    theirs = gf.read_metadata(gguf.GGUFReader(p), p)
    assert ours == theirs
    assert [type(v) for v in ours.values()] == [type(v) for v in theirs.values()]
    assert gf.read_metadata(gf._open(p), p, max_array=2) == {k: v for k, v in theirs.items()
                                                             if not (isinstance(v, list) and len(v) > 2)}
    (t,) = gf._open(p).tensors
    r = gguf.GGUFReader(p).tensors[0]
    assert (t.name, t.n_bytes, t.data_offset, t.data.shape) == (r.name, r.n_bytes, r.data_offset, r.data.shape)
    assert np.array_equal(t.data, r.data)


# ---- 3: layer counts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("t, n", [(U32, 2**31), (U64, 2**62), (U32, 2)])
def test_a_block_count_the_tensors_cannot_cover_is_refused(tmp_path, t, n) -> None:
    p = tmp_path / "layers.gguf"  # the old loader built every expected tensor name of 2**31 layers first
    _tiny_llama(p, over={"llama.block_count": (t, n)})
    _refused(p, "'llama.block_count'", f"is {n}", "holds only 11 tensors")


# ---- 4: head sizes -----------------------------------------------------------------------------------

def test_an_odd_head_size_is_refused(tmp_path, capsys) -> None:
    p = tmp_path / "odd_hd.gguf"  # was exit 70 (ValueError in _unpermute)
    _tiny_llama(p, hd=3, over={"llama.attention.key_length": (U32, 3), "llama.attention.value_length": (U32, 3)})
    _refused(p, "'llama.attention.key_length'", "head size of 3", "odd")
    fails(capsys, ["generate", str(p), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
          needles=["llama.attention.key_length"])


def test_more_heads_than_the_hidden_size_is_refused(tmp_path, capsys) -> None:
    p = tmp_path / "heads_gt_hidden.gguf"  # head size 2 // 4 = 0: was exit 70 (ZeroDivisionError in the rope table)
    _tiny_llama(p, d=2, heads=4, kv_heads=4, hd=0)
    _refused(p, "'llama.attention.head_count'", "does not divide llama.embedding_length 2")
    fails(capsys, ["generate", str(p), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
          needles=["llama.attention.head_count"])


def test_heads_that_do_not_divide_the_hidden_size_are_refused(tmp_path) -> None:
    p = tmp_path / "h3.gguf"  # 16 // 3 = 5: an odd head size nobody asked for
    _tiny_llama(p, heads=3, kv_heads=1, hd=5)
    _refused(p, "'llama.attention.head_count'", "is 3, which does not divide llama.embedding_length 16")


def test_an_explicit_head_size_need_not_divide_the_hidden_size(tmp_path) -> None:
    p = tmp_path / "hd6.gguf"  # key_length given: q is heads * 6 wide, as in HF's explicit head_dim
    _tiny_llama(p, heads=3, kv_heads=1, hd=6, over={"llama.attention.key_length": (U32, 6)})
    assert fg.load_gguf(p, tokenizer=False).config.head_dim == 6


def test_kv_heads_that_do_not_divide_the_heads_are_named(tmp_path) -> None:
    p = tmp_path / "kv3.gguf"
    _tiny_llama(p, heads=2, kv_heads=3)
    _refused(p, "'llama.attention.head_count_kv'", "is 3, which does not divide llama.attention.head_count 2")


# ---- 5: tensor offsets -------------------------------------------------------------------------------

def _patch_offset(p: Path, where: dict[str, int], name: str, value: int) -> None:
    b = bytearray(p.read_bytes())
    b[where[name]:where[name] + 8] = struct.pack("<Q", value)
    p.write_bytes(bytes(b))


def test_a_tensor_offset_that_wraps_around_is_refused(tmp_path) -> None:
    p = tmp_path / "wrap_off.gguf"  # data_offset + offset wrapped in uint64: the tensor read the magic
    where = _tiny_llama(p)
    _patch_offset(p, where, "output_norm.weight", 2**64 - where["<data>"])
    _refused(p, "tensor 'output_norm.weight'", "ends past the end of the file")


def test_a_misaligned_tensor_offset_is_refused(tmp_path) -> None:
    p = tmp_path / "misaligned.gguf"
    where = _tiny_llama(p)
    _patch_offset(p, where, "output_norm.weight", 4)
    _refused(p, "tensor 'output_norm.weight' has offset 4, not a multiple of the alignment 32")


# ---- 6: eps and rope theta ---------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("llama.attention.layer_norm_rms_epsilon", float("nan")),
                                        ("llama.attention.layer_norm_rms_epsilon", 0.0),
                                        ("llama.attention.layer_norm_rms_epsilon", -0.5),
                                        ("llama.rope.freq_base", -1.0),
                                        ("llama.rope.freq_base", float("inf")),
                                        ("llama.rope.freq_base", float("nan"))])
def test_eps_and_rope_theta_must_be_finite_and_positive(tmp_path, key, value) -> None:
    p = tmp_path / "f.gguf"
    _tiny_llama(p, over={key: (F32, value)})
    _refused(p, f"metadata key {key!r} is {value!r}", "expected a finite number > 0")


def test_an_odd_head_size_from_the_hidden_size_names_the_head_count(tmp_path) -> None:
    p = tmp_path / "odd_derived.gguf"  # 12 / 4 = 3
    _tiny_llama(p, d=12, heads=4, kv_heads=2)
    _refused(p, "'llama.attention.head_count' 4 and llama.embedding_length 12 give a head size of 3, which is odd")


def test_a_quantized_row_that_splits_a_block_is_refused(tmp_path) -> None:
    p = tmp_path / "q.gguf"  # Q8_0 (type 8): blocks of 32; a 16-wide row does not fill one
    p.write_bytes(_header(n_kv=0, n_tensors=1) + _s("t") + struct.pack("<IQQIQ", 2, 16, 2, 8, 0) + b"\0" * 64)
    with _deadline(), pytest.raises(ModelError, match="tensor 't' \\(Q8_0\\) has rows of 16 elements"):
        gf._open(p)


# ---- packed weights: the repacker reads only the checked bytes -------------------------------------

def test_random_q4k_blocks_repack_as_gguf_dequantizes_them(tmp_path) -> None:
    """Any bytes in valid-sized blocks (NaN/inf scales, 6-bit fields at their maximum) repack
    without reading or writing past the tensor, into exactly what gguf dequantizes."""
    import gguf

    p = tmp_path / "noise.gguf"
    _tiny_llama(p, d=256, heads=2, kv_heads=1, ff=256, q4k_noise=True)
    m = fg.load_gguf(p, tokenizer=False)
    t = next(t for t in gf._open(p).tensors if t.name == "blk.0.ffn_down.weight")
    qw = m.weights.get_packed("layers.0.mlp.down_proj.weight", (256, 256))
    with np.errstate(all="ignore"):
        want = gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.Q4_K).reshape(256, 256)
        np.testing.assert_array_equal(qw.dequantize(), want)
    assert qw.nbytes < t.n_bytes * 1.1  # packed, not expanded


def test_a_truncated_packed_tensor_is_refused_before_repacking(tmp_path) -> None:
    p = tmp_path / "cut.gguf"
    _tiny_llama(p, d=256, heads=2, kv_heads=1, ff=256, q4k_noise=True)
    p.write_bytes(p.read_bytes()[:-1])  # the last tensor (ffn_down, Q4_K) loses its last byte
    _refused(p, "'blk.0.ffn_down.weight'", "ends past the end of the file")
