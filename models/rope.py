"""Rotary position embedding tables: the default RoPE and its scaled variants.

One record, ``RopeScaling``, describes every scaling fusec computes, whichever file it came from
(config.json's ``rope_scaling``/``rope_parameters`` or GGUF's ``rope.scaling.*`` keys and
``rope_freqs`` tensors):

==============  ===================================================================================
kind            inverse frequencies (``inv`` = 1 / theta^(2i/d), the default RoPE)
==============  ===================================================================================
``linear``      inv / factor (position interpolation)
``llama3``      Llama 3.1's three bands: long wavelengths / factor, short ones unchanged, a smooth
                ramp between (``low_freq_factor``, ``high_freq_factor``, ``original_max_positions``)
``yarn``        YaRN: interpolated and extrapolated frequencies blended by a linear ramp over the
                dimensions between the ``beta_fast``/``beta_slow`` rotation counts; cos/sin are
                multiplied by the attention factor (0.1 ln(factor) + 1 unless given)
``longrope``    Phi-3's per-frequency ``short_factor`` (a cache up to ``original_max_positions``;
                longer caches need the ``long_factor`` set mid-sequence and are refused), cos/sin
                times sqrt(1 + ln(factor) / ln(original_max_positions)) unless given
``factors``     inv / freq_factors[i]: GGUF's ``rope_freqs`` tensor (llama.cpp stores Llama 3.1's
                scaling so); ``attention_factor`` multiplies cos/sin
==============  ===================================================================================

The arithmetic follows transformers' ``modeling_rope_utils`` step by step in fp32 (numpy float32
arrays, Python floats for the scalars), so the tables equal the ones HF builds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fusec.errors import ModelError

KINDS = ("linear", "llama3", "yarn", "longrope", "factors")
# what `fusec models` lists as accepted; "default"/"none" is unscaled RoPE
ACCEPTED = ("default",) + KINDS[:-1]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    kind: str
    factor: float = 1.0
    original_max_positions: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn (DeepSeek form; 0: unused)
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the correction range outwards
    attention_factor: float = 0.0  # 0: derived from factor (yarn, longrope); 1 otherwise
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()
    freq_factors: tuple[float, ...] = ()  # factors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ModelError(f"RoPE scaling {self.kind!r:.60} is not supported (supported: {', '.join(ACCEPTED)})")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ModelError(f"RoPE scaling {self.kind}: {name} is {v!r:.60}, not a finite number > 0")
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ModelError(f"RoPE scaling {self.kind}: {name} is {v!r:.60}, not a finite number >= 0")
        for name in ("short_factor", "long_factor", "freq_factors"):
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0
                       for x in getattr(self, name)):
                raise ModelError(f"RoPE scaling {self.kind}: {name} must hold finite numbers > 0")
        needs_orig = self.kind in ("llama3", "yarn", "longrope")
        if needs_orig and (isinstance(self.original_max_positions, bool) or not isinstance(self.original_max_positions, int)
                           or self.original_max_positions < 1):
            raise ModelError(f"RoPE scaling {self.kind}: original_max_position_embeddings is "
                             f"{self.original_max_positions!r:.60}, not a positive integer")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ModelError("RoPE scaling llama3: high_freq_factor must exceed low_freq_factor")
        if self.kind == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ModelError("RoPE scaling longrope: short_factor and long_factor must be lists of one length")
        if self.kind == "factors" and not self.freq_factors:
            raise ModelError("RoPE scaling: the per-frequency factors are empty")

    def check(self, rotary_dim: int, max_seq_len: int | None = None) -> None:
        """ModelError if the scaling does not fit ``rotary_dim`` dims or a ``max_seq_len`` cache."""
        n = {"longrope": len(self.short_factor), "factors": len(self.freq_factors)}.get(self.kind)
        if n is not None and n != rotary_dim // 2:
            raise ModelError(f"RoPE scaling {self.kind}: {n} per-frequency factors for {rotary_dim // 2} "
                             f"frequencies (rotary dims {rotary_dim})")
        if self.kind == "longrope" and max_seq_len is not None and max_seq_len > self.original_max_positions:
            raise ModelError(f"RoPE scaling longrope: a cache of {max_seq_len} tokens exceeds "
                             f"original_max_position_embeddings {self.original_max_positions}; longer contexts "
                             "switch to long_factor mid-sequence, which fusec does not implement "
                             f"(use --max-seq-len <= {self.original_max_positions})")


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    # HF: 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), fp32 throughout
    return (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))


def _yarn_mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def inv_freq(theta: float, dim: int, scaling: RopeScaling | None) -> tuple[np.ndarray, float]:
    """(fp32 inverse frequencies [dim / 2], attention factor) of RoPE over ``dim`` rotary dims."""
    base = _default_inv_freq(theta, dim)
    if scaling is None:
        return base, 1.0
    s, f32 = scaling, np.float32
    if s.kind == "linear":
        return (base / f32(s.factor)).astype(np.float32), 1.0
    if s.kind == "factors":
        return (base / np.asarray(s.freq_factors, np.float32)).astype(np.float32), s.attention_factor or 1.0
    if s.kind == "llama3":
        old = s.original_max_positions
        low_wl, high_wl = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = f32(2 * math.pi) / base
        llama = np.where(wavelen > f32(low_wl), base / f32(s.factor), base).astype(np.float32)
        smooth = ((f32(old) / wavelen - f32(s.low_freq_factor)) / f32(s.high_freq_factor - s.low_freq_factor))
        smoothed = (f32(1) - smooth) * llama / f32(s.factor) + smooth * llama
        medium = ~(wavelen < f32(high_wl)) & ~(wavelen > f32(low_wl))
        return np.where(medium, smoothed, llama).astype(np.float32), 1.0
    factor = s.factor
    if s.kind == "longrope":
        attn = s.attention_factor
        if not attn:
            attn = math.sqrt(1 + math.log(factor) / math.log(s.original_max_positions)) if factor > 1.0 else 1.0
        shape = np.arange(0, dim, 2, dtype=np.float32) / f32(dim)
        ext = np.asarray(s.short_factor, np.float32)
        return (f32(1.0) / (ext * (f32(theta) ** shape))).astype(np.float32), attn
    # yarn
    attn = s.attention_factor
    if not attn:
        attn = (_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim)
                if s.mscale and s.mscale_all_dim else _yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no zero-width ramp
    pos_freqs = f32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / f32(dim))
    extrapolation = f32(1.0) / pos_freqs
    interpolation = f32(1.0) / (f32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - f32(low)) / f32(high - low), 0, 1).astype(np.float32)
    extra = f32(1) - ramp
    return (interpolation * (f32(1) - extra) + extrapolation * extra).astype(np.float32), attn


def cos_sin(theta: float, rotary_dim: int, scaling: RopeScaling | None, length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [length, rotary_dim] for positions 0..length-1, as HF's rotary embedding computes
    them: freqs = pos * inv_freq (fp32), emb = cat(freqs, freqs), cos/sin times the attention factor."""
    inv, attn = inv_freq(theta, rotary_dim, scaling)
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    if attn != 1.0:
        cos, sin = cos * np.float32(attn), sin * np.float32(attn)
    return cos, sin
