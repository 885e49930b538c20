"""Building blocks shared by the titan model families."""

from titan.models.common.accounting import count_params, dense_flops_per_token
from titan.models.common.attention import (
    GroupedQueryAttention,
    ScaledDotProductAttention,
)
from titan.models.common.feed_forward import FeedForward
from titan.models.common.init import SeededInit, fill_seeded_
from titan.models.common.norm import RMSNorm
from titan.models.common.plan import ShardingPlan, glob_matches, match_modules
from titan.models.common.rope import (
    RopeScaling,
    apply_rope,
    rope_cache,
    rope_inv_freq,
    scale_inv_freq_llama3,
)

__all__ = [
    "FeedForward",
    "GroupedQueryAttention",
    "RMSNorm",
    "RopeScaling",
    "ScaledDotProductAttention",
    "ShardingPlan",
    "apply_rope",
    "count_params",
    "dense_flops_per_token",
    "glob_matches",
    "match_modules",
    "rope_cache",
    "rope_inv_freq",
    "scale_inv_freq_llama3",
    "SeededInit",
    "fill_seeded_",
]
