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

MXFP8 (``--quantize.linear.mx.recipe_name``, ``--quantize.grouped_mm.mx.fqns``) goes through
torchao's ``MXFP8TrainingOpConfig`` instead: the weights stay high-precision ``nn.Parameter``s
whose data is a torchao wrapper tensor that sends the linear's matmul (and the experts'
grouped GEMM) to MXFP8 kernels with one e8m0 scale per 32 elements. Those kernels need an
SM100 GPU (B200); elsewhere the MXFP8 recipes are refused, and the ``mxfp8_emulated_rceil``
recipe runs the same quantization with PyTorch ops for tests (never a speed-up).
``--quantize.grouped_mm.float8.fqns`` gives the experts torchao's float8 wrapper instead (float8
grouped GEMMs with one scale per row), which runs on Triton kernels on SM90+ GPUs only and is
refused elsewhere.

torchao is an optional dependency (``pip install 'titan-train[float8]'``), imported only when
a recipe is set.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from titan.dist.plan import match_modules, sharding_plan

FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# Plan styles whose linears are never converted: the logits' projection, and the linears the
# plan keeps whole on every tensor-parallel rank (routers, low-rank projections).
_SKIPPED_PLAN_STYLES = ("output", "score", "replicate")
_FLOAT8_DIM_MULTIPLE = 16
_INSTALL_HINT = "pip install 'titan-train[float8]' (torchao>=0.18)"
MX_RECIPES = ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp", "mxfp8_emulated_rceil")
"""torchao 0.18's MXFP8 training recipes (``MXFP8TrainingRecipe``): e8m0 scales rounded up
(RCEIL); the second keeps the weight gradient's matmul in high precision; the third emulates
the MXFP8 GEMMs with PyTorch ops on any device."""
_MX_BLOCK = 32
"""Elements per MXFP8 scale: a converted linear's dimensions must be multiples of it."""
_MX_CAPABILITY = (10, 0)
"""The CUDA compute capability of torchao's MXFP8 GEMMs (SM100: B200, GB200)."""


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


def _check_mx_recipe(flag: str, recipe: str | None) -> None:
    if recipe is not None and recipe not in MX_RECIPES:
        raise ValueError(f"{flag}={recipe!r} is unknown; choose one of {', '.join(MX_RECIPES)} (torchao's "
                         f"MXFP8 training recipes){' or leave it unset' if flag.endswith('linear.mx.recipe_name') else ''}")


@dataclass(kw_only=True)
class MXLinearConfig:
    """MXFP8 matmuls for the model's linears (``--quantize.linear.mx.*``, torchtitan's names)."""

    recipe_name: str | None = None
    """None (off), "mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp" (weight gradient in high
    precision) — both need an SM100 GPU — or "mxfp8_emulated_rceil" (the same quantization
    with PyTorch ops, on any device: for tests, never a speed-up)."""
    filter_fqns: list[str] = field(default_factory=list)
    """Also keep these modules in high precision (a linear is skipped when any of these strings
    occurs in its name). The output layer, routers and linears with dimensions not divisible
    by 32 (one MXFP8 scale per 32 elements) are always skipped."""

    def __post_init__(self) -> None:
        _check_mx_recipe("--quantize.linear.mx.recipe_name", self.recipe_name)

    @property
    def enabled(self) -> bool:
        """Whether any linear is converted."""
        return self.recipe_name is not None


@dataclass(kw_only=True)
class QuantizeLinearConfig:
    """Low-precision training of the model's linear layers (``--quantize.linear.*``)."""

    float8: Float8LinearConfig = field(default_factory=Float8LinearConfig)
    mx: MXLinearConfig = field(default_factory=MXLinearConfig)

    def __post_init__(self) -> None:
        if self.float8.enabled and self.mx.enabled:
            raise ValueError(f"--quantize.linear.float8.recipe {self.float8.recipe} and --quantize.linear.mx.recipe_name "
                             f"{self.mx.recipe_name} both convert the linears; choose one")


@dataclass(kw_only=True)
class Float8GroupedMMConfig:
    """Float8 (rowwise) grouped GEMMs for MoE experts (``--quantize.grouped_mm.float8.*``,
    torchtitan's names). torchao 0.18 runs them with Triton kernels on SM90+ GPUs only."""

    fqns: list[str] = field(default_factory=list)
    """Grouped-experts modules to convert: those whose name contains any of these strings
    (e.g. "experts"); empty: none."""

    @property
    def enabled(self) -> bool:
        """Whether any experts are converted."""
        return bool(self.fqns)


@dataclass(kw_only=True)
class MXGroupedMMConfig(Float8GroupedMMConfig):
    """MXFP8 grouped GEMMs for MoE experts (``--quantize.grouped_mm.mx.*``, torchtitan's names):
    the experts chosen as for float8, in one of the MXFP8 recipes."""

    recipe_name: str = "mxfp8_rceil"
    """One of the MXFP8 recipes (see ``--quantize.linear.mx.recipe_name``); "mxfp8_emulated_rceil"
    runs on any device."""

    def __post_init__(self) -> None:
        _check_mx_recipe("--quantize.grouped_mm.mx.recipe_name", self.recipe_name)


@dataclass(kw_only=True)
class QuantizeGroupedMMConfig:
    """Low-precision grouped GEMMs of MoE experts (``--quantize.grouped_mm.*``)."""

    float8: Float8GroupedMMConfig = field(default_factory=Float8GroupedMMConfig)
    mx: MXGroupedMMConfig = field(default_factory=MXGroupedMMConfig)

    def __post_init__(self) -> None:
        if self.float8.enabled and self.mx.enabled:
            raise ValueError("--quantize.grouped_mm.float8.fqns and --quantize.grouped_mm.mx.fqns both convert the "
                             "experts' grouped GEMMs; choose one")


@dataclass(kw_only=True)
class QuantizeConfig:
    """Quantized training via torchao (``--quantize.*``); off by default."""

    linear: QuantizeLinearConfig = field(default_factory=QuantizeLinearConfig)
    grouped_mm: QuantizeGroupedMMConfig = field(default_factory=QuantizeGroupedMMConfig)

    @property
    def enabled(self) -> bool:
        """Whether any conversion is configured."""
        return (self.linear.float8.enabled or self.linear.mx.enabled or self.grouped_mm.float8.enabled
                or self.grouped_mm.mx.enabled)

    @property
    def recipe(self) -> str:
        """The conversions' names, for log lines: e.g. "float8 rowwise", "mxfp8_rceil linears + experts"."""
        parts = []
        if self.linear.float8.enabled:
            parts.append(f"float8 {self.linear.float8.recipe}")
        if self.linear.mx.enabled:
            parts.append(f"{self.linear.mx.recipe_name} linears")
        if self.grouped_mm.float8.enabled:
            parts.append("float8 rowwise experts")
        if self.grouped_mm.mx.enabled:
            parts.append(f"{self.grouped_mm.mx.recipe_name} experts")
        return " + ".join(parts)


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion did: the converted linears' names and why each other linear was
    skipped (``{name: reason}``); the grouped-experts modules converted and kept."""

    converted: tuple[str, ...]
    skipped: dict[str, str]
    high_precision_experts: int = 0
    """Grouped-experts modules (the plan's ``expert_modules``) left in high precision."""
    emulated: bool = False
    """Whether the low-precision matmuls are emulated in high precision."""
    converted_experts: tuple[str, ...] = ()
    """Grouped-experts modules whose grouped GEMMs run in low precision (MXFP8 or float8)."""

    def summary(self, recipe: str) -> str:
        """One log line: how many linears (and experts) run in low precision, and the skipped
        ones by reason."""
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            by_reason.setdefault(reason, []).append(name)
        kept = "; ".join(f"{reason}: {len(names)} ({_abbreviate(names)})" for reason, names in by_reason.items())
        total = len(self.converted) + len(self.skipped)
        parts = [f"{len(self.converted)} of {total} linears"] if self.converted or self.skipped else []
        if self.converted_experts:
            parts.append(f"{len(self.converted_experts)} grouped-experts modules")
        converted = "converted " + " and ".join(parts)
        experts = (f"; {self.high_precision_experts} grouped-experts modules stay in high precision"
                   if self.high_precision_experts else "")
        emulated = "; matmuls emulated in high precision (tests only, not a speed-up)" if self.emulated else ""
        return (f"{recipe}: {converted}" + (f"; kept in high precision, {kept}" if kept else "") + experts
                + emulated)


def _abbreviate(names: list[str], shown: int = 3) -> str:
    """The first few names of a list, and how many more."""
    head = ", ".join(names[:shown])
    return head + (f", +{len(names) - shown} more" if len(names) > shown else "")


def _skip_reason(fqn: str, module: nn.Linear, plan_skipped: frozenset[str], filter_fqns: list[str], *,
                 filter_flag: str, dim_multiple: int) -> str | None:
    """Why linear ``fqn`` stays in high precision, or None when it is converted."""
    if fqn in plan_skipped:
        return "output layer or TP-replicated linear: router, low-rank projection (model plan)"
    if any(pattern in fqn for pattern in filter_fqns):
        return filter_flag
    if module.in_features % dim_multiple or module.out_features % dim_multiple:
        return f"dims not divisible by {dim_multiple}"
    return None


def _plan_skipped_linears(model: nn.Module, plan) -> frozenset[str]:
    """Names the model's sharding plan marks as the output projection or replicated linears;
    without a plan, a top-level module named "output" (the usual final projection)."""
    if plan is None:
        return frozenset({"output"})
    return frozenset(fqn for pattern, style in plan.tensor_parallel.items() if style in _SKIPPED_PLAN_STYLES
                     for fqn, _ in match_modules(model, pattern))


class MissingExtraError(ImportError):
    """A flag needs an optional dependency that is not installed; the message names the pip
    extra (the CLI prints it as one line, exit code 2)."""


def float8_available() -> bool:
    """Whether torchao's float8 training can be imported (the `titan-train[float8]` extra)."""
    try:
        import_torchao_float8()
    except MissingExtraError:
        return False
    return True


def import_torchao_float8():
    """torchao's float8 module, or a MissingExtraError naming the extra to install."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise MissingExtraError(f"--quantize.linear.float8.recipe needs torchao: {_INSTALL_HINT}") from error
    return float8


def import_torchao_mx():
    """torchao's MXFP8 training module (config and recipes), or a MissingExtraError naming the extra."""
    try:
        import torchao.prototype.moe_training.config as mx
        from torchao.quantization import quantize_
    except ImportError as error:
        raise MissingExtraError(f"MXFP8 and grouped-GEMM training (--quantize.linear.mx, --quantize.grouped_mm.*) "
                                f"needs torchao: {_INSTALL_HINT}") from error
    return mx, quantize_


def check_quantize_installed(config: QuantizeConfig) -> None:
    """Import what the configured conversions need, or raise a MissingExtraError naming the
    extra (before any work: the run would fail at the model's conversion)."""
    if config.linear.float8.enabled:
        import_torchao_float8()
    if _mx_recipes(config) or config.grouped_mm.float8.enabled:
        import_torchao_mx()


def _mx_recipes(config: QuantizeConfig) -> list[tuple[str, str]]:
    """(flag, recipe) of each MXFP8 conversion configured."""
    recipes = []
    if config.linear.mx.enabled:
        recipes.append(("--quantize.linear.mx.recipe_name", config.linear.mx.recipe_name))
    if config.grouped_mm.mx.enabled:
        recipes.append(("--quantize.grouped_mm.mx.recipe_name", config.grouped_mm.mx.recipe_name))
    return recipes


def check_quantize_supported(config: QuantizeConfig, device: torch.device | None, *, uses_fully_shard: bool) -> None:
    """Refuse, before any work, what this conversion cannot do here: a missing torchao, float8
    all-gather without FSDP2, or low-precision kernels ``device`` lacks (None: the dry run,
    which checks a layout for another machine, skips the device)."""
    if not config.enabled:
        return
    check_quantize_installed(config)
    check_quantize_layout(config, uses_fully_shard=uses_fully_shard)
    if device is None:
        return
    float8 = config.linear.float8
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    here = f"sm{capability[0]}{capability[1]}" if capability else device.type
    if float8.enabled and capability is not None and capability < (8, 9):
        raise ValueError(f"--quantize.linear.float8.recipe needs float8 tensor cores (sm89+: H100, L4, "
                         f"MI300), this GPU is {here}; leave the recipe unset")
    if config.grouped_mm.float8.enabled and not _float8_grouped_gemm_runs(capability):
        raise ValueError("--quantize.grouped_mm.float8.fqns needs torchao's float8 grouped GEMM (Triton kernels on "
                         f"an SM90+ GPU: H100, H200, B200); this device is {here}{'' if _has_triton() else ' without Triton'}. "
                         "Leave it unset; --quantize.grouped_mm.mx.recipe_name mxfp8_emulated_rceil tests grouped-GEMM "
                         "quantization on any device")
    for flag, recipe in _mx_recipes(config):
        if recipe != "mxfp8_emulated_rceil" and (capability is None or capability < _MX_CAPABILITY):
            raise ValueError(f"{flag} {recipe} needs torchao's MXFP8 kernels on an SM100 GPU (B200, GB200); this "
                             f"device is {here}. Leave it unset, or use mxfp8_emulated_rceil to test the numerics "
                             "(PyTorch ops, slower than high precision)")


def check_quantize_layout(config: QuantizeConfig, *, uses_fully_shard: bool) -> None:
    """Refuse what the conversion cannot do on a layout, wherever it runs: float8's FSDP
    all-gather without FSDP2 sharding the parameters."""
    if config.linear.float8.enable_fsdp_float8_all_gather and not uses_fully_shard:
        raise ValueError("--quantize.linear.float8.enable_fsdp_float8_all_gather needs FSDP2 (a data-parallel "
                         "shard degree > 1); drop the flag or shard the model")


UNCOMPILED_FLOAT8_WARNING = (
    "float8 linears without --compile.enable: torchao's casts and scales then run as separate "
    "kernels, slower than bf16 (Llama 3.2 1B on an H200: 0.42x the bf16 step tensorwise, 0.34x "
    "rowwise; compiled per block 1.02x and 0.85x the compiled bf16 step). Add --compile.enable")


def warn_if_float8_uncompiled(config: QuantizeConfig, device: torch.device, *, compiled: bool) -> str | None:
    """Warn (and return the warning) when float8 linears will run on a GPU without compile:
    valid, but slower than not converting at all (measured in tools/bench/RESULTS.md)."""
    if not config.linear.float8.enabled or compiled or device.type != "cuda":
        return None
    logging.getLogger("titan").warning(UNCOMPILED_FLOAT8_WARNING)
    return UNCOMPILED_FLOAT8_WARNING


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _float8_grouped_gemm_runs(capability: tuple[int, int] | None) -> bool:
    """Whether torchao 0.18's float8 rowwise grouped GEMM can run: Triton, on an SM90+ GPU."""
    return capability is not None and capability >= (9, 0) and _has_triton()


def apply_quantization(model: nn.Module, config: QuantizeConfig) -> ConversionReport | None:
    """Convert ``model``'s linears (and experts) in place as ``config`` says (before any
    parallelism; on the meta device is fine). Returns what was converted, or None when
    quantization is off."""
    if not config.enabled:
        return None
    converted: list[str] = []
    skipped: dict[str, str] = {}
    float8, mx_linear = config.linear.float8, config.linear.mx
    if float8.enabled:
        ao = import_torchao_float8()
        converted, skipped = float8_linears(model, float8)
        ao_config = ao.Float8LinearConfig.from_recipe_name(float8.recipe)
        ao_config = dataclasses.replace(ao_config, enable_fsdp_float8_all_gather=float8.enable_fsdp_float8_all_gather,
                                        emulate=float8.emulate)
        to_convert = frozenset(converted)
        ao.convert_to_float8_training(model, config=ao_config, module_filter_fn=lambda _m, fqn: fqn in to_convert)
    elif mx_linear.enabled:
        converted, skipped = mx_linears(model, mx_linear)
        _convert_mx(model, mx_linear.recipe_name, frozenset(converted))
    experts = expert_modules(model)
    grouped = config.grouped_mm
    patterns = grouped.mx.fqns + grouped.float8.fqns
    converted_experts = [fqn for fqn in experts if any(p in fqn for p in patterns)]
    if patterns and not converted_experts:
        flag = "--quantize.grouped_mm.mx.fqns" if grouped.mx.enabled else "--quantize.grouped_mm.float8.fqns"
        raise ValueError(f"{flag} {' '.join(patterns)} matches none of the model's grouped-experts modules "
                         f"({_abbreviate(experts) if experts else 'it has none: not a MoE model'})")
    if converted_experts and grouped.mx.enabled:
        _convert_mx(model, grouped.mx.recipe_name, frozenset(converted_experts))
    elif converted_experts:  # float8 rowwise
        mx, _ = import_torchao_mx()
        _wrap_weights(model, mx.Float8TrainingOpConfig.from_recipe(mx.Float8TrainingRecipe.FP8_ROWWISE),
                      frozenset(converted_experts))
    emulated = float8.emulate or any(recipe == "mxfp8_emulated_rceil" for _, recipe in _mx_recipes(config))
    return ConversionReport(converted=tuple(converted), skipped=skipped,
                            high_precision_experts=len(experts) - len(converted_experts), emulated=emulated,
                            converted_experts=tuple(converted_experts))


def _convert_mx(model: nn.Module, recipe: str, names: frozenset[str]) -> None:
    """Give the modules ``names`` torchao's MXFP8 weight wrappers (``recipe``); a converted
    linear also widens a bf16 input to its weight's dtype under autocast."""
    mx, _ = import_torchao_mx()
    ao_config = mx.MXFP8TrainingOpConfig.from_recipe(mx.MXFP8TrainingRecipe(recipe))
    # Token groups of any size: the experts' grouped GEMM pads each to the 32-row scale block.
    _wrap_weights(model, dataclasses.replace(ao_config, pad_token_groups_for_grouped_mm=True), names)
    for fqn, module in model.named_modules():
        if fqn in names and isinstance(module, nn.Linear):
            module.register_forward_pre_hook(_input_in_weight_dtype)


def _wrap_weights(model: nn.Module, ao_config, names: frozenset[str]) -> None:
    """Swap the data of the modules ``names``' parameters for ``ao_config``'s torchao training
    wrapper (MXFP8 or float8): the parameters keep their names and high-precision values,
    and their matmuls and grouped GEMMs run in low precision."""
    _, quantize_ = import_torchao_mx()
    quantize_(model, ao_config, filter_fn=lambda _module, fqn: fqn in names)


def _input_in_weight_dtype(module: nn.Linear, args: tuple) -> tuple | None:
    """Under autocast (mixed precision without FSDP2), a bf16 input meets the float32 weight:
    torchao 0.18's MXFP8 linear does not follow autocast and would multiply mismatched dtypes.
    Both operands are quantized to MXFP8 anyway, so the input is widened (exactly) to the
    weight's dtype instead; under FSDP2's policy the two already match and nothing changes."""
    x = args[0]
    if x.dtype != module.weight.dtype and torch.is_autocast_enabled(x.device.type):
        return (x.to(module.weight.dtype), *args[1:])
    return None


def expert_modules(model: nn.Module) -> list[str]:
    """Names of the model's grouped-experts modules (its plan's ``expert_modules``)."""
    glob = getattr(sharding_plan(model), "expert_modules", None)
    return [fqn for fqn, module in match_modules(model, glob) if module is not None] if glob else []


def mx_linears(model: nn.Module, mx: MXLinearConfig) -> tuple[list[str], dict[str, str]]:
    """The linears an MXFP8 conversion of ``model`` converts (names, in model order) and the
    others with the reason each stays in high precision; no torchao needed."""
    return _convertible_linears(model, mx.filter_fqns, "--quantize.linear.mx.filter_fqns", _MX_BLOCK)


def float8_linears(model: nn.Module, float8: Float8LinearConfig) -> tuple[list[str], dict[str, str]]:
    """The linears a float8 conversion of ``model`` would convert (names, in model order) and
    the others with the reason each stays in high precision; works on the meta device and
    does not need torchao (the planner counts float8 FLOPs with it)."""
    return _convertible_linears(model, float8.filter_fqns, "--quantize.linear.float8.filter_fqns",
                                _FLOAT8_DIM_MULTIPLE)


def _convertible_linears(model: nn.Module, filter_fqns: list[str], filter_flag: str,
                         dim_multiple: int) -> tuple[list[str], dict[str, str]]:
    plan_skipped = _plan_skipped_linears(model, sharding_plan(model))  # once: each lookup walks the whole model
    converted, skipped = [], {}
    for fqn, module in model.named_modules():
        if isinstance(module, nn.Linear):
            reason = _skip_reason(fqn, module, plan_skipped, filter_fqns, filter_flag=filter_flag,
                                  dim_multiple=dim_multiple)
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
