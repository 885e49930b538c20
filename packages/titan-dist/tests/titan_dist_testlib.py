"""Test helpers for titan-dist: a tiny transformer that follows the model contract
(docs/contracts.md) without importing titan.models, and a gloo multi-process runner.

Spawned workers must live in an importable module (not a test file) so that
torch.multiprocessing can find them in the child processes.
"""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, KV_HEADS, FFN, LAYERS = 64, 32, 4, 2, 64, 4
SEQ, BATCH = 16, 4


@dataclass(frozen=True)
class TinyPlan:
    """Same fields as titan.models.common.plan.ShardingPlan (duck-typed by titan.dist)."""

    tensor_parallel: dict = field(default_factory=lambda: {
        "tok_embeddings": "embedding",
        "layers.*.attention_norm": "norm",
        "layers.*.attention": "block_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "norm",
        "layers.*.feed_forward": "block_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "layers.*.feed_forward.w3": "colwise",
        "norm": "norm",
        "output": "output",
    })
    fsdp_units: tuple = ("layers.*",)
    layer_container: str = "layers"
    pipeline_first: tuple = ("tok_embeddings",)
    pipeline_last: tuple = ("norm", "output")
    attention_modules: str = "layers.*.attention.inner_attention"


def rope_table(positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """cos/sin table [..., S, head_dim//2, 2] for the given absolute positions."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv.to(positions.device)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [B, S, H, Dh]; rope: [S, Dh/2, 2] or [B, S, Dh/2, 2]."""
    xr = x.float().unflatten(-1, (-1, 2))
    cos, sin = rope[..., 0], rope[..., 1]
    if rope.dim() == 3:
        cos, sin = cos[None, :, None], sin[None, :, None]
    else:
        cos, sin = cos[:, :, None], sin[:, :, None]
    a, b = xr[..., 0], xr[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class InnerAttention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)
        self.inner_attention = InnerAttention()

    def forward(self, x, rope):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM, eps=1e-5)
        self.feed_forward = FeedForward()

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyTransformer(nn.Module):
    """Llama-shaped toy: tok_embeddings, ModuleDict layers, norm, output."""

    def __init__(self, n_layers: int = LAYERS):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.RMSNorm(DIM, eps=1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def sharding_plan(self) -> TinyPlan:
        return TinyPlan()

    def forward(self, x, positions=None):
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        rope = rope_table(positions, DIM // HEADS)
        for block in self.layers.values():
            h = block(h, rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def make_model(seed: int = 0, n_layers: int = LAYERS) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(n_layers)


def make_batches(steps: int, seed: int = 1, batch: int = BATCH, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (steps, batch, seq + 1), generator=g)
    return [(d[:, :-1].clone(), d[:, 1:].clone()) for d in data]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def reference_run(steps: int = 3, lr: float = 0.5, n_layers: int = LAYERS):
    """Single-process training: per-step losses and the final full state dict."""
    model = make_model(n_layers=n_layers)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, labels in make_batches(steps):
        loss = loss_fn(model(inputs), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copy of a (possibly DTensor) state dict."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in model.state_dict().items():
        v = v.full_tensor() if isinstance(v, DTensor) else v
        out[k.replace("_orig_mod.", "")] = v.detach().clone()
    return out


def assert_close_rel(a, b, rtol: float = 1e-5, atol: float = 1e-6, what: str = "") -> None:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# --- multi-process runner ---------------------------------------------------------------


def _rendezvous_store(world_size: int) -> dist.TCPStore:
    """A TCP store this process hosts on a port the OS picks and keeps bound, for the spawned
    ranks to join as clients (the way torchrun's agent hosts the store of its workers).

    Asking the OS for a free port, closing it and letting rank 0 bind it later is a race that
    a parallel test (another pytest-xdist worker) can win; a port that is never released
    cannot be taken.
    """
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    # TORCHELASTIC_USE_AGENT_STORE: every rank, rank 0 included, is a client of the store the
    # parent hosts (see _rendezvous_store) instead of rank 0 binding the port itself.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    try:
        from titan.dist import init_distributed

        env = init_distributed(timeout_s=60)  # exercises the torchrun-env path
        assert env.rank == rank and env.world_size == world_size and dist.is_initialized()
        result = fn(rank, world_size, *args)
        dist.barrier()
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        # No rank tears the group down while another is still writing: a gloo rank whose peer
        # destroyed the group first aborted at exit ("terminate called without an active
        # exception") about once in ten launches of a 2-rank worker.
        dist.barrier()
    except BaseException:
        with open(os.path.join(out_dir, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


NATIVE_CRASHES = ("SIGABRT", "SIGSEGV", "SIGBUS")
"""Signals a rank dies of when native code (torch's kernels, gloo, glibc) corrupts memory: a
pure-Python rank cannot. Seen once under the full suite's load (2026-12-05: "double free or
corruption (fasttop)" in a 4-rank EP + FSDP fixture; 0 of dozens of reruns)."""


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def run_ranks(world_size: int, fn, *args, retries_on_native_crash: int = 1) -> list:
    """Run fn(rank, world_size, *args) in `world_size` gloo processes; return each result.

    The ranks are forked from the suite's forkserver (tests/forked_cli.py), which imported
    torch and titan once per pytest process: a spawned rank spent ~2.5 s of CPU on those
    imports, more than most of these checks compute. Nothing else is shared: the server never
    runs anything but imports, and each rank starts its own process group.

    When a rank dies of a native crash (`NATIVE_CRASHES`, no Python error of its own written),
    every rank runs again from scratch, `retries_on_native_crash` times, with a warning the
    test report shows; a Python error or a second crash fails."""
    from forked_cli import forkserver  # the repository's tests/ (root conftest.py)

    store = _rendezvous_store(world_size)
    forkserver()  # its preload set before the server starts
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            mp.start_processes(_worker, args=(world_size, store.port, out_dir, fn, args),
                               nprocs=world_size, join=True, start_method="forkserver")
        except Exception as err:
            errs = [_read(os.path.join(out_dir, f)) for f in sorted(os.listdir(out_dir)) if f.endswith(".err")]
            # The crashed rank wrote no Python error (the others may have, waiting on it).
            crashed = getattr(err, "error_index", None)
            native = (getattr(err, "signal_name", None) in NATIVE_CRASHES
                      and not os.path.exists(os.path.join(out_dir, f"{crashed}.err")))
            if native and retries_on_native_crash > 0:
                warnings.warn(f"{fn.__name__} on {world_size} ranks: {err}; running it again from scratch",
                              stacklevel=2)
                return run_ranks(world_size, fn, *args, retries_on_native_crash=retries_on_native_crash - 1)
            raise AssertionError("\n".join([str(err), *errs])) from err  # which rank died, and how
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
                for r in range(world_size)]
