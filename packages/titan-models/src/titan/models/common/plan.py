"""A model's sharding plan: plain data that `titan.dist` interprets (it never imports a model)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from torch import nn

TP_STYLES = frozenset(
    {"embedding", "colwise", "rowwise", "norm", "block_input", "output", "score", "replicate", "head_norm",
     "shared_by_heads", "replicated_block"}
)
"""Tensor-parallel styles a plan may name (see `ShardingPlan.tensor_parallel`)."""


@dataclass(frozen=True, kw_only=True)
class ShardingPlan:
    """How a model wants to be split; module names are globs where `*` is one name part.

    `layers.*.attention` matches `layers.0.attention` but not `layers.0.attention.wq`.
    """

    tensor_parallel: dict[str, str]
    """Module glob -> TP style: "embedding" (vocab-sharded), "colwise", "rowwise", "norm"
    (sequence-parallel region when SP is on), "block_input" (first positional input gathered
    from sequence shards when SP is on), "output" (vocab-sharded logits for loss parallel),
    "score" (a final head too narrow to split, e.g. a reward model's: replicated, reading the
    whole sequence),
    "replicate" (kept whole on every TP rank: routers, low-rank projections), "head_norm" (a
    norm over the last dim of [B, S, H, Dh] activations whose heads are TP-sharded),
    "shared_by_heads" (a parameter-free module whose output every head reads whole, e.g.
    MLA's rotated key part: its gradient is summed over the ranks holding the heads),
    "replicated_block" (a block every TP rank computes whole, e.g. an MoE layer: with SP its
    input is gathered to the full sequence and its output cut back to sequence shards)."""
    fsdp_units: tuple[str, ...]
    """Module globs wrapped with fully_shard, each as its own unit, before the root."""
    layer_container: str = "layers"
    """Name of the ModuleDict of blocks: PP splits it, AC and compile wrap each block."""
    pipeline_first: tuple[str, ...] = ("tok_embeddings",)
    """Modules only the first pipeline stage keeps (set to None elsewhere)."""
    pipeline_last: tuple[str, ...] = ("norm", "output")
    """Modules only the last pipeline stage keeps (set to None elsewhere)."""
    attention_modules: str = "layers.*.attention.inner_attention"
    """Glob of the inner attention modules that context parallelism replaces."""
    tensor_parallel_divisible: dict[str, int] = field(default_factory=dict)
    """Sizes the tensor-parallel degree must divide, by a name shown in the error (e.g.
    `{"n_heads": 32, "n_kv_heads": 8, "ffn_hidden_dim": 14336}`): heads and hidden units are
    split evenly over the TP ranks, never cut in the middle."""
    expert_parallel_divisible: dict[str, int] = field(default_factory=dict)
    """Sizes the expert-parallel degree must divide (e.g. `{"n_routed_experts": 64}`)."""
    expert_modules: str | None = None
    """Glob of the grouped-experts modules (`titan.models.common.moe.GroupedExperts`, e.g.
    `layers.*.moe.experts`) that expert parallelism shards along the expert dim; their
    weights are never tensor-parallel. None: the model has no routed experts."""
    auxiliary_loss_modules: str | None = None
    """Glob of the modules whose training forward leaves an auxiliary loss (an MoE router's
    balancing loss, with its coefficient above 0): under pipeline parallel each stage adds its
    own through its output's backward, which the zero-bubble schedules (split input and weight
    backward passes) cannot run, so they refuse such a model. None: none."""
    tied_parameters: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names (full-model names, e.g. `("tok_embeddings.weight",
    "output.weight")`) that are one shared Parameter. `titan.dist` keeps each group one
    parameter: FSDP leaves a group split across units to the root unit, TP re-shares it after
    sharding (the members must get the same placements), and PP refuses a split that puts the
    members on different stages. The first name is the one checkpoints and init use."""

    def __post_init__(self) -> None:
        bad = {
            glob: style for glob, style in self.tensor_parallel.items() if style not in TP_STYLES
        }
        if bad:
            raise ValueError(
                f"unknown tensor-parallel styles {bad}; use one of {sorted(TP_STYLES)}"
            )
        short = [group for group in self.tied_parameters if len(group) < 2]
        if short:
            raise ValueError(
                f"tied_parameters groups {short} name fewer than 2 parameters; each group "
                "lists every name of one shared parameter"
            )


def glob_matches(pattern: str, fqn: str) -> bool:
    """Whether module name `fqn` matches `pattern`, `*` standing for exactly one name part."""
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(map(fnmatch.fnmatchcase, names, parts))


def match_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of `model`'s submodules that `pattern` matches (see `glob_matches`)."""
    return [name for name, _ in model.named_modules() if name and glob_matches(pattern, name)]
