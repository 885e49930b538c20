"""AdamW with parameter groups that exempt chosen kinds (norms, biases, embeddings by default)
from weight decay."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

Implementation = Literal["auto", "foreach", "fused", "for-loop"]


EXEMPT_KINDS = ("embeddings", "norms", "biases")
"""What ``--optimizer.weight_decay_exempt`` can name (all three by default)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW hyper-parameters (``--optimizer.*``)."""

    name: Literal["AdamW"] = "AdamW"
    """Optimizer family. Only AdamW for now."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on every parameter but the kinds `weight_decay_exempt` names."""
    weight_decay_exempt: list[str] = field(default_factory=lambda: list(EXEMPT_KINDS))
    """Parameter kinds trained without weight decay: any of "embeddings" (the embedding
    tables), "norms" (norm scales and other one-dimensional weights), "biases"; "none" decays
    every parameter, as torchtitan does (transformers' Trainer exempts norms and biases;
    Megatron-LM the same)."""
    implementation: Implementation = "auto"
    """Kernel: "fused" (one kernel for all params), "foreach" (batched), "for-loop";
    "auto" picks fused on CUDA and CPU (on CPU 4-6x faster than foreach, measured on the
    debug model's 4.9M parameters: 2 vs 8-13 ms a step) and foreach elsewhere."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"--optimizer.lr must be > 0, got {self.lr}")
        for flag, beta in (("beta1", self.beta1), ("beta2", self.beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"--optimizer.{flag} must be in [0, 1), got {beta}")
        if self.eps <= 0:
            raise ValueError(f"--optimizer.eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise ValueError(f"--optimizer.weight_decay must be >= 0, got {self.weight_decay}")
        if self.weight_decay_exempt == ["none"]:
            self.weight_decay_exempt = []
        unknown = sorted(set(self.weight_decay_exempt) - set(EXEMPT_KINDS))
        if unknown:
            raise ValueError(f"--optimizer.weight_decay_exempt takes {', '.join(EXEMPT_KINDS)} or none, "
                             f"got {unknown}")


def split_decay_groups(
    modules: Iterable[nn.Module], exempt_kinds: Iterable[str] = EXEMPT_KINDS
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Split trainable parameters into (decayed, exempt), exempting the `exempt_kinds`.

    Kinds: "embeddings" (every parameter of an ``nn.Embedding``), "biases" (parameters named
    ``bias``), "norms" (every other parameter with fewer than two dims: norm scales). Decided
    by module type, name and shape, so it holds for any model family and survives FSDP/TP
    wrapping.
    """
    kinds = set(exempt_kinds)
    decay: list[nn.Parameter] = []
    exempt: list[nn.Parameter] = []
    seen: set[int] = set()
    for root in modules:
        for module in root.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                (exempt if _kind(module, name, param) in kinds else decay).append(param)
    return decay, exempt


def _kind(module: nn.Module, name: str, param: nn.Parameter) -> str | None:
    """The exemptible kind of `module`'s parameter `name`, or None for a weight matrix."""
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if name == "bias":
        return "biases"
    return "norms" if param.ndim < 2 else None


FUSED_BY_DEFAULT = ("cuda", "cpu")
"""Device types whose AdamW step "auto" runs fused (measured faster than foreach there)."""


def _kernel_flags(cfg: OptimizerConfig, device_type: str) -> dict[str, bool]:
    choice = cfg.implementation
    if choice == "auto":
        choice = "fused" if device_type in FUSED_BY_DEFAULT else "foreach"
    return {"fused": choice == "fused", "foreach": choice == "foreach"}


def _by_tensor_kind(group: dict) -> list[dict]:
    """`group` split into its DTensor and plain-tensor parameters where it holds both (empty
    when it holds none): the fused and foreach AdamW kernels refuse a mix, which tensor
    parallel alone leaves on MoE models (the routed experts stay plain tensors). Groups of one
    kind stay whole, so layouts without the mix keep their optimizer state layout."""
    dtensors = [p for p in group["params"] if isinstance(p, DTensor)]
    plain = [p for p in group["params"] if not isinstance(p, DTensor)]
    return [{**group, "params": params} for params in (dtensors, plain) if params]


def build_optimizer(cfg: OptimizerConfig, model_parts: list[nn.Module], device_type: str) -> torch.optim.Optimizer:
    """Build AdamW over every model part with decay/no-decay groups."""
    decay, exempt = split_decay_groups(model_parts, cfg.weight_decay_exempt)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": exempt, "weight_decay": 0.0},
    ]
    groups = [part for g in groups for part in _by_tensor_kind(g)]
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **_kernel_flags(cfg, device_type),
    )
