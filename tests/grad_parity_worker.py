"""One rank of `tests/test_gradient_parity.py`: one forward and backward of a family's tiny
model on a fixed batch under whatever layout the flags ask for, and every parameter's full
gradient afterwards.

    python -m torch.distributed.run --nproc_per_node N tests/grad_parity_worker.py RUNS.json

where the file holds ``[[OUT, FAMILY, [--section.flag, V, ...], MICROBATCHES], ...]``: several runs, one after
another in one process group (``train_runs_worker.one_process_group``). Rank 0 writes
OUT/grads.pt: parameter name -> full gradient, gathered from every rank (pipeline stages hold
different parameters), and OUT/collectives.json: how many of each collective DTensor issued
in the forward and backward (torch's CommDebugMode: tensor parallel's, not FSDP's).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from titan.train.config import TrainerConfig
from titan.train.engine import TrainingEngine
from torch.distributed.tensor.debug import CommDebugMode

from titan.recipes.families import model_spec
from titan.recipes.recipes import recipe

VOCAB, SEQ, BATCH = 256, 32, 8
RECIPES = {"llama3": "llama3_debug", "qwen3": "qwen3_debug", "qwen3_moe": "qwen3_moe_debug",
           "deepseek_v3": "deepseek_v3_debug"}


def summed_cross_entropy(logits: torch.Tensor, batch) -> torch.Tensor:
    """Cross entropy summed over this rank's positions (the engine divides by the global count)."""
    if hasattr(logits, "full_tensor"):  # loss parallel: logits sharded over the vocabulary
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")


def full_gradients(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """Every parameter's gradient on this rank's model parts, unsharded (collective)."""
    grads = {}
    for part in engine.model_parts:
        for name, param in part.named_parameters():
            grad = param.grad
            if grad is not None:
                grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu()
    return grads


def run(out: Path, family: str, flags: list[str], accumulate: int = 1) -> None:
    """One forward and backward of `family` under `flags` (the rank's rows in `accumulate`
    microbatches, gradients accumulated); rank 0 writes every gradient."""
    cfg = tyro.cli(TrainerConfig, default=recipe(RECIPES[family]), args=[
        "--model.flavor", "debugmodel_tiny", "--training.seq_len", str(SEQ), "--debug.seed", "3",
        "--job.dump_folder", str(out), *flags,
    ], use_underscores=True)
    engine = TrainingEngine.from_config(cfg, model_spec=model_spec(family), vocab_size=VOCAB)
    dims = engine.parallel_dims
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    local = BATCH // dims.dp_world_size
    rows = slice(dims.dp_rank * local, (dims.dp_rank + 1) * local)
    batch = {"input_ids": tokens[rows, :-1], "labels": tokens[rows, 1:]}
    # The collectives DTensor issues (TP's, not FSDP's); counted in one forward and backward
    # without PP only (torch's pipeline schedules hang under the dispatch mode, and its module
    # tracker fails on a second forward).
    comm = CommDebugMode() if not dims.pp_enabled and accumulate == 1 else contextlib.nullcontext()
    with comm:
        for rows in torch.arange(local).tensor_split(accumulate):
            engine.forward_backward({k: v[rows] for k, v in batch.items()}, summed_cross_entropy,
                                    global_token_count=BATCH * SEQ, last_microbatch=bool(rows[-1] == local - 1))
    counts = {str(op).rpartition(".")[2]: n for op, n in comm.get_comm_counts().items()} \
        if isinstance(comm, CommDebugMode) else {}
    grads = full_gradients(engine)
    if dist.is_initialized():
        every_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, grads)
        grads = {name: grad for rank_grads in every_rank for name, grad in rank_grads.items()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(grads, out / "grads.pt")
        (out / "collectives.json").write_text(json.dumps(counts))
    engine.close()


def main(runs_file: str) -> None:
    """Every run of `runs_file`, in order, in one process group."""
    from train_runs_worker import one_process_group

    with one_process_group():
        for out, family, flags, accumulate in json.loads(Path(runs_file).read_text()):
            print(f"grad_parity_worker: run {out}", file=sys.stderr, flush=True)
            run(Path(out), family, flags, accumulate)


if __name__ == "__main__":
    main(sys.argv[1])
