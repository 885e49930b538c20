"""Root-mean-square layer normalization."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale and no bias.

    The statistics are taken in float32 whatever the input dtype, because the mean of squares
    of bf16 activations loses too much precision; the result is cast back before scaling.
    In eager mode the backward is written out by hand (`_RMSNormFunction`): fewer kernels than
    autograd's chain of small ops, and only the input and one number per row kept for it. It
    runs on DTensors too (sequence parallel's sequence-sharded norms; their gradients equal one
    process's, tests/test_gradient_parity.py). Under `torch.compile`, which fuses the ops and
    derives the backward itself, the same formula runs through autograd
    (`rms_norm_reference`).
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim of `x` to unit RMS, then scale it."""
        if torch.compiler.is_compiling():
            return rms_norm_reference(x, self.weight, self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        """Set the scale to one (the identity at init)."""
        nn.init.ones_(self.weight)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as plain differentiable ops: float32 statistics, cast back, then the scale."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


class _RMSNormFunction(torch.autograd.Function):
    """`rms_norm_reference` with its backward written out.

    With r = 1 / sqrt(mean(x^2) + eps) per row and g' = g * weight (in float32):
    dL/dx = r * (g' - x * r^2 * mean(g' * x)), dL/dweight = sum over rows of g * (x * r).
    Saves x and r; the normalized rows are recomputed in the backward (one multiplication).
    Dtypes follow the reference's autograd exactly: products in the promoted dtype, the row
    statistics in float32, each gradient in its input's dtype.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, inv_rms)
        return (x32 * inv_rms).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, inv_rms = ctx.saved_tensors
        x32 = x.float()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            normed = (x32 * inv_rms).to(x.dtype)
            grad_weight = (grad * normed).sum(dim=tuple(range(grad.dim() - 1))).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # Autograd rounds this gradient to the normalized rows' dtype before the cast back.
            grad_normed = (grad * weight).to(x.dtype).float()
            row_dot = (grad_normed * x32).mean(-1, keepdim=True)
            grad_x = torch.addcmul(grad_normed, x32, row_dot * -(inv_rms * inv_rms)).mul_(inv_rms).to(x.dtype)
        return grad_x, grad_weight, None
