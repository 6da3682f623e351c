"""The definition of ``Op.SAMPLE``: next-token choice from logits, reproducible on every backend.

Greedy (``temperature == 0``): the index of the largest logit, the lowest index among equal maxima
(as ``torch.argmax`` and ``numpy.argmax`` pick).

Otherwise, for row ``b`` with logits ``x`` (fp32 math):

1. ``z = x / temperature``;
2. top-k (``0 < top_k < V``): keep ``v`` iff ``z[v] >= t_k``, the k-th largest value of ``z``
   (ties at the boundary are all kept);
3. top-p (``top_p < 1``): with ``e[v] = exp(z[v] - max z)`` over the kept set, keep ``v`` iff the
   mass strictly above it is under the nucleus: ``sum(e[u] for kept u with z[u] > z[v]) <
   top_p * sum(e over kept)``. This is the smallest prefix of the sorted distribution whose mass
   reaches ``top_p`` (ties at the boundary kept), without a sort;
4. draw by the Gumbel-max trick: ``argmax over kept v of z[v] + g(seed, counter[b], b, v)`` with
   ``g = -log(-log(u))`` and ``u`` a 23-bit uniform in (0, 1) from a counter-based hash
   (splitmix64's finalizer; 23 bits, so u never rounds to 0 or 1). The noise is a pure
   function of its four integers, so the CUDA
   kernel and this reference draw the same token from the same logits; only a last-bit difference
   between two libm ``logf``s can change a draw, and only between two near-equal candidates.

``counter`` is per row (generation passes each sequence's position), so a step's draw never
depends on other rows or on how many steps ran before.
"""

from __future__ import annotations

import numpy as np

_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
ROW_MUL = 0xD1B54A32D192ED03
TOKEN_MUL = 0x8CB92BA72F3D8DD7


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def row_key(seed: int, counter: int, row: int) -> np.uint64:
    """The per-(seed, counter, row) key: mix64(mix64(seed + GOLDEN*(counter+1)) ^ row*ROW_MUL)."""
    with np.errstate(over="ignore"):
        a = np.array([(int(seed) + GOLDEN * (int(counter) + 1)) & _M64], np.uint64)
        h = mix64(a)
        h ^= np.array([(int(row) * ROW_MUL) & _M64], np.uint64)
        return mix64(h)[0]


def uniforms(seed: int, counter: int, row: int, vocab: int) -> np.ndarray:
    """u[v] = ((mix64(key ^ (v * TOKEN_MUL + 1)) >> 41) + 0.5) / 2**23 as float32, v in [0, vocab).

    23 bits plus one half are exact in fp32, so u lies strictly inside (0, 1): with 24 bits, the
    top value 2**24 - 0.5 rounds to 2**24 and u = 1 gives an infinite Gumbel noise."""
    key = row_key(seed, counter, row)
    with np.errstate(over="ignore"):
        v = np.arange(vocab, dtype=np.uint64) * np.uint64(TOKEN_MUL) + np.uint64(1)
        r = mix64(v ^ key)
    return ((r >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) / np.float32(1 << 23)


def gumbel(seed: int, counter: int, row: int, vocab: int) -> np.ndarray:
    u = uniforms(seed, counter, row, vocab)
    return -np.log(-np.log(u))


def keep_mask(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The kept set of one row of temperature-scaled logits ``z`` (steps 2 and 3 above)."""
    vocab = z.shape[0]
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        t_k = np.partition(z, vocab - top_k)[vocab - top_k]
        keep &= z >= t_k
    if top_p < 1.0:
        e = np.where(keep, np.exp(z - z[keep].max()), np.float32(0)).astype(np.float32)
        order = np.argsort(-z, kind="stable")
        zs, es = z[order], e[order]
        # mass strictly above each sorted position: the cumulative sum of the strictly larger values
        csum = np.concatenate([[np.float32(0)], np.cumsum(es, dtype=np.float32)])
        first_equal = np.searchsorted(-zs, -zs, side="left")  # start of each run of equal values
        above = np.empty(vocab, np.float32)
        above[order] = csum[first_equal]
        keep &= above < np.float32(top_p) * e.sum(dtype=np.float32)
    return keep


def sample(logits: np.ndarray, seed: np.ndarray, counter: np.ndarray, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Reference ``Op.SAMPLE``: logits [B, V], seed [1], counter [B] -> int64 token ids [B]."""
    x = np.asarray(logits).astype(np.float32)
    if temperature == 0.0:
        return np.argmax(x, axis=1).astype(np.int64)
    out = np.empty(x.shape[0], np.int64)
    s = int(np.asarray(seed).reshape(-1)[0])
    for b in range(x.shape[0]):
        z = x[b] / np.float32(temperature)
        keep = keep_mask(z, top_k, top_p)
        score = np.where(keep, z + gumbel(s, int(counter[b]), b, z.shape[0]), -np.inf)
        out[b] = int(np.argmax(score))
    return out
