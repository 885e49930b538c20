"""A tiny transformer with a tied embedding/output matrix, and the functions its spawned
gloo ranks run (importable by the child processes, unlike a test file)."""

from __future__ import annotations

import dataclasses

import titan_dist_testlib as lib
import torch
import torch.distributed as dist

TIE = ("tok_embeddings.weight", "output.weight")


@dataclasses.dataclass(frozen=True)
class TiedPlan(lib.TinyPlan):
    """TinyPlan that also lists the embedding units (titan.dist must leave them to the root)
    and declares the tie."""

    fsdp_units: tuple = ("tok_embeddings", "layers.*", "output")
    tied_parameters: tuple = (TIE,)


class TiedTransformer(lib.TinyTransformer):
    """TinyTransformer whose output projection is its embedding matrix."""

    def __init__(self, n_layers: int = lib.LAYERS):
        super().__init__(n_layers)
        self.output.weight = self.tok_embeddings.weight

    def sharding_plan(self) -> TiedPlan:
        return TiedPlan()


def make_tied_model(seed: int = 0) -> TiedTransformer:
    """The same tied weights on every rank (and in the reference)."""
    torch.manual_seed(seed)
    model = TiedTransformer()
    with torch.no_grad():  # unit-std embedding rows would make the tied logits huge
        model.tok_embeddings.weight.mul_(0.2)
    return model


def reference_run(steps: int = 3, lr: float = 0.5) -> dict:
    """One process, plain SGD: losses and the final shared matrix."""
    model = make_tied_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for inputs, labels in lib.make_batches(steps):
        loss = lib.loss_fn(model(inputs), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": lib.full_state(model)}


def _is_tied(model) -> bool:
    return model.output.weight is model.tok_embeddings.weight


def train_tied(case: dict, steps: int = 3, lr: float = 0.5) -> dict:
    """Train the tied model under one parallel configuration (data sliced by dp rank)."""
    from titan.dist import (
        ActivationCheckpointConfig,
        CompileConfig,
        ParallelDims,
        ParallelismConfig,
        parallelize,
        reduce_mean,
    )
    from titan.dist.fsdp import fsdp_units
    from titan.dist.tensor_parallel import loss_parallel_context
    from torch.distributed.tensor import DTensor

    pcfg = ParallelismConfig(**case)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size())
    root = dims.build_mesh("cpu")
    model = make_tied_model()
    units = [type(m).__name__ for m in fsdp_units(model)]
    parallelize(model, dims, root, parallelism=pcfg, activation_checkpoint=ActivationCheckpointConfig(),
                compile=CompileConfig())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    report = {"tied": _is_tied(model), "units": units,
              "dtensor": isinstance(model.output.weight, DTensor),
              "n_params": len(list(model.parameters()))}
    losses = []
    for inputs, labels in lib.make_batches(steps):
        per = inputs.shape[0] // dims.dp_world_size
        inputs, labels = (t[dims.dp_rank * per:(dims.dp_rank + 1) * per] for t in (inputs, labels))
        with loss_parallel_context(dims, pcfg):
            loss = lib.loss_fn(model(inputs), labels)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(reduce_mean(loss.detach(), dims.mesh("dp_cp")).item())
    report["tied_after"] = _is_tied(model)
    report.update(losses=losses, state=lib.full_state(model))
    dist.barrier()
    return report


def tied_cases(rank: int, world_size: int, cases: list) -> list:
    """Several configurations in one process group (spawning costs more than training)."""
    return [train_tied(case) for case in cases]
