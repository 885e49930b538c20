"""Rotary position embeddings (RoPE) with optional Llama 3.1 or YaRN frequency scaling.

Convention: the interleaved-pair (Meta) layout. Channels (2i, 2i+1) of each head form one pair
that is rotated by angle `position * inv_freq[i]`. The cache is real-valued (cos and sin side by
side) rather than complex, because complex tensors do not shard or compile everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama 3.1 long-context frequency scaling.

    Frequencies that complete fewer than `low_freq_factor` rotations over the original context
    are slowed down by `factor`; those completing more than `high_freq_factor` rotations are kept;
    the ones in between are blended linearly.
    """

    factor: float = 8.0
    """Slow-down of the lowest frequencies (8 for Llama 3.1, 32 for Llama 3.2 1B/3B)."""
    low_freq_factor: float = 1.0
    """Rotations over the original context below which a frequency is fully scaled."""
    high_freq_factor: float = 4.0
    """Rotations over the original context above which a frequency is left untouched."""
    original_max_position_embeddings: int = 8192
    """Context length of pretraining, before the long-context extension."""

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"rope_scaling.factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling.original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN long-context scaling (DeepSeek-V3, Hugging Face `rope_type: "yarn"`).

    Frequencies completing more than `beta_fast` rotations over the original context are
    kept (extrapolated), those completing fewer than `beta_slow` are divided by `factor`
    (interpolated), with a linear ramp over the channel pairs in between. The cos/sin table
    is multiplied by `attention_factor` (so the RoPE part of every q.k score by its square),
    and an attention using this scaling multiplies its softmax scale by
    `softmax_scale_multiplier()` (mscale(factor, mscale_all_dim) squared).
    """

    factor: float
    """Context extension: the interpolated frequencies are divided by it."""
    original_max_position_embeddings: int
    """Context length of pretraining, before the extension."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept."""
    beta_slow: float = 1.0
    """Rotations over the original context below which a frequency is fully interpolated."""
    mscale: float = 1.0
    """Numerator coefficient of the default `attention_factor`."""
    mscale_all_dim: float = 0.0
    """Denominator coefficient of the default `attention_factor`, and the coefficient of the
    softmax-scale multiplier (0: no multiplier)."""
    attention_factor: float | None = None
    """Scale of the cos/sin table; None derives it from factor, mscale and mscale_all_dim."""
    truncate: bool = True
    """Round the ramp's bounds to whole channel pairs (floor/ceil), as the reference does."""

    def __post_init__(self) -> None:
        if self.factor < 1:
            raise ValueError(f"yarn factor must be >= 1, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                f"yarn original_max_position_embeddings must be > 0, got {self.original_max_position_embeddings}"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"yarn needs beta_fast > beta_slow > 0, got {self.beta_fast}, {self.beta_slow}")

    def cos_sin_scale(self) -> float:
        """The factor the cos/sin table is multiplied by."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_scale_multiplier(self) -> float:
        """What an attention multiplies its 1/sqrt(head_dim) softmax scale by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def scale_inv_freq_yarn(inv_freq: torch.Tensor, theta: float, scaling: YarnScaling) -> torch.Tensor:
    """Apply YaRN's ramp between extrapolated and interpolated frequencies (see `YarnScaling`)."""
    rotary_dim = 2 * inv_freq.numel()

    def pair_index(rotations: float) -> float:
        # The channel pair whose frequency completes `rotations` turns over the original context.
        wavelengths = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return rotary_dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = pair_index(scaling.beta_fast), pair_index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp would divide by zero
    ramp = ((torch.arange(inv_freq.numel(), dtype=torch.float32, device=inv_freq.device) - low) / (high - low))
    keep = 1 - ramp.clamp(0.0, 1.0)  # 1: extrapolate (keep), 0: interpolate
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def scale_inv_freq_llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Apply Llama 3.1 scaling to inverse frequencies (see `RopeScaling`)."""
    wavelength = 2 * math.pi / inv_freq
    rotations = scaling.original_max_position_embeddings / wavelength
    span = scaling.high_freq_factor - scaling.low_freq_factor
    # 0 -> fully scaled (low frequency), 1 -> untouched (high frequency), linear in between.
    keep = ((rotations - scaling.low_freq_factor) / span).clamp(0.0, 1.0)
    return (1 - keep) * inv_freq / scaling.factor + keep * inv_freq


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequency of each of the `head_dim // 2` channel pairs, float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, YarnScaling):
        return scale_inv_freq_yarn(inv_freq, theta, scaling)
    return scale_inv_freq_llama3(inv_freq, scaling)


def rope_cache(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | YarnScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Float32 table [max_seq_len, head_dim]: for each pair, the cos of its angle, then its sin
    (both times YaRN's `cos_sin_scale()` under YaRN scaling), side by side as the pairs of x
    are, so that `apply_rope` views a row as complex numbers without a copy.

    Row p holds the rotation for absolute position p, so a caller can gather rows for any
    positions (a context-parallel shard gathers the rows of its own tokens).
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    table = torch.stack([angles.cos(), angles.sin()], dim=-1).flatten(-2)
    if isinstance(scaling, YarnScaling) and scaling.cos_sin_scale() != 1.0:
        table = table * scaling.cos_sin_scale()
    return table


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, S, H, Dh] by `rope` rows [S, Dh] or [B, S, Dh] (from `rope_cache`).

    The math runs in float32 (angles of late positions need it) and the result takes x's dtype.
    Each adjacent pair (x[2i], x[2i+1]) turns by its angle: one complex multiplication per
    pair in eager mode (a single kernel, forward and backward: 2.8x faster than the four
    multiplications and the stack on a CPU; the table's rows are viewed, not copied), the same
    products written in real arithmetic under `torch.compile`, which fuses those and cannot
    generate code for complex numbers.
    """
    xf, table = x.float(), rope.float().unsqueeze(-2)  # the table broadcasts over heads
    if torch.compiler.is_compiling() or not (_views_as_complex(xf) and _views_as_complex(table)):
        return _rotate_real(xf, table).type_as(x)
    turns = torch.view_as_complex(table.unflatten(-1, (-1, 2)))
    return torch.view_as_real(torch.view_as_complex(xf.unflatten(-1, (-1, 2))) * turns).flatten(-2).type_as(x)


def _rotate_real(xf: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`apply_rope`'s rotation of float32 `xf` by float32 `table` rows, in real arithmetic."""
    cos, sin = table.unflatten(-1, (-1, 2)).unbind(-1)
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _views_as_complex(t: torch.Tensor) -> bool:
    """Whether `torch.view_as_complex` can view `t`'s pairs in place: not a DTensor, and its
    pairs adjacent and starting at even offsets. (Fake tensors, which the memory estimates
    trace the model with, take the path real ones take.)"""
    return (
        not isinstance(t, DTensor)
        and t.stride(-1) == 1
        and t.storage_offset() % 2 == 0
        and all(stride % 2 == 0 for stride in t.stride()[:-1])
    )
