"""The trainer's view of a model family.

titan.train never imports a model family (docs/design.md): the recipes layer describes one with a
``ModelSpec`` and hands it to the trainer. The trainer relies only on the model contract in
``docs/contracts.md``: ``init_weights``, ``num_params``, ``flops_per_token``, ``sharding_plan``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from titan.ckpt.hf import StateDictAdapter  # the one protocol (titan.ckpt reads and writes HF)
from torch import nn

# The optional hooks the engine and the loops call on a model (docs/contracts.md). Checked
# with isinstance: a model opts in by defining the method, and no family is named.


@runtime_checkable
class HasAuxLoss(Protocol):
    """A model (part) whose training forward leaves an auxiliary loss, e.g. an MoE router's
    balancing loss: a scalar tensor with its coefficient applied, or None."""

    def aux_loss(self) -> torch.Tensor | None: ...


@runtime_checkable
class ReportsExpertLoad(Protocol):
    """A model (part) with figures for every logged record, e.g. MoE per-layer load.
    ``merge_expert_load`` combines the reports of several parts of one model (the pipeline
    stages of this rank and of the other pipeline ranks) into the whole model's record."""

    def expert_load(self) -> dict[str, float]: ...

    def merge_expert_load(self, reports: list[dict[str, float]]) -> dict[str, float]: ...


@runtime_checkable
class UpdatesAfterOptimizerStep(Protocol):
    """Any submodule with state not trained by gradients (an MoE router's balancing bias),
    updated after every optimizer step; ``sum_over_dp(tensor)`` sums a tensor in place over
    the data-parallel and context-parallel ranks."""

    def after_optimizer_step(self, sum_over_dp: Callable[[torch.Tensor], torch.Tensor]) -> None: ...


@runtime_checkable
class TakesSequenceSum(Protocol):
    """A submodule whose training forward takes a statistic over all of a microbatch's
    tokens (an MoE router's balancing loss), which context parallel splits over its ranks:
    the engine hands it ``sequence_sum(tensor)``, a differentiable sum over the
    context-parallel ranks (None without context parallel)."""

    def set_sequence_sum(self, sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None) -> None: ...


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to know about one model family.

    ``build(flavor, **overrides)`` constructs the model under the active device context (the
    trainer calls it under ``torch.device("meta")``); ``flavors`` maps a flavor name to its
    arguments; ``adapter(model)`` returns the family's Hugging Face state-dict adapter.
    """

    name: str
    flavors: Mapping[str, Any]
    build: Callable[..., nn.Module]
    adapter: Callable[[nn.Module], StateDictAdapter] | None = None
    hf_model_type: str | None = None
    """The ``model_type`` of the family's Hugging Face ``config.json`` (e.g. ``llama``)."""
    args_from_hf_config: Callable[[dict[str, Any]], Any] | None = None
    """The family's arguments for a Hugging Face ``config.json`` dict (its adapter's)."""

    def with_flavor(self, flavor: str, args: Any) -> ModelSpec:
        """This spec plus one more flavor, ``args`` (the family's arguments dataclass), e.g. a
        checkpoint's own architecture; ``build(flavor, **overrides)`` builds it. The family's
        build knows only its table, so the new flavor is built as the table's first flavor with
        every field replaced by ``args``' (overrides win)."""
        base = next(iter(self.flavors))
        fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        family_build = self.build

        def build(name: str, **overrides: Any) -> nn.Module:
            if name != flavor:
                return family_build(name, **overrides)
            return family_build(base, **{**fields, **overrides})

        return dataclasses.replace(self, flavors={**self.flavors, flavor: args}, build=build)

    def check_flavor(self, flavor: str) -> None:
        """Raise a ValueError naming the known flavors when ``flavor`` is not one of them."""
        if flavor not in self.flavors:
            known = ", ".join(self.flavors)
            raise ValueError(
                f"--model.flavor {flavor!r} is not a {self.name} size; choose one of: {known}"
            )
