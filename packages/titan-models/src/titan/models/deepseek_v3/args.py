"""DeepSeek-V3 hyperparameters and the published sizes."""

from __future__ import annotations

from dataclasses import dataclass

from titan.models.common.rope import YarnScaling


@dataclass(kw_only=True)
class DeepseekV3Args:
    """Shape of a DeepSeek-V3 model: multi-head latent attention (MLA) with decoupled RoPE
    (optionally YaRN-scaled), `first_k_dense_replace` dense blocks, then MoE blocks with a
    sigmoid, group-limited router, always-on shared experts and a per-expert selection bias.
    Attention and MoE field names follow the Hugging Face config. Defaults describe
    `debugmodel`.

    Multi-token prediction (the extra MTP block of the release) is not part of titan's model:
    imports skip its weights and training predicts the next token only.
    """

    dim: int = 256
    """Width of the residual stream (`hidden_size`)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 8
    """Attention heads per block."""
    vocab_size: int = 2048
    """Rows of the embedding and of the output projection."""
    ffn_hidden_dim: int = 512
    """SwiGLU hidden size of the dense blocks (`intermediate_size`)."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (the latent norms included)."""
    rope_theta: float = 10_000.0
    """RoPE base wavelength."""
    rope_scaling: YarnScaling | None = None
    """YaRN scaling of the RoPE frequencies and of the softmax scale; None is plain RoPE."""
    max_seq_len: int = 2048
    """Longest sequence (largest position + 1) the RoPE cache covers."""
    tie_word_embeddings: bool = False
    """Share the embedding with the output projection (no release does)."""
    num_labels: int = 0
    """0: a language model. n >= 1: a sequence-classification model whose output is a head of n
    scores per position (`DeepseekV3ForSequenceClassification`; 1 for a reward model)."""

    q_lora_rank: int | None = 64
    """Rank of the query down-projection; None (or 0) projects queries directly (`wq`)."""
    kv_lora_rank: int = 64
    """Rank of the key/value latent every head expands from."""
    qk_nope_head_dim: int = 32
    """Query/key channels per head without RoPE."""
    qk_rope_head_dim: int = 16
    """Query/key channels per head with RoPE (the key part is shared by all heads)."""
    v_head_dim: int = 32
    """Value channels per head."""

    moe_intermediate_size: int = 128
    """Hidden size of each routed expert's SwiGLU (and, times `n_shared_experts`, of the shared one)."""
    n_routed_experts: int = 8
    """Routed experts per MoE block."""
    n_shared_experts: int = 1
    """Experts every token goes through, fused into one SwiGLU."""
    num_experts_per_tok: int = 2
    """Routed experts each token is sent to (top-k)."""
    n_group: int = 2
    """Groups of consecutive experts for group-limited routing (1: no limit)."""
    topk_group: int = 1
    """Groups a token may pick its experts from."""
    routed_scaling_factor: float = 2.5
    """Multiplier of the routing weights."""
    norm_topk_prob: bool = True
    """Renormalize the selected experts' sigmoid scores to sum to one before scaling."""
    first_k_dense_replace: int = 1
    """The first this many blocks use the dense feed-forward."""
    moe_force_load_balance: bool = False
    """A run setting for benchmarks (torchtitan's `--debug.moe_force_load_balance`): every
    router sends tokens to the experts round robin, the same count to each, whatever its
    scores (which still weight the outputs); the model then computes another function."""
    load_balance_coeff: float | None = 1e-3
    """Step size of the auxiliary-loss-free balancing that moves the selection bias
    (`e_score_correction_bias`) toward uniform load after each optimizer step; None freezes
    the bias (it is still used for selection, as in the release)."""
    router_aux_loss_coef: float = 0.0
    """alpha of DeepSeek-V3's complementary sequence-wise balance loss (the Hub config's
    `aux_loss_alpha` with `seq_aux`; 1e-4 in the paper's pretraining, 0.001 in the released
    config): per sequence, alpha * sum_e f_e P_e, added for every MoE layer to the training
    loss through the model's `aux_loss()`; 0 computes none."""

    def __post_init__(self) -> None:
        if not self.q_lora_rank:
            self.q_lora_rank = None
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_hidden_dim", "max_seq_len",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                     "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group",
                     "topk_group"):
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(self.n_shared_experts >= 0, f"n_shared_experts must be >= 0, got {self.n_shared_experts}")
        _require(self.qk_rope_head_dim % 2 == 0,
                 f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even: RoPE rotates channel pairs")
        _require(0 <= self.first_k_dense_replace <= self.n_layers,
                 f"first_k_dense_replace must be in 0..n_layers ({self.n_layers}), got {self.first_k_dense_replace}")
        _require(self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})")
        _require(self.topk_group <= self.n_group, f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        _require(self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
                 f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= the experts of topk_group "
                 f"groups ({self.topk_group} x {self.n_routed_experts // self.n_group})")
        _require(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        _require(self.router_aux_loss_coef >= 0, f"router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        _require(self.load_balance_coeff is None or self.load_balance_coeff > 0,
                 f"load_balance_coeff must be > 0 or None (frozen bias), got {self.load_balance_coeff}")

    @property
    def n_kv_heads(self) -> int:
        """Every head has its own keys and values (expanded from the shared latent)."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """Query/key channels per head (`qk_nope_head_dim + qk_rope_head_dim`)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` routes to experts (all but the first `first_k_dense_replace`)."""
        return layer_id >= self.first_k_dense_replace


def _require(ok: bool, message: str) -> None:
    """Raise a ValueError with `message` unless `ok`."""
    if not ok:
        raise ValueError(f"DeepseekV3Args: {message}")


DEEPSEEK_V3_FLAVORS: dict[str, DeepseekV3Args] = {
    # Trains on CPU in minutes: low-rank queries, YaRN, 8 experts in 2 groups (top-2 from one
    # group), a shared expert, one dense block, the balancing bias on.
    "debugmodel": DeepseekV3Args(
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=1.0),
    ),
    # Multi-rank tests on a few CPU cores, and the Hugging Face parity shape: every size a
    # multiple of 8 (grouped_mm), 8 experts (divisible by EP 2 and 4).
    "debugmodel_tiny": DeepseekV3Args(
        dim=64, n_layers=3, n_heads=4, ffn_hidden_dim=128, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, moe_intermediate_size=32,
        rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),
        max_seq_len=256,
    ),
    # A 16B-class model (the DeepSeek-V2-Lite shape with V3's sigmoid routing): 64 experts
    # top-6 plus 2 shared, queries without a low-rank projection, ~2.7B active parameters.
    "16B": DeepseekV3Args(
        dim=2048, n_layers=27, n_heads=16, vocab_size=102400, ffn_hidden_dim=10944,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1, max_seq_len=4096,
    ),
    # The released DeepSeek-V3 / V3.1 / R1 architecture (without the MTP block).
    "671B": DeepseekV3Args(
        dim=7168, n_layers=61, n_heads=128, vocab_size=129280, ffn_hidden_dim=18432,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=3,
        rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                                 beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_seq_len=163840,
    ),
}
"""DeepSeek-V3 sizes by name. Treat entries as templates: `build_deepseek_v3` copies them."""
