"""Rotary position embeddings (RoPE) with optional Llama 3.1 frequency scaling.

Convention: the interleaved-pair (Meta) layout. Channels (2i, 2i+1) of each head form one pair
that is rotated by angle `position * inv_freq[i]`. The cache is real-valued (cos and sin side by
side) rather than complex, because complex tensors do not shard or compile everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequency of each of the `head_dim // 2` channel pairs, float32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return inv_freq if scaling is None else scale_inv_freq_llama3(inv_freq, scaling)


def rope_cache(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: RopeScaling | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Float32 table [max_seq_len, head_dim]: cos of each pair's angle, then its sin.

    Row p holds the rotation for absolute position p, so a caller can gather rows for any
    positions (a context-parallel shard gathers the rows of its own tokens).
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device)
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, S, H, Dh] by `rope` rows [S, Dh] or [B, S, Dh] (from `rope_cache`).

    The math runs in float32 (angles of late positions need it) and the result takes x's dtype.
    """
    cos, sin = rope.unsqueeze(-2).chunk(2, dim=-1)  # broadcast over heads
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)
