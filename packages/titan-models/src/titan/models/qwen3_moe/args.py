"""Qwen3-MoE hyperparameters and the published sizes."""

from __future__ import annotations

from dataclasses import dataclass

from titan.models.qwen3.args import Qwen3Args


@dataclass(kw_only=True)
class Qwen3MoeArgs(Qwen3Args):
    """Shape of a Qwen3-MoE model: Qwen3's fields (QK-norm attention, explicit `head_dim`;
    `ffn_hidden_dim` is the dense feed-forward of the non-MoE layers) plus the routed
    experts. MoE field names follow the Hugging Face config. Defaults describe `debugmodel`.
    """

    dim: int = 256
    n_layers: int = 4
    head_dim: int = 32
    ffn_hidden_dim: int = 512
    tie_word_embeddings: bool = False

    moe_intermediate_size: int = 128
    """Hidden size of each routed expert's SwiGLU."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    norm_topk_prob: bool = True
    """Renormalize the top-k router probabilities to sum to one (true for every release)."""
    decoder_sparse_step: int = 1
    """Layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 (and not in
    `mlp_only_layers`); the others use the dense feed-forward."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers forced to the dense feed-forward."""
    router_aux_loss_coef: float = 0.0
    """Weight of the Switch-style load-balancing loss (0.001 in the releases). It reaches the
    training loss through the model's `aux_loss()`, which the training engine adds; 0 computes none."""
    moe_force_load_balance: bool = False
    """A run setting for benchmarks (torchtitan's `--debug.moe_force_load_balance`): every
    router sends tokens to the experts round robin, the same count to each, whatever its
    scores (which still weight the outputs); the model then computes another function."""
    load_balance_coeff: float | None = None
    """Step size of titan's auxiliary-loss-free balancing (a per-expert selection bias moved
    toward uniform load after each optimizer step); None turns it off. Hugging Face Qwen3-MoE
    has no such bias: an export drops it, so keep it None to fine-tune a release."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        for name in ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(
            self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})",
        )
        _require(self.router_aux_loss_coef >= 0, f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        _require(
            self.load_balance_coeff is None or self.load_balance_coeff > 0,
            f"load_balance_coeff must be > 0 or None (off), got {self.load_balance_coeff}",
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` routes to experts (Hugging Face's rule)."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0


def _require(ok: bool, message: str) -> None:
    """Raise a ValueError with `message` unless `ok`."""
    if not ok:
        raise ValueError(f"Qwen3MoeArgs: {message}")


def _published(**fields: object) -> Qwen3MoeArgs:
    """A released size: the fields both Qwen3-MoE checkpoints share, plus `fields`."""
    shared: dict[str, object] = dict(
        n_kv_heads=4, head_dim=128, vocab_size=151936, max_seq_len=40960, rope_theta=1_000_000.0,
        norm_eps=1e-6, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        router_aux_loss_coef=0.001, tie_word_embeddings=False,
    )
    return Qwen3MoeArgs(**{**shared, **fields})


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    # Trains on CPU in minutes: every layer MoE, 8 experts top-2, load-balancing bias on.
    "debugmodel": Qwen3MoeArgs(load_balance_coeff=1e-3),
    # Multi-rank tests on a few CPU cores, and the Hugging Face parity config: a dense first
    # layer, 8 experts (divisible by EP 2 and 4), sizes that are multiples of 8 (grouped_mm).
    "debugmodel_tiny": Qwen3MoeArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=128,
        moe_intermediate_size=32, mlp_only_layers=(0,),
    ),
    "30B-A3B": _published(dim=2048, n_layers=48, n_heads=32, ffn_hidden_dim=6144, moe_intermediate_size=768),
    "235B-A22B": _published(dim=4096, n_layers=94, n_heads=64, ffn_hidden_dim=12288, moe_intermediate_size=1536),
}
"""Qwen3-MoE sizes by name. Treat entries as templates: `build_qwen3_moe` copies them."""
