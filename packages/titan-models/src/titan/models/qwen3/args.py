"""Qwen3 (dense) hyperparameters and the published sizes."""

from __future__ import annotations

from dataclasses import dataclass

from titan.models.common.rope import RopeScaling


@dataclass(kw_only=True)
class Qwen3Args:
    """Shape of a Qwen3 dense model. Defaults describe `debugmodel`.

    Differences from Llama 3 that matter: `head_dim` is its own field (n_heads * head_dim may
    differ from dim), every block normalizes q and k per head (QK norm), the FFN width is given
    directly, and the small sizes tie the embedding to the output projection.
    """

    dim: int = 256
    """Width of the residual stream (`hidden_size`)."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 8
    """Query heads per block."""
    n_kv_heads: int = 4
    """Key/value heads per block (grouped-query attention); must divide n_heads."""
    head_dim: int = 64
    """Channels per attention head, independent of dim (128 in every published size)."""
    vocab_size: int = 2048
    """Rows of the embedding and of the output projection."""
    ffn_hidden_dim: int = 768
    """SwiGLU hidden size (`intermediate_size`)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm, the per-head q/k norms included."""
    rope_theta: float = 1_000_000.0
    """RoPE base wavelength."""
    max_seq_len: int = 2048
    """Longest sequence (largest position + 1) the RoPE cache covers."""
    tie_word_embeddings: bool = True
    """Share one [vocab, dim] matrix between the token embedding and the output projection
    (0.6B, 1.7B and 4B as published). Pipeline parallel cannot split a tied model."""
    num_labels: int = 0
    """0: a language model (the output projection gives `vocab_size` logits). n >= 1: a
    sequence-classification model, the output a head of n scores per position (Hugging Face's
    `...ForSequenceClassification` `score`; 1 for a reward model), never tied to the embedding."""

    rope_scaling: RopeScaling | None = None
    """Always None: the published Qwen3 sizes use plain RoPE (the shared decoder reads it)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                     "ffn_hidden_dim", "max_seq_len"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
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
            self.rope_scaling is None,
            "rope_scaling is not supported for qwen3 (the published sizes use plain RoPE); "
            "leave it None",
        )


def _require(ok: bool, message: str) -> None:
    """Raise a ValueError with `message` unless `ok`."""
    if not ok:
        raise ValueError(f"Qwen3Args: {message}")


_QWEN3_VOCAB = 151936
_QWEN3_CONTEXT = 40960


def _published(**fields: object) -> Qwen3Args:
    """A released size: the fields every Qwen3 dense checkpoint shares, plus `fields`."""
    shared: dict[str, object] = dict(
        head_dim=128, n_kv_heads=8, vocab_size=_QWEN3_VOCAB, max_seq_len=_QWEN3_CONTEXT,
    )
    return Qwen3Args(**{**shared, **fields})


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # A few million parameters for CPU smoke runs: the same code path as the released sizes
    # (tied, n_heads * head_dim = 2 * dim like 0.6B).
    "debugmodel": Qwen3Args(),
    # For multi-rank tests on a few CPU cores: 4 heads / 2 kv heads and an FFN of 128 divide
    # by tensor parallel degree 2; head_dim 32 with dim 64 keeps head_dim != dim / n_heads.
    "debugmodel_tiny": Qwen3Args(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=128,
        tie_word_embeddings=False,
    ),
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, ffn_hidden_dim=3072, tie_word_embeddings=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, ffn_hidden_dim=6144, tie_word_embeddings=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, ffn_hidden_dim=9728, tie_word_embeddings=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, ffn_hidden_dim=12288, tie_word_embeddings=False),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, ffn_hidden_dim=17408, tie_word_embeddings=False),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, ffn_hidden_dim=25600, tie_word_embeddings=False),
}
"""Published Qwen3 dense sizes by name. Treat entries as templates: `build_qwen3` copies them."""
