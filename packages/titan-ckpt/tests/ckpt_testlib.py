"""Tiny models and a training loop for the checkpoint tests (no model family involved)."""

from __future__ import annotations

import torch
import torch.nn as nn
from titan.ckpt import CheckpointConfig, CheckpointManager, OptimizerWrapper, TrainState

DIM, VOCAB, SEQ, BATCH = 32, 64, 16, 4


class Block(nn.Module):
    """A residual MLP block with dropout, so that resuming needs the RNG state too."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class TinyLM(nn.Module):
    """Embedding -> blocks -> output: FQNs like a real language model's."""

    def __init__(self, dim: int = DIM, vocab: int = VOCAB, n_layers: int = 2,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, dropout) for i in range(n_layers)})
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(h)


class CountingLoader:
    """A resumable data source: batch i is a pure function of (seed, i)."""

    def __init__(self, seed: int = 0, dp_rank: int = 0) -> None:
        self.seed, self.dp_rank, self.pos = seed, dp_rank, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.dp_rank * 7919 + self.pos)
        self.pos += 1
        return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)

    def state_dict(self) -> dict:
        return {"pos": self.pos, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.pos, self.seed = state["pos"], state["seed"]


class NamesAsIs:
    """A Hugging Face adapter for a model whose names are kept as they are."""

    def to_hf(self, sd: dict) -> dict:
        return dict(sd)

    def from_hf(self, sd: dict) -> dict:
        return dict(sd)

    def hf_config(self) -> dict:
        return {"model_type": "tiny"}


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    """The AdamW + warmup schedule every test run uses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return opt, sched


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of a [B, S+1] token batch."""
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


class Run:
    """Everything a trainer would hand to the checkpoint manager, for one tiny model."""

    def __init__(self, cfg: CheckpointConfig, dump_folder: str, *, seed: int = 0,
                 model: nn.Module | None = None, **manager_kwargs) -> None:
        torch.manual_seed(seed)
        self.model = model if model is not None else TinyLM()
        self.opt, self.sched = make_optimizer(self.model)
        self.loader = CountingLoader(seed)
        self.train_state = TrainState()
        self.manager = CheckpointManager(
            cfg, dump_folder=dump_folder,
            states={"lr_scheduler": self.sched, "dataloader": self.loader,
                    "train_state": self.train_state},
            model_parts=[self.model], optimizers=OptimizerWrapper(self.model, self.opt),
            **manager_kwargs,
        )

    def step(self) -> float:
        """One training step; returns the loss."""
        batch = self.loader.next()
        loss = lm_loss(self.model, batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.sched.step()
        self.train_state.step += 1
        self.train_state.tokens_seen += batch[:, 1:].numel()
        return loss.item()

    def train(self, steps: int, *, save: bool = True, last: int | None = None) -> list[float]:
        """Train `steps` steps, offering a checkpoint after each; `last` marks the final step."""
        losses = []
        for _ in range(steps):
            losses.append(self.step())
            if save:
                s = self.train_state.step
                self.manager.maybe_save(s, last_step=s == last)
        return losses


def tensors_equal(a: dict, b: dict) -> bool:
    """Bitwise equality of two flat tensor dicts (same keys)."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
