"""Quantized training through torchao, as a model conversion (``--quantize.*``).

The conversion runs on the whole model on the meta device, before any parallelism
(``parallelize``'s order starts with it): the converted ``Float8Linear`` modules are plain
``nn.Linear`` subclasses with the same parameter names and high-precision weights, so tensor
parallel, FSDP2, activation checkpointing and compile see ordinary linears, and checkpoints
stay in high precision (they load into a converted or an unconverted model alike).

Only the matmuls run in float8: each forward casts the input and the weight with dynamic
scales (one per tensor, ``tensorwise``; one per row, ``rowwise``) and calls
``torch._scaled_mm``; the backward's matmuls are float8 too (``rowwise_with_gw_hp`` keeps the
weight gradient's in high precision). What is never converted: the model's final projection
(its plan's ``output`` style: logits need the precision), the small linears the plan
replicates under tensor parallel (MoE routers), any module named in
``--quantize.linear.float8.filter_fqns``, and linears whose dimensions are not multiples of
16 (``_scaled_mm`` needs them). Embeddings and grouped experts are not linears and stay in
high precision.

torchao is an optional dependency (``pip install 'titan-train[float8]'``), imported only when
a recipe is set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from titan.dist.plan import match_modules, sharding_plan

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# Plan styles whose linears are never converted: the logits' projection, and the linears the
# plan keeps whole on every tensor-parallel rank (routers, low-rank projections).
_SKIPPED_PLAN_STYLES = ("output", "replicate")
_FLOAT8_DIM_MULTIPLE = 16
_INSTALL_HINT = "pip install 'titan-train[float8]' (torchao>=0.18)"


@dataclass(kw_only=True)
class Float8LinearConfig:
    """Float8 matmuls for the model's linears (``--quantize.linear.float8.*``)."""

    recipe: str | None = None
    """None (off), "tensorwise" (one dynamic scale per tensor; the fastest on H100),
    "rowwise" (one scale per row: closer to bf16) or "rowwise_with_gw_hp" (rowwise, with the
    weight gradient's matmul in high precision). torchtitan's --…float8.recipe_name."""
    filter_fqns: list[str] = field(default_factory=list)
    """Also keep these modules in high precision: a linear is skipped when any of these strings
    occurs in its fully-qualified name (e.g. "feed_forward.w2"). The output layer, routers
    and linears with dimensions not divisible by 16 are always skipped."""
    enable_fsdp_float8_all_gather: bool = False
    """tensorwise under FSDP2: cast the weight shards to float8 before the all-gather, halving
    its bytes against bf16."""
    precompute_float8_dynamic_scale_for_fsdp: bool = False
    """With the float8 all-gather: compute every weight's scale in one all-reduce after each
    optimizer step instead of one small all-reduce per weight in the forward."""

    emulate: bool = False
    """Run the float8 matmuls as high-precision matmuls of the float8-cast operands instead of
    the hardware float8 GEMM (torchao's ``emulate``; torchtitan's --…float8.emulate): the same
    casts and scales, so the same quantization error, but the product is accumulated in high
    precision. For tests and devices without a fast float8 GEMM — measured on CPU, torch 2.13's
    ``_scaled_mm`` takes ~24 ms for a 128 x 64 x 64 product (a reference kernel), which made
    one ``debugmodel_tiny`` step ~140x slower than bf16. Not a speed-up anywhere."""

    def __post_init__(self) -> None:
        if self.recipe is not None and self.recipe not in FLOAT8_RECIPES:
            raise ValueError(f"--quantize.linear.float8.recipe={self.recipe!r} is unknown; choose one of "
                             f"{', '.join(FLOAT8_RECIPES)} (or leave it unset for high precision)")
        if self.enable_fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise ValueError("--quantize.linear.float8.enable_fsdp_float8_all_gather needs "
                             f"--quantize.linear.float8.recipe tensorwise (got {self.recipe!r}): torchao "
                             "all-gathers float8 weights only with one scale per tensor")
        if self.emulate and self.recipe is None:
            raise ValueError("--quantize.linear.float8.emulate emulates the float8 matmuls of a recipe; set "
                             "--quantize.linear.float8.recipe too (or drop --quantize.linear.float8.emulate)")
        if self.precompute_float8_dynamic_scale_for_fsdp and not self.enable_fsdp_float8_all_gather:
            raise ValueError("--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp needs "
                             "--quantize.linear.float8.enable_fsdp_float8_all_gather")

    @property
    def enabled(self) -> bool:
        """Whether any linear is converted."""
        return self.recipe is not None


@dataclass(kw_only=True)
class QuantizeLinearConfig:
    """Low-precision training of the model's linear layers (``--quantize.linear.*``)."""

    float8: Float8LinearConfig = field(default_factory=Float8LinearConfig)


@dataclass(kw_only=True)
class QuantizeConfig:
    """Quantized training via torchao (``--quantize.*``); off by default."""

    linear: QuantizeLinearConfig = field(default_factory=QuantizeLinearConfig)

    @property
    def enabled(self) -> bool:
        """Whether any conversion is configured."""
        return self.linear.float8.enabled


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion did: the converted linears' names and why each other linear was
    skipped (``{name: reason}``)."""

    converted: tuple[str, ...]
    skipped: dict[str, str]
    high_precision_experts: int = 0
    """Grouped-experts modules (the plan's ``expert_modules``), which stay in high precision."""
    emulated: bool = False
    """Whether the float8 matmuls are emulated (``--quantize.linear.float8.emulate``)."""

    def summary(self, recipe: str) -> str:
        """One log line: how many linears run in float8, and the skipped ones by reason."""
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            by_reason.setdefault(reason, []).append(name)
        kept = "; ".join(f"{reason}: {len(names)} ({_abbreviate(names)})" for reason, names in by_reason.items())
        total = len(self.converted) + len(self.skipped)
        experts = (f"; {self.high_precision_experts} grouped-experts modules stay in high precision (no float8 "
                   "grouped GEMM yet)" if self.high_precision_experts else "")
        emulated = "; matmuls emulated in high precision (--quantize.linear.float8.emulate)" if self.emulated else ""
        return (f"float8 {recipe}: converted {len(self.converted)} of {total} linears"
                + (f"; kept in high precision, {kept}" if kept else "") + experts + emulated)


def _abbreviate(names: list[str], shown: int = 3) -> str:
    """The first few names of a list, and how many more."""
    head = ", ".join(names[:shown])
    return head + (f", +{len(names) - shown} more" if len(names) > shown else "")


def _skip_reason(fqn: str, module: nn.Linear, plan_skipped: frozenset[str], filter_fqns: list[str]) -> str | None:
    """Why linear ``fqn`` stays in high precision, or None when it is converted."""
    if fqn in plan_skipped:
        return "output layer or TP-replicated linear: router, low-rank projection (model plan)"
    if any(pattern in fqn for pattern in filter_fqns):
        return "--quantize.linear.float8.filter_fqns"
    if module.in_features % _FLOAT8_DIM_MULTIPLE or module.out_features % _FLOAT8_DIM_MULTIPLE:
        return f"dims not divisible by {_FLOAT8_DIM_MULTIPLE}"
    return None


def _plan_skipped_linears(model: nn.Module, plan) -> frozenset[str]:
    """Names the model's sharding plan marks as the output projection or replicated linears;
    without a plan, a top-level module named "output" (the usual final projection)."""
    if plan is None:
        return frozenset({"output"})
    return frozenset(fqn for pattern, style in plan.tensor_parallel.items() if style in _SKIPPED_PLAN_STYLES
                     for fqn, _ in match_modules(model, pattern))


def import_torchao_float8():
    """torchao's float8 module, or an ImportError naming the extra to install."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ImportError(f"--quantize.linear.float8.recipe needs torchao: {_INSTALL_HINT}") from error
    return float8


def check_quantize_supported(config: QuantizeConfig, device: torch.device, *, uses_fully_shard: bool) -> None:
    """Refuse, before any work, what this conversion cannot do here: a missing torchao, or
    float8 all-gather without FSDP2."""
    if not config.enabled:
        return
    import_torchao_float8()
    float8 = config.linear.float8
    if float8.enable_fsdp_float8_all_gather and not uses_fully_shard:
        raise ValueError("--quantize.linear.float8.enable_fsdp_float8_all_gather needs FSDP2 (a data-parallel "
                         "shard degree > 1); drop the flag or shard the model")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--quantize.linear.float8.recipe needs float8 tensor cores (sm89+: H100, L4, "
                         f"MI300), this GPU is sm{major}{minor}; leave the recipe unset")


def apply_quantization(model: nn.Module, config: QuantizeConfig) -> ConversionReport | None:
    """Convert ``model``'s linears in place as ``config`` says (before any parallelism; on the
    meta device is fine). Returns what was converted, or None when quantization is off."""
    float8 = config.linear.float8
    if not float8.enabled:
        return None
    ao = import_torchao_float8()
    converted, skipped = float8_linears(model, float8)
    ao_config = ao.Float8LinearConfig.from_recipe_name(float8.recipe)
    ao_config = dataclasses.replace(ao_config, enable_fsdp_float8_all_gather=float8.enable_fsdp_float8_all_gather,
                                    emulate=float8.emulate)
    to_convert = frozenset(converted)
    ao.convert_to_float8_training(model, config=ao_config, module_filter_fn=lambda _m, fqn: fqn in to_convert)
    experts_glob = getattr(sharding_plan(model), "expert_modules", None)
    experts = len(match_modules(model, experts_glob)) if experts_glob else 0
    return ConversionReport(converted=tuple(converted), skipped=skipped, high_precision_experts=experts,
                            emulated=float8.emulate)


def float8_linears(model: nn.Module, float8: Float8LinearConfig) -> tuple[list[str], dict[str, str]]:
    """The linears a float8 conversion of ``model`` would convert (names, in model order) and
    the others with the reason each stays in high precision; works on the meta device and
    does not need torchao (the planner counts float8 FLOPs with it)."""
    plan_skipped = _plan_skipped_linears(model, sharding_plan(model))  # once: each lookup walks the whole model
    converted, skipped = [], {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            reason = _skip_reason(fqn, module, plan_skipped, float8.filter_fqns)
            if reason is None:
                converted.append(fqn)
            else:
                skipped[fqn] = reason
    return converted, skipped


def precompute_float8_scales(model_parts: list[nn.Module], config: QuantizeConfig) -> None:
    """After an optimizer step, with ``precompute_float8_dynamic_scale_for_fsdp``: every float8
    weight's scale in one all-reduce (no-op otherwise)."""
    if config.linear.float8.precompute_float8_dynamic_scale_for_fsdp:
        ao = import_torchao_float8()
        for part in model_parts:
            ao.precompute_float8_dynamic_scale_for_fsdp(part)
