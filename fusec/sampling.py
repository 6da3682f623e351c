"""The definition of ``Op.SAMPLE``: next-token choice from logits, reproducible on every backend.

Every row ``b`` of logits [B, V] is drawn with its own settings, read from [B] tensors (a
generation plan keeps them as per-row state: ``temperature``, ``top_k``, ``top_p``, ``seed``),
so one step serves rows with different settings and a row's draw never depends on another row's.

Greedy (``temperature[b] == 0``): the index of the largest logit, the lowest index among equal
maxima (as ``torch.argmax`` and ``numpy.argmax`` pick).

Otherwise, for row ``b`` with logits ``x`` (fp32 math):

1. ``z = x / temperature[b]``;
2. top-k (``0 < top_k[b] < V``): keep ``v`` iff ``z[v] >= t_k``, the k-th largest value of ``z``
   (ties at the boundary are all kept);
3. top-p (``top_p[b] < 1``): with ``e[v] = exp(z[v] - max z)`` over the kept set, keep ``v`` iff
   the mass strictly above it is under the nucleus: ``sum(e[u] for kept u with z[u] > z[v]) <
   top_p * sum(e over kept)``. This is the smallest prefix of the sorted distribution whose mass
   reaches ``top_p`` (ties at the boundary kept), without a sort;
4. draw by the Gumbel-max trick: ``argmax over kept v of z[v] + g(seed[b], counter[b], v)`` with
   ``g = -log(-log(u))`` and ``u`` a 23-bit uniform in (0, 1) from a counter-based hash
   (splitmix64's finalizer; 23 bits, so u never rounds to 0 or 1). The noise is a pure function
   of its three integers, so the CUDA kernel and this reference draw the same token from the same
   logits; only a last-bit difference between two libm ``logf``s can change a draw, and only
   between two near-equal candidates. An empty kept set (never, with valid settings) draws 0.

``counter`` is per row (generation passes each sequence's position) and so is ``seed``: a draw
depends on nothing but the row's logits, settings, seed and counter (not on its row index, not on
how many steps ran before), so a request draws the same tokens in whichever row of a batch it runs.
``row_seeds`` gives the rows of one batch distinct seeds derived from one (row 0 keeps it).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fusec.errors import InputError

_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
ROW_MUL = 0xD1B54A32D192ED03
TOKEN_MUL = 0x8CB92BA72F3D8DD7
MIN_TEMPERATURE = 1e-30  # x / t stays finite in fp32 for |x| < ~3e8
MAX_TOP_K = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one row chooses its tokens (written into the row's state; see the module docstring)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0  # 1.0: no cut

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 \
                or 0 < t < MIN_TEMPERATURE:
            raise InputError(f"sampling: temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE:g}, "
                             f"got {t!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= MAX_TOP_K:
            raise InputError(f"sampling: top_k must be an integer in [0, {MAX_TOP_K}] (0: no cut), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise InputError(f"sampling: top_p must be in (0, 1] (1: no cut), got {p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_seed(seed: object) -> int:
    """A request's seed: an integer in [0, 2**63) (stored as the row's int64 state)."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**63:
        raise InputError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return int(seed)


def row_seeds(seed: int, rows: int) -> np.ndarray:
    """Distinct per-row seeds for a batch drawn with one seed: seed + b * ROW_MUL (mod 2**64), as
    int64. Row 0 keeps ``seed``, so a one-row generation draws what a request with that seed does."""
    vals = [((int(seed) + b * ROW_MUL) & _M64) for b in range(rows)]
    return np.array(vals, np.uint64).view(np.int64)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def row_key(seed: int, counter: int) -> np.uint64:
    """The per-(seed, counter) noise key: mix64(seed + GOLDEN * (counter + 1)) (seed as uint64)."""
    with np.errstate(over="ignore"):
        a = np.array([(int(seed) + GOLDEN * (int(counter) + 1)) & _M64], np.uint64)
        return mix64(a)[0]


def uniforms(seed: int, counter: int, vocab: int) -> np.ndarray:
    """u[v] = ((mix64(key ^ (v * TOKEN_MUL + 1)) >> 41) + 0.5) / 2**23 as float32, v in [0, vocab).

    23 bits plus one half are exact in fp32, so u lies strictly inside (0, 1): with 24 bits, the
    top value 2**24 - 0.5 rounds to 2**24 and u = 1 gives an infinite Gumbel noise."""
    key = row_key(seed, counter)
    with np.errstate(over="ignore"):
        v = np.arange(vocab, dtype=np.uint64) * np.uint64(TOKEN_MUL) + np.uint64(1)
        r = mix64(v ^ key)
    return ((r >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) / np.float32(1 << 23)


def gumbel(seed: int, counter: int, vocab: int) -> np.ndarray:
    u = uniforms(seed, counter, vocab)
    return -np.log(-np.log(u))


def keep_mask(z: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The kept set of one row of temperature-scaled logits ``z`` (steps 2 and 3 above)."""
    vocab = z.shape[0]
    keep = np.ones(vocab, bool)
    if 0 < top_k < vocab:
        t_k = np.partition(z, vocab - top_k)[vocab - top_k]
        keep &= z >= t_k
    if top_p < 1.0:
        if not keep.any():
            return keep
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


def sample_row(x: np.ndarray, seed: int, counter: int, temperature: float, top_k: int, top_p: float) -> int:
    """One row of ``sample`` (x: fp32 logits [V]; the settings as the row's state holds them)."""
    t = np.float32(temperature)
    if t == 0:
        return int(np.argmax(x))
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        z = x / t
        keep = keep_mask(z, int(top_k), float(np.float32(top_p)))
        score = np.where(keep, z + gumbel(seed, counter, z.shape[0]), -np.inf)
    return int(np.argmax(score))


def sample(logits: np.ndarray, seed: np.ndarray, counter: np.ndarray, temperature: object = 0.0,
           top_k: object = 0, top_p: object = 1.0) -> np.ndarray:
    """Reference ``Op.SAMPLE``: logits [B, V], then per-row seed, counter, temperature, top_k and
    top_p ([B] arrays; a scalar or [1] array stands for every row) -> int64 token ids [B]."""
    x = np.asarray(logits).astype(np.float32)
    rows = x.shape[0]

    def per_row(v: object, dtype: type) -> np.ndarray:
        return np.broadcast_to(np.asarray(v).astype(dtype).reshape(-1), (rows,))

    seeds, ctrs = per_row(seed, np.int64), per_row(counter, np.int64)
    temps, ks, ps = per_row(temperature, np.float32), per_row(top_k, np.int64), per_row(top_p, np.float32)
    return np.array([sample_row(x[b], int(seeds[b]), int(ctrs[b]), float(temps[b]), int(ks[b]), float(ps[b]))
                     for b in range(rows)], np.int64)
