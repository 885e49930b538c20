"""A tiny attention-like module using the "replicate" and "head_norm" tensor-parallel styles,
and the function its spawned gloo ranks run (importable by child processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, HEAD_DIM, RANK = 16, 4, 4, 3


class HeadNorm(nn.Module):
    """RMS norm over the last dim of [B, S, H, Dh] (as Qwen3's q/k norms)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HEAD_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


@dataclass(frozen=True)
class StylePlan:
    """Duck-typed ShardingPlan."""

    tensor_parallel: dict = field(default_factory=lambda: {
        "wq": "colwise", "q_norm": "head_norm", "wo": "rowwise", "down": "replicate", "up": "replicate",
    })
    fsdp_units: tuple = ()


class StyleBlock(nn.Module):
    """Per-head normed projection plus a replicated low-rank branch: `wo(norm(wq x)) + up(down x)`."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.q_norm = HeadNorm()
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.down = nn.Linear(DIM, RANK, bias=False)
        self.up = nn.Linear(RANK, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, -1, HEAD_DIM))
        return self.wo(q.reshape(b, s, -1)) + self.up(self.down(x))

    def sharding_plan(self) -> StylePlan:
        return StylePlan()


def make_block() -> StyleBlock:
    torch.manual_seed(0)
    block = StyleBlock()
    with torch.no_grad():
        block.q_norm.weight.uniform_(0.5, 1.5)  # not ones: its gradient must matter
    return block


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, DIM, generator=g), torch.randn(2, 5, DIM, generator=g)


def grads(block: nn.Module) -> dict[str, torch.Tensor]:
    """Loss and full gradients of one backward."""
    x, target = batch()
    loss = F.mse_loss(block(x), target)
    loss.backward()
    out = {"loss": loss.detach()}
    for name, p in block.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def tp_grads(rank: int, world: int) -> dict[str, torch.Tensor]:
    """The block under tensor parallel over all ranks (no sequence parallel)."""
    from titan.dist import ParallelismConfig, apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = ParallelismConfig(tensor_parallel_degree=world, enable_sequence_parallel=False,
                            enable_loss_parallel=False)
    block = apply_tensor_parallel(make_block(), mesh, cfg)
    return grads(block)


@dataclass(frozen=True)
class ScorePlan:
    """Duck-typed ShardingPlan of `ScoreModel`: a sharded pair of linears, a norm, a score head."""

    tensor_parallel: dict = field(default_factory=lambda: {
        "up": "colwise", "down": "rowwise", "norm": "norm", "score": "score",
    })
    fsdp_units: tuple = ()


class ScoreModel(nn.Module):
    """A residual stream ending in a one-column score head (a reward model's end):
    `score(norm(down(up x)))`, [B, S, 1]."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(4 * DIM, DIM, bias=False)
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.score = nn.Linear(DIM, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.norm(self.down(torch.relu(self.up(x)))))

    def sharding_plan(self) -> ScorePlan:
        return ScorePlan()


def make_score_model() -> ScoreModel:
    torch.manual_seed(0)
    model = ScoreModel()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    return model


def score_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Loss and full gradients of one backward of a loss on the scores; the scores themselves."""
    x, _ = batch()
    scores = model(x)
    out = {"scores": scores.detach()}
    target = torch.linspace(-1, 1, scores.numel()).view_as(scores)
    loss = ((scores - target) ** 2).mean()
    loss.backward()
    out["loss"] = loss.detach()
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def tp_score_grads(rank: int, world: int, sequence_parallel: bool) -> dict[str, torch.Tensor]:
    """`ScoreModel` under tensor parallel over all ranks, with or without sequence parallel."""
    from titan.dist import ParallelismConfig, apply_tensor_parallel
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    cfg = ParallelismConfig(tensor_parallel_degree=world, enable_sequence_parallel=sequence_parallel,
                            enable_loss_parallel=False)
    return score_grads(apply_tensor_parallel(make_score_model(), mesh, cfg))
