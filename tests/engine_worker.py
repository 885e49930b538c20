"""One rank of `tests/test_engine.py`: a test-only training loop on `TrainingEngine` with a custom
loss that reads an extra batch key, under whatever layout the flags ask for.

    python -m torch.distributed.run --nproc_per_node N tests/engine_worker.py RUNS.json

where the file holds ``[[OUT, [--section.flag, V, ...]], ...]``: several loops, one after another
in one process group (``train_runs_worker.one_process_group``). Each writes OUT/result.json (rank 0: per-step loss and grad norm) and OUT/weights.pt (rank 0: the
full model from ``engine.full_state_dict()`` after the last step, titan names, and the HF-named
pieces of the same call).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from titan.train.config import TrainerConfig
from titan.train.engine import TrainingEngine

from titan.recipes.families import model_spec
from titan.recipes.recipes import recipe

VOCAB, SEQ, BATCH, STEPS = 256, 32, 4, 3


def weighted_cross_entropy(logits: torch.Tensor, batch) -> torch.Tensor:
    """A custom loss: per-token cross entropy weighted by the batch's own ``weights`` key
    (which must travel with each microbatch, CP shard and pipeline microbatch)."""
    if hasattr(logits, "full_tensor"):  # loss parallel: logits sharded over the vocabulary
        logits = logits.full_tensor()
    per_token = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    return (per_token * batch["weights"].flatten()).sum()


def global_batches() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of BATCH rows, the same on every rank and layout."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append({
            "input_ids": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "weights": torch.rand(BATCH, SEQ, generator=g),
        })
    return out


def run_loop(out: Path, flags: list[str]) -> None:
    """The test loop under the layout `flags` ask for; rank 0 writes what the test compares."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = tyro.cli(TrainerConfig, default=recipe("llama3_debug_synthetic"), args=[
        "--model.flavor", "debugmodel_tiny", "--training.seq_len", str(SEQ), "--training.steps", str(STEPS),
        "--training.max_norm", "0.5", "--optimizer.lr", "1e-2", "--optimizer.eps", "1e-5",
        "--lr_scheduler.warmup_steps", "1", "--debug.seed", "3", "--debug.deterministic",
        "--job.dump_folder", str(out), *flags,
    ], use_underscores=True)
    engine = TrainingEngine.from_config(cfg, model_spec=model_spec("llama3"), vocab_size=VOCAB)
    dims = engine.parallel_dims
    local = BATCH // dims.dp_world_size
    losses, norms = [], []
    for batch in global_batches():
        rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
        mine = {k: v[rows] for k, v in batch.items()}
        total_weight = float(batch["weights"].sum())  # the global normalizer, as a loop would pass
        rank_loss = engine.forward_backward(mine, weighted_cross_entropy, global_token_count=total_weight)
        if dims.pp_enabled:
            rank_loss = engine.sum_over(rank_loss.clone(), "pp")
        losses.append(float(engine.sum_over(rank_loss.clone(), "dp_cp")))
        norms.append(engine.optimizer_step())
    weights = dict(engine.full_state_dict())
    hf = dict(engine.full_state_dict(names="hf", dtype=torch.bfloat16))
    if not dist.is_initialized() or dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps({"loss": losses, "grad_norm": norms, "step": engine.step}))
        torch.save({"titan": weights, "hf": hf}, out / "weights.pt")
    engine.close()


def main(runs_file: str) -> None:
    """Every loop of `runs_file`, in order, in one process group."""
    from train_runs_worker import one_process_group

    with one_process_group():
        for out, flags in json.loads(Path(runs_file).read_text()):
            print(f"engine_worker: run {out}", file=sys.stderr, flush=True)
            run_loop(Path(out), flags)


if __name__ == "__main__":
    main(sys.argv[1])
