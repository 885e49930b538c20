"""One rank of ``test_plan``'s activation check: what autograd saves inside the transformer
blocks during one real training step, under the layout the flags ask for.

    python tests/block_activations_worker.py OUT FLAG...   (one process, or ranks with
                                                            torchrun's environment)

Builds the real trainer from the `titan train` flags, counts every tensor autograd saves
while a block's forward runs (each storage once, the model's parameters and buffers
excluded: those are counted as parameters), trains one step, and writes this rank's bytes
to ``OUT/rank<R>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    local = getattr(tensor, "_local_tensor", tensor)  # a DTensor saves its shard
    local = getattr(local, "elem", local)  # an AsyncCollectiveTensor wraps a collective's result
    local = getattr(local, "_data", local)  # torchao's float8 tensor wraps its float8 bytes
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError as err:
        raise RuntimeError(f"{type(tensor).__name__} {type(local).__name__} {tuple(local.shape)}: {err}") from err


def main(out: Path, flags: list[str]) -> None:
    """Train one step with the counting hooks on; write ``{"rank", "block_saved_bytes"}``."""
    from titan.dist import destroy_distributed, init_distributed
    from titan.train.trainer import Trainer

    from titan.recipes.cli import parse_train_args
    from titan.recipes.families import model_spec

    config = parse_train_args(flags)
    env = init_distributed()
    trainer = Trainer(config, model_spec=model_spec(config.model.name))
    try:
        own = {_storage_key(t) for part in trainer.model_parts for t in [*part.parameters(), *part.buffers()]}
        inside_block = [False]
        saved: dict[tuple[int, int], int] = {}

        def pack(tensor):
            if inside_block[0] and isinstance(tensor, torch.Tensor):
                key = _storage_key(tensor)
                if key not in own:
                    saved[key] = key[1]
            return tensor

        def enter(*_):
            inside_block[0] = True

        def leave(*_):
            inside_block[0] = False

        for part in trainer.model_parts:
            for block in part.layers.values():
                block.register_forward_pre_hook(enter)
                block.register_forward_hook(leave)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            trainer.train()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{env.rank}.json").write_text(json.dumps({"rank": env.rank,
                                                             "block_saved_bytes": sum(saved.values())}))
    finally:
        trainer.close()
        destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
