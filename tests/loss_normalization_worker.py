"""One rank of ``test_loss_normalization``'s data-parallel case (torchrun's worker environment).

``python -m torch.distributed.run ... loss_normalization_worker.py BATCHES OUT FLAG...``:
builds the real ``Trainer`` from the ``titan train`` flags, takes this data-parallel rank's
microbatches from ``BATCHES`` (one list per rank, saved with ``torch.save``), runs one
``train_step`` and, on rank 0, saves to ``OUT`` the full initial weights, the full gradients,
the loss summed over ranks and the step's token count and grad norm.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from test_loss_normalization import one_step  # this script's folder is on sys.path
from titan.train.trainer import Trainer
from torch.distributed.tensor import DTensor

from titan.recipes.cli import parse_train_args
from titan.recipes.families import model_spec


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on the CPU (gathers a DTensor's shards: collective)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def main(batches_path: str, out_path: str, flags: list[str]) -> None:
    """Run one step on this rank's microbatches and save what the test compares."""
    trainer = Trainer(parse_train_args(flags), model_spec=model_spec("llama3"))
    try:
        (model,) = trainer.model_parts
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        microbatches = torch.load(batches_path)[trainer.parallel_dims.dp_rank]
        got = one_step(trainer, microbatches, full)
        dist.all_reduce(got["rank_loss"])  # each rank holds its share of the global mean
        if dist.get_rank() == 0:
            got.update(dp_world_size=trainer.parallel_dims.dp_world_size, sharded=sharded)
            torch.save(got, out_path)
    finally:
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
