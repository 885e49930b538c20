"""Building blocks shared by the titan model families."""

from titan.models.common.accounting import count_params, dense_flops_per_token
from titan.models.common.attention import (
    GroupedQueryAttention,
    ScaledDotProductAttention,
)
from titan.models.common.feed_forward import FeedForward
from titan.models.common.init import SeededInit, fill_seeded_
from titan.models.common.norm import RMSNorm, rms_norm_reference
from titan.models.common.plan import ShardingPlan, glob_matches, match_modules
from titan.models.common.rope import (
    RopeScaling,
    YarnScaling,
    apply_rope,
    rope_cache,
    rope_inv_freq,
    scale_inv_freq_llama3,
    scale_inv_freq_yarn,
    yarn_mscale,
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
    "rms_norm_reference",
    "rope_cache",
    "rope_inv_freq",
    "scale_inv_freq_llama3",
    "scale_inv_freq_yarn",
    "YarnScaling",
    "yarn_mscale",
    "SeededInit",
    "fill_seeded_",
]
