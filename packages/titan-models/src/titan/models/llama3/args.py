"""Llama 3 hyperparameters and the published sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan.models.common.rope import RopeScaling


@dataclass(kw_only=True)
class Llama3Args:
    """Shape of a Llama 3 model. Defaults describe `debugmodel`."""

    dim: int = 256
    """Width of the residual stream."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 8
    """Query heads per block; head_dim = dim // n_heads."""
    n_kv_heads: int = 4
    """Key/value heads per block (grouped-query attention); must divide n_heads."""
    vocab_size: int = 2048
    """Rows of the embedding and of the output projection."""
    multiple_of: int = 256
    """The FFN hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the FFN hidden size before rounding (1.3 for 8B); None keeps 2/3 * 4 * dim."""
    ffn_dim: int | None = None
    """Explicit FFN hidden size, overriding the rule above (for checkpoints that break it)."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """RoPE base wavelength."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1 long-context frequency scaling; None turns it off."""
    max_seq_len: int = 2048
    """Longest sequence (largest position + 1) the RoPE cache covers."""
    tie_word_embeddings: bool = False
    """Share one [vocab, dim] matrix between the token embedding and the output projection
    (Llama 3.2 1B/3B; `tie_word_embeddings` in a Hugging Face config). Pipeline parallel cannot
    split a tied model (first and last stage would need the same parameter)."""
    num_labels: int = 0
    """0: a language model (the output projection gives `vocab_size` logits). n >= 1: a
    sequence-classification model, the output a head of n scores per position (Hugging Face's
    `...ForSequenceClassification` `score`; 1 for a reward model), never tied to the embedding."""

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "vocab_size",
            "multiple_of",
            "max_seq_len",
        ):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(
            self.dim % self.n_heads == 0,
            f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}); pick dim = n_heads * head_dim",
        )
        _require(
            self.n_heads % self.n_kv_heads == 0,
            f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads}); "
            "each kv head serves a whole group of query heads",
        )
        _require(
            self.head_dim % 2 == 0,
            f"head_dim ({self.head_dim}) must be even: RoPE rotates channel pairs",
        )
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(
            self.ffn_dim_multiplier is None or self.ffn_dim_multiplier > 0,
            f"ffn_dim_multiplier must be > 0 or None, got {self.ffn_dim_multiplier}",
        )
        _require(
            self.ffn_dim is None or self.ffn_dim > 0,
            f"ffn_dim must be > 0 or None, got {self.ffn_dim}",
        )

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4 * dim (same FLOPs as a plain 4x MLP), times the multiplier,
        rounded up to `multiple_of`; `ffn_dim` wins when set."""
        if self.ffn_dim is not None:
            return self.ffn_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)


def _require(ok: bool, message: str) -> None:
    """Raise a ValueError with `message` unless `ok`."""
    if not ok:
        raise ValueError(f"Llama3Args: {message}")


_LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
_LLAMA3_VOCAB = 128256
_LLAMA31_CONTEXT = 131072

LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    # A few million parameters: for tests and CPU smoke runs; same code path as the big ones.
    "debugmodel": Llama3Args(rope_scaling=_LLAMA31_SCALING),
    # Tiny enough for multi-rank parity tests on a few CPU cores (dim <= 128, <= 4 layers);
    # 4 heads / 2 kv heads and an FFN of 192 still divide by tensor parallel degree 2.
    "debugmodel_tiny": Llama3Args(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=32, rope_scaling=_LLAMA31_SCALING
    ),
    # Llama 3.2: embedding and output projection are one tied matrix, as published.
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=_LLAMA31_CONTEXT,
        tie_word_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_scaling=_LLAMA32_SCALING,
        max_seq_len=_LLAMA31_CONTEXT,
        tie_word_embeddings=True,
    ),
    # Llama 3.1.
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=_LLAMA31_CONTEXT,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=_LLAMA31_CONTEXT,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=_LLAMA3_VOCAB,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_scaling=_LLAMA31_SCALING,
        max_seq_len=_LLAMA31_CONTEXT,
    ),
    # `debugmodel_tiny` with tied embeddings, for multi-rank tests of the tie (Llama 3.2 style).
    "debugmodel_tiny_tied": Llama3Args(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        multiple_of=32,
        rope_scaling=_LLAMA31_SCALING,
        tie_word_embeddings=True,
    ),
}
"""Published Llama 3 sizes by name. Treat entries as templates: `build_llama3` copies them."""
