"""The torchao MXFP8 conversion (``--quantize.linear.mx``, ``--quantize.grouped_mm.mx``): which
linears and experts it converts, what it refuses where, and that a converted module really
computes in MXFP8 (its output differs from the high-precision one by MXFP8 rounding and equals
torchao's own MXFP8 function)."""

from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
from titan.models.common.moe import GroupedExperts
from titan.train.quantize import (
    MXGroupedMMConfig,
    MXLinearConfig,
    QuantizeConfig,
    QuantizeGroupedMMConfig,
    QuantizeLinearConfig,
    apply_quantization,
    check_quantize_supported,
    mx_linears,
)

pytest.importorskip("torchao.prototype.moe_training.config")
EMULATED = "mxfp8_emulated_rceil"


def _config(linear: str | None = None, experts: list[str] | None = None, recipe: str = EMULATED, **mx) -> QuantizeConfig:
    return QuantizeConfig(linear=QuantizeLinearConfig(mx=MXLinearConfig(recipe_name=linear, **mx)),
                          grouped_mm=QuantizeGroupedMMConfig(mx=MXGroupedMMConfig(fqns=experts or [], recipe_name=recipe)))


@dataclass
class _Plan:
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    expert_modules: str | None = None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(64, 64, bias=False)
        self.w2 = nn.Linear(128, 64, bias=False)
        self.w48 = nn.Linear(64, 48, bias=False)  # a multiple of 16 (float8) but not of 32 (MXFP8)
        self.gate = nn.Linear(64, 32, bias=False)  # a router: the plan replicates it
        self.experts = GroupedExperts(dim=64, hidden_dim=64, n_experts=4)
        with torch.no_grad():
            for w in (self.experts.w1, self.experts.w2, self.experts.w3):
                nn.init.normal_(w, std=0.125)  # GroupedExperts leaves its init to the model's seeded init


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.output = nn.Linear(64, 32, bias=False)

    def sharding_plan(self) -> _Plan:
        return _Plan({"layers.*.gate": "replicate", "output": "output"}, expert_modules="layers.*.experts")


def _wrapped(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if type(p.data).__name__ == "MXFP8TrainingWeightWrapperTensor"]


def test_converts_exactly_the_filtered_linears_and_the_named_experts():
    torch.manual_seed(0)
    model = _MoE()
    report = apply_quantization(model, _config(linear=EMULATED, experts=["layers.1.experts"], filter_fqns=["layers.1.wq"]))
    assert list(report.converted) == ["layers.0.wq", "layers.0.w2", "layers.1.w2"]
    assert report.skipped == {
        "layers.0.w48": "dims not divisible by 32", "layers.1.w48": "dims not divisible by 32",
        "layers.0.gate": "output layer or TP-replicated linear: router, low-rank projection (model plan)",
        "layers.1.gate": "output layer or TP-replicated linear: router, low-rank projection (model plan)",
        "layers.1.wq": "--quantize.linear.mx.filter_fqns",
        "output": "output layer or TP-replicated linear: router, low-rank projection (model plan)"}
    assert report.converted_experts == ("layers.1.experts",) and report.high_precision_experts == 1
    assert _wrapped(model) == ["layers.0.wq.weight", "layers.0.w2.weight", "layers.1.w2.weight",
                               "layers.1.experts.w1", "layers.1.experts.w2", "layers.1.experts.w3"]
    summary = report.summary(_config(linear=EMULATED, experts=["x"]).recipe)
    assert summary.startswith("mxfp8_emulated_rceil linears + mxfp8_emulated_rceil experts: converted 3 of 9 linears "
                              "and 1 grouped-experts modules")
    assert "1 grouped-experts modules stay in high precision" in summary and "emulated" in summary
    assert mx_linears(_MoE(), MXLinearConfig(recipe_name=EMULATED))[0] == [
        "layers.0.wq", "layers.0.w2", "layers.1.wq", "layers.1.w2"]


def test_a_converted_linear_computes_in_mxfp8():
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    torch.manual_seed(0)
    model = _MoE()
    weight = model.layers["0"].wq.weight.detach().clone()
    apply_quantization(model, _config(linear=EMULATED))
    x = torch.randn(32, 64)
    out = model.layers["0"].wq(x)
    # MXFP8 rounding is visible (e4m3 elements, one power-of-two scale per 32) ...
    assert not torch.allclose(out, x @ weight.T, rtol=1e-2, atol=1e-2)
    assert (out - x @ weight.T).norm() / (x @ weight.T).norm() < 0.1
    # ... and the result is torchao's own MXFP8 product.
    assert torch.equal(out, _to_mxfp8_then_scaled_mm(
        x, weight, kernel_preference=KernelPreference.EMULATED, scale_calculation_mode=ScaleCalculationMode.RCEIL))
    out.sum().backward()
    assert model.layers["0"].wq.weight.grad.shape == (64, 64)
    # The state dict keeps high-precision values under the same names.
    assert torch.equal(model.state_dict()["layers.0.wq.weight"].float(), weight)


def test_converted_experts_run_their_grouped_gemm_in_mxfp8():
    torch.manual_seed(0)
    model, reference = _MoE(), _MoE()
    reference.load_state_dict(model.state_dict())
    apply_quantization(model, _config(experts=["experts"]))
    x = torch.randn(64, 64, requires_grad=True)
    counts = torch.tensor([16, 8, 24, 16])
    out, exact = model.layers["0"].experts(x, counts), reference.layers["0"].experts(x, counts)
    gap = float(((out - exact).norm() / exact.norm()).detach())
    assert 1e-3 < gap < 0.1, gap
    (out * torch.randn_like(out)).sum().backward()
    assert model.layers["0"].experts.w1.grad.shape == (4, 64, 64)


def test_bf16_autocast_reaches_the_mxfp8_linear_with_matching_dtypes():
    """Without FSDP2, bf16 runs under autocast with float32 weights; torchao's MXFP8 linear
    does not follow autocast, so titan widens the input to the weight's dtype."""
    model = _MoE()
    apply_quantization(model, _config(linear=EMULATED))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.layers["0"].wq(torch.randn(32, 64, dtype=torch.bfloat16))
    assert out.shape == (32, 64)


@pytest.mark.parametrize("recipe", ["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"])
def test_mxfp8_kernels_are_refused_without_an_sm100_gpu(recipe):
    for config, flag in [(_config(linear=recipe), "--quantize.linear.mx.recipe_name"),
                         (_config(experts=["experts"], recipe=recipe), "--quantize.grouped_mm.mx.recipe_name")]:
        with pytest.raises(ValueError, match=f"{flag} {recipe} needs torchao's MXFP8 kernels on an SM100 GPU.*"
                                             "this device is cpu.*mxfp8_emulated_rceil"):
            check_quantize_supported(config, torch.device("cpu"), uses_fully_shard=False)
        check_quantize_supported(config, None, uses_fully_shard=False)  # the dry run checks no device
    check_quantize_supported(_config(linear=EMULATED), torch.device("cpu"), uses_fully_shard=False)


def test_bad_mx_flags_are_refused_by_name():
    with pytest.raises(ValueError, match="--quantize.linear.mx.recipe_name='mxfp4' is unknown; choose one of "
                                         "mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, mxfp8_emulated_rceil"):
        MXLinearConfig(recipe_name="mxfp4")
    with pytest.raises(ValueError, match="--quantize.grouped_mm.mx.recipe_name='mxfp8' is unknown"):
        MXGroupedMMConfig(fqns=["experts"], recipe_name="mxfp8")
    with pytest.raises(ValueError, match="both convert the linears; choose one"):
        QuantizeLinearConfig(mx=MXLinearConfig(recipe_name=EMULATED), float8=_float8("rowwise"))


def _float8(recipe):
    from titan.train.quantize import Float8LinearConfig

    return Float8LinearConfig(recipe=recipe)
