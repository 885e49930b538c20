"""The torchao float8 and MXFP8 conversions: which linears (and experts) they convert, what they
refuse, and that a converted module really computes in low precision (its output differs from
the high-precision one by the format's rounding, and equals torchao's own)."""

import sys
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn
from titan.models.common.moe import GroupedExperts
from titan.train.quantize import (
    Float8LinearConfig,
    MXGroupedMMConfig,
    MXLinearConfig,
    QuantizeConfig,
    QuantizeGroupedMMConfig,
    QuantizeLinearConfig,
    apply_quantization,
    check_quantize_supported,
    float8_linears,
    mx_linears,
    warn_if_float8_uncompiled,
)

pytest.importorskip("torchao.float8")


def _config(**float8) -> QuantizeConfig:
    return QuantizeConfig(linear=QuantizeLinearConfig(float8=Float8LinearConfig(**float8)))


@dataclass
class _Plan:
    tensor_parallel: dict[str, str] = field(default_factory=dict)
    expert_modules: str | None = None


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(64, 64, bias=False)
        self.w2 = nn.Linear(128, 64, bias=False)
        self.narrow = nn.Linear(64, 24, bias=False)  # 24 is not a multiple of 16
        self.gate = nn.Linear(64, 16, bias=False)  # a router: the plan replicates it


class _Model(nn.Module):
    """Two blocks, an embedding and an output projection, with a plan like a family's."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 64)
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.output = nn.Linear(64, 32, bias=False)

    def sharding_plan(self) -> _Plan:
        return _Plan({"layers.*.wq": "colwise", "layers.*.gate": "replicate", "output": "output"})


def _converted(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def test_converts_exactly_the_filtered_linears_on_the_meta_device():
    with torch.device("meta"):
        model = _Model()
    report = apply_quantization(model, _config(recipe="rowwise"))
    assert _converted(model) == ["layers.0.wq", "layers.0.w2", "layers.1.wq", "layers.1.w2"]
    assert list(report.converted) == _converted(model)
    assert report.skipped == {
        "layers.0.narrow": "dims not divisible by 16", "layers.0.gate": "output layer or TP-replicated linear: router, low-rank projection (model plan)",
        "layers.1.narrow": "dims not divisible by 16", "layers.1.gate": "output layer or TP-replicated linear: router, low-rank projection (model plan)",
        "output": "output layer or TP-replicated linear: router, low-rank projection (model plan)",
    }
    assert "converted 4 of 9 linears" in report.summary("rowwise")
    assert isinstance(model.tok_embeddings, nn.Embedding)


def test_float8_linears_names_what_the_conversion_converts():
    """The planner counts float8 FLOPs with `float8_linears`, without torchao: it names exactly
    the linears `apply_quantization` turns into Float8Linear, and why each other one stays."""
    with torch.device("meta"):
        model = _Model()
    names, skipped = float8_linears(model, Float8LinearConfig(recipe="tensorwise"))
    apply_quantization(model, _config(recipe="tensorwise"))
    assert names == _converted(model) == ["layers.0.wq", "layers.0.w2", "layers.1.wq", "layers.1.w2"]
    assert set(skipped) == {"layers.0.narrow", "layers.0.gate", "layers.1.narrow", "layers.1.gate", "output"}


def test_grouped_experts_are_reported_as_high_precision():
    class _MoE(_Model):
        def __init__(self) -> None:
            super().__init__()
            for block in self.layers.values():
                block.experts = nn.Module()  # stands for a GroupedExperts: no nn.Linear inside

        def sharding_plan(self) -> _Plan:
            return _Plan({"output": "output"}, expert_modules="layers.*.experts")

    report = apply_quantization(_MoE(), _config(recipe="rowwise"))
    assert report.high_precision_experts == 2
    assert "2 grouped-experts modules stay in high precision" in report.summary("rowwise")


def test_filter_fqns_keeps_named_linears_in_high_precision():
    model = _Model()
    report = apply_quantization(model, _config(recipe="tensorwise", filter_fqns=["w2"]))
    assert _converted(model) == ["layers.0.wq", "layers.1.wq"]
    assert report.skipped["layers.1.w2"] == "--quantize.linear.float8.filter_fqns"


def test_off_by_default_and_leaves_the_model_alone():
    model = _Model()
    assert apply_quantization(model, QuantizeConfig()) is None
    assert _converted(model) == []


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_converted_linear_computes_in_float8(recipe):
    from torchao.float8 import Float8LinearConfig as AOConfig
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    model = _Model()
    reference = nn.Sequential(nn.Linear(64, 64, bias=False))
    reference[0].weight.data.copy_(model.layers["0"].wq.weight)
    apply_quantization(model, _config(recipe=recipe))
    convert_to_float8_training(reference, config=AOConfig.from_recipe_name(recipe))
    x = torch.randn(32, 64)
    out = model.layers["0"].wq(x)
    # Float8 rounding is visible (e4m3 keeps 3 mantissa bits), and the result is torchao's own.
    exact = x @ model.layers["0"].wq.weight.T
    assert not torch.allclose(out, exact, rtol=1e-3, atol=1e-3)
    assert torch.equal(out, reference(x))
    # The state dict keeps high-precision weights under the same names.
    assert model.state_dict()["layers.0.wq.weight"].dtype == torch.float32


def test_emulate_reaches_torchao_and_rounds_like_the_float8_kernel():
    from torchao.float8 import Float8LinearConfig as AOConfig
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    kernel, emulated = _Model(), _Model()
    emulated.load_state_dict(kernel.state_dict())
    apply_quantization(kernel, _config(recipe="tensorwise"))
    report = apply_quantization(emulated, _config(recipe="tensorwise", emulate=True))
    assert "matmuls emulated" in report.summary("tensorwise")
    linear = emulated.layers["0"].wq
    assert linear.config.emulate and not kernel.layers["0"].wq.config.emulate
    reference = nn.Sequential(nn.Linear(64, 64, bias=False))
    reference[0].weight.data.copy_(linear.weight)
    convert_to_float8_training(reference, config=AOConfig.from_recipe_name("tensorwise"))
    x = torch.randn(32, 64)
    # Not the high-precision product: the operands were cast to float8 ...
    assert not torch.allclose(linear(x), x @ linear.weight.T, rtol=1e-3, atol=1e-3)
    # ... and the same casts as the kernel's: products of float8 values are exact in fp32, so
    # the two differ only in the order of a 64-term fp32 sum (a few ulps of the largest partial
    # sum), far below the float8 rounding of the assertion above.
    torch.testing.assert_close(linear(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flags, message", [
    (dict(emulate=True), "emulate emulates the float8 matmuls of a recipe"),
    (dict(recipe="fp4"), "recipe='fp4' is unknown"),
    (dict(recipe="rowwise", enable_fsdp_float8_all_gather=True), "needs --quantize.linear.float8.recipe tensorwise"),
    (dict(recipe="tensorwise", precompute_float8_dynamic_scale_for_fsdp=True),
     "needs --quantize.linear.float8.enable_fsdp_float8_all_gather"),
])
def test_bad_combinations_are_refused_by_name(flags, message):
    with pytest.raises(ValueError, match=message):
        Float8LinearConfig(**flags)


def test_float8_all_gather_without_fsdp_is_refused():
    config = _config(recipe="tensorwise", enable_fsdp_float8_all_gather=True)
    with pytest.raises(ValueError, match="needs FSDP2"):
        check_quantize_supported(config, torch.device("cpu"), uses_fully_shard=False)
    check_quantize_supported(config, torch.device("cpu"), uses_fully_shard=True)


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"titan-train\[float8\]"):
        check_quantize_supported(_config(recipe="rowwise"), torch.device("cpu"), uses_fully_shard=False)
    check_quantize_supported(QuantizeConfig(), torch.device("cpu"), uses_fully_shard=False)  # off: no import


# ---- MXFP8 (``--quantize.linear.mx``, ``--quantize.grouped_mm.mx``) ---------------------------
# A converted module really computes in MXFP8: its output differs from the high-precision one
# by MXFP8 rounding and equals torchao's own MXFP8 function.

EMULATED = "mxfp8_emulated_rceil"


def _mx_config(linear: str | None = None, experts: list[str] | None = None, recipe: str = EMULATED,
               **mx) -> QuantizeConfig:
    return QuantizeConfig(linear=QuantizeLinearConfig(mx=MXLinearConfig(recipe_name=linear, **mx)),
                          grouped_mm=QuantizeGroupedMMConfig(mx=MXGroupedMMConfig(fqns=experts or [], recipe_name=recipe)))


class _MXBlock(nn.Module):
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
        self.layers = nn.ModuleDict({"0": _MXBlock(), "1": _MXBlock()})
        self.output = nn.Linear(64, 32, bias=False)

    def sharding_plan(self) -> _Plan:
        return _Plan({"layers.*.gate": "replicate", "output": "output"}, expert_modules="layers.*.experts")


def _wrapped(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if type(p.data).__name__ == "MXFP8TrainingWeightWrapperTensor"]


def test_converts_exactly_the_filtered_linears_and_the_named_experts():
    torch.manual_seed(0)
    model = _MoE()
    report = apply_quantization(model, _mx_config(linear=EMULATED, experts=["layers.1.experts"], filter_fqns=["layers.1.wq"]))
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
    summary = report.summary(_mx_config(linear=EMULATED, experts=["x"]).recipe)
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
    apply_quantization(model, _mx_config(linear=EMULATED))
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
    apply_quantization(model, _mx_config(experts=["experts"]))
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
    apply_quantization(model, _mx_config(linear=EMULATED))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.layers["0"].wq(torch.randn(32, 64, dtype=torch.bfloat16))
    assert out.shape == (32, 64)


@pytest.mark.parametrize("recipe", ["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"])
def test_mxfp8_kernels_are_refused_without_an_sm100_gpu(recipe):
    for config, flag in [(_mx_config(linear=recipe), "--quantize.linear.mx.recipe_name"),
                         (_mx_config(experts=["experts"], recipe=recipe), "--quantize.grouped_mm.mx.recipe_name")]:
        with pytest.raises(ValueError, match=f"{flag} {recipe} needs torchao's MXFP8 kernels on an SM100 GPU.*"
                                             "this device is cpu.*mxfp8_emulated_rceil"):
            check_quantize_supported(config, torch.device("cpu"), uses_fully_shard=False)
        check_quantize_supported(config, None, uses_fully_shard=False)  # the dry run checks no device
    check_quantize_supported(_mx_config(linear=EMULATED), torch.device("cpu"), uses_fully_shard=False)


def test_bad_mx_flags_are_refused_by_name():
    with pytest.raises(ValueError, match="--quantize.linear.mx.recipe_name='mxfp4' is unknown; choose one of "
                                         "mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, mxfp8_emulated_rceil"):
        MXLinearConfig(recipe_name="mxfp4")
    with pytest.raises(ValueError, match="--quantize.grouped_mm.mx.recipe_name='mxfp8' is unknown"):
        MXGroupedMMConfig(fqns=["experts"], recipe_name="mxfp8")
    with pytest.raises(ValueError, match="both convert the linears; choose one"):
        QuantizeLinearConfig(mx=MXLinearConfig(recipe_name=EMULATED), float8=Float8LinearConfig(recipe="rowwise"))


def test_float8_experts_are_converted_and_refused_where_the_kernel_cannot_run():
    """torchao's float8 grouped GEMM runs on Triton on SM90+ GPUs: the conversion wraps the
    named experts' weights (checked here on CPU, without running them), and a run on a device
    without the kernel is refused before any work (the dry run checks no device)."""
    from titan.train.quantize import Float8GroupedMMConfig

    config = QuantizeConfig(grouped_mm=QuantizeGroupedMMConfig(float8=Float8GroupedMMConfig(fqns=["layers.0.experts"])))
    model = _MoE()
    report = apply_quantization(model, config)
    assert report.converted_experts == ("layers.0.experts",) and report.high_precision_experts == 1
    assert report.summary(config.recipe) == ("float8 rowwise experts: converted 1 grouped-experts modules; "
                                             "1 grouped-experts modules stay in high precision")
    wrapped = [name for name, p in model.named_parameters() if type(p.data).__name__ == "Float8TrainingWeightWrapperTensor"]
    assert wrapped == ["layers.0.experts.w1", "layers.0.experts.w2", "layers.0.experts.w3"]
    with pytest.raises(ValueError, match="needs torchao's float8 grouped GEMM .* SM90\\+ GPU.*this device is cpu"):
        check_quantize_supported(config, torch.device("cpu"), uses_fully_shard=False)
    check_quantize_supported(config, None, uses_fully_shard=False)
    with pytest.raises(ValueError, match="both convert the experts' grouped GEMMs; choose one"):
        QuantizeGroupedMMConfig(float8=Float8GroupedMMConfig(fqns=["experts"]), mx=MXGroupedMMConfig(fqns=["experts"]))


def test_expert_names_that_match_nothing_are_refused():
    """A grouped-GEMM flag whose names match no experts would convert nothing silently."""
    with pytest.raises(ValueError, match=r"--quantize.grouped_mm.mx.fqns expert_ffn matches none of the model's "
                                         r"grouped-experts modules \(layers.0.experts, layers.1.experts\)"):
        apply_quantization(_MoE(), _mx_config(experts=["expert_ffn"]))
    with pytest.raises(ValueError, match="it has none: not a MoE model"):
        apply_quantization(_Model(), _mx_config(experts=["experts"]))


def test_float8_without_compile_on_a_gpu_is_warned_about(caplog):
    """Valid, but slower than bf16 on a GPU (measured: tools/bench/RESULTS.md): said once, at
    start-up; not on CPU (a reference kernel anyway), not when compiled, not without float8."""
    float8 = QuantizeConfig(linear=QuantizeLinearConfig(float8=Float8LinearConfig(recipe="rowwise")))
    gpu = torch.device("cuda", 0)  # a device object only: nothing runs on it
    with caplog.at_level("WARNING", logger="titan"):
        message = warn_if_float8_uncompiled(float8, gpu, compiled=False)
    assert message and "--compile.enable" in message and message in caplog.text
    assert warn_if_float8_uncompiled(float8, gpu, compiled=True) is None
    assert warn_if_float8_uncompiled(float8, torch.device("cpu"), compiled=False) is None
    assert warn_if_float8_uncompiled(QuantizeConfig(), gpu, compiled=False) is None
