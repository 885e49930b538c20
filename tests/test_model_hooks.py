"""The optional model hooks are typed: the protocols recognize a module that defines the
method and only such a module (torch's nn.Module attribute lookup included)."""

from __future__ import annotations

import torch
from titan.train.model_spec import HasAuxLoss, ReportsExpertLoad, UpdatesAfterOptimizerStep
from torch import nn


class WithHooks(nn.Module):
    def aux_loss(self):
        return torch.zeros(())

    def expert_load(self):
        return {"moe/imbalance_max": 1.0}

    def merge_expert_load(self, reports):
        return reports[0]

    def after_optimizer_step(self, sum_over_dp):
        sum_over_dp(torch.zeros(1))


def test_hooks_are_recognized_only_where_defined():
    plain, hooked = nn.Linear(2, 2), WithHooks()
    for protocol in (HasAuxLoss, ReportsExpertLoad, UpdatesAfterOptimizerStep):
        assert isinstance(hooked, protocol) and not isinstance(plain, protocol)


def test_the_moe_family_implements_every_hook():
    from titan.models.common.moe import MoE
    from titan.models.qwen3_moe import build_qwen3_moe

    with torch.device("meta"):
        model = build_qwen3_moe("debugmodel", vocab_size=64, max_seq_len=16)
    assert isinstance(model, HasAuxLoss) and isinstance(model, ReportsExpertLoad)
    assert any(isinstance(m, MoE) and isinstance(m, UpdatesAfterOptimizerStep) for m in model.modules())
