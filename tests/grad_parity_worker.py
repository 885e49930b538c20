"""One rank of `tests/test_gradient_parity.py`: one forward and backward of a family's tiny
model on a fixed batch under whatever layout the flags ask for, and every parameter's full
gradient afterwards.

    python -m torch.distributed.run --nproc_per_node N tests/grad_parity_worker.py RUNS.json

where the file holds ``[[OUT, FAMILY, [--section.flag, V, ...], MICROBATCHES, RL], ...]``: several runs, one
after another in one process group (``train_runs_worker.one_process_group``). RL: null for the
language-model loss, or ``--rl.*`` fields (``{"loss_type": "gspo", "entropy_coef": 0.01}``): the
RL policy loss of a fixed rollout, built and normalized as the RL controller does. Rank 0 writes
OUT/grads.pt: parameter name -> full gradient, gathered from every rank (pipeline stages hold
different parameters), and OUT/collectives.json: how many of each collective DTensor issued
in the forward and backward (torch's CommDebugMode: tensor parallel's, not FSDP's).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import tyro
from titan.train.config import TrainerConfig
from titan.train.engine import TrainingEngine
from titan.train.loss import supervised_loss
from torch.distributed.tensor.debug import CommDebugMode

from titan.recipes.families import model_spec
from titan.recipes.recipes import recipe

VOCAB, SEQ, BATCH = 256, 32, 8
RECIPES = {"llama3": "llama3_debug", "qwen3": "qwen3_debug", "qwen3_moe": "qwen3_moe_debug",
           "deepseek_v3": "deepseek_v3_debug"}


def near_uniform(tokens: int, g: torch.Generator) -> list[float]:
    """Log-probs near an untrained model's (log 1/VOCAB): importance ratios near 1, so a
    sequence's product of them neither vanishes nor saturates its cap."""
    return (-math.log(VOCAB) + 0.2 * torch.randn(tokens, generator=g)).tolist()


def rollout_rows() -> list:
    """``BATCH`` scored completions of random lengths (one masked, as --rl.mask_truncated
    leaves a truncated one), with generator and reference log-probs, fixed by a seed."""
    from titan.rl.rollouts import Row

    g = torch.Generator().manual_seed(11)
    rows = []
    for i in range(BATCH):
        prompt = int(torch.randint(2, 10, (), generator=g))
        completion = int(torch.randint(1, SEQ + 1 - prompt, (), generator=g))
        ids = torch.randint(0, VOCAB, (prompt + completion,), generator=g).tolist()
        rows.append(Row(prompt_ids=ids[:prompt], token_ids=ids[prompt:], logprobs=near_uniform(completion, g),
                        advantage=float(torch.randn((), generator=g)), train=i != 3,
                        ref_logprobs=near_uniform(completion, g)))
    return rows


def rl_microbatches(engine: TrainingEngine, cfg: TrainerConfig, rl_fields: dict, microbatches: int):
    """This rank's microbatches of the rollout, the loss function and the two normalizers,
    as the RL controller builds them (``RLController._minibatches`` and its loss)."""
    from titan.rl.config import RLSection
    from titan.rl.rollout_loss import RolloutLoss
    from titan.rl.rollouts import (
        build_batch,
        build_packed_batch,
        pack_rows,
        rows_loss_normalizer,
        split_rows,
    )

    rl, dims, rows = RLSection(**rl_fields), engine.parallel_dims, rollout_rows()
    normalizer = rows_loss_normalizer(rows, rl.loss_type, max_new_tokens=SEQ)
    size = BATCH // dims.dp_world_size // microbatches
    mine = split_rows(rows, dp_rank=dims.dp_rank, dp_world_size=dims.dp_world_size, microbatch_size=size)
    if rl.padding_free:  # this rank's completions packed (each its own document), in full microbatches
        packed = pack_rows([row for microbatch in mine for row in microbatch], seq_len=SEQ)
        groups = [packed[i : i + size] for i in range(0, len(packed), size)]
        batches = [build_packed_batch(group + [[]] * (size - len(group)), seq_len=SEQ, pad_id=0) for group in groups]
    else:
        batches = [build_batch(microbatch, seq_len=SEQ, pad_id=0) for microbatch in mine]
    loss_fn = RolloutLoss.on_engine(engine, rl, temperature=0.7, chunk_tokens=cfg.training.loss_chunk_tokens)\
        .for_microbatch({}, None, measure_mismatch=False)
    return batches, loss_fn, normalizer, float(sum(len(r.token_ids) for r in rows))


def lm_microbatches(engine: TrainingEngine, cfg: TrainerConfig, microbatches: int):
    """This rank's microbatches of a fixed random batch, the trainer's loss function (summed
    cross entropy; vocab-parallel under loss parallel, in --training.loss_chunk_tokens chunks)
    and the global token count."""
    dims = engine.parallel_dims
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    local = BATCH // dims.dp_world_size
    mine = tokens[dims.dp_rank * local : (dims.dp_rank + 1) * local]
    batches = [{"input_ids": rows[:, :-1], "labels": rows[:, 1:]} for rows in mine.tensor_split(microbatches)]
    loss = supervised_loss(chunk_tokens=cfg.training.loss_chunk_tokens, loss_type=cfg.training.loss_type)
    return batches, loss, BATCH * SEQ, None


def full_gradients(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    """Every parameter's gradient on this rank's model parts, unsharded (collective)."""
    grads = {}
    for part in engine.model_parts:
        for name, param in part.named_parameters():
            grad = param.grad
            if grad is not None:
                grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().cpu()
    return grads


AUX_LOSS_STAGES = "--test.aux_loss_stages"
"""Not a titan flag: ``"1|2,3"`` makes a one-process reference pool the MoE balancing loss
over those groups of layers, each weighted by its share of the MoE layers, as the pipeline
stages holding them do (``moe_aux_loss`` with ``moe_layers_in_model``)."""


def pool_aux_loss_by_stage(model: torch.nn.Module, stages: str) -> None:
    """Replace `model`'s ``aux_loss`` by the pipeline's: one pooled loss per group of
    ``stages``, weighted by the group's share of the MoE layers, summed."""
    from titan.models.common.moe import moe_aux_loss

    groups = [[model.layers[i] for i in group.split(",")] for group in stages.split("|")]
    in_model = sum(len(group) for group in groups)

    def aux_loss() -> torch.Tensor:
        return sum(moe_aux_loss(torch.nn.ModuleList(group), moe_layers_in_model=in_model) for group in groups)

    model.aux_loss = aux_loss


def run(out: Path, family: str, flags: list[str], accumulate: int = 1, rl: dict | None = None) -> None:
    """One forward and backward of `family` under `flags` (the rank's rows in `accumulate`
    microbatches, gradients accumulated) with the language-model loss, or the RL policy loss
    of ``rl``'s ``--rl.*`` fields; rank 0 writes every gradient."""
    stages = None
    if AUX_LOSS_STAGES in flags:
        at = flags.index(AUX_LOSS_STAGES)
        stages, flags = flags[at + 1], flags[:at] + flags[at + 2:]
    packed = ["--training.document_mask"] if rl and rl.get("padding_free") else []  # as titan rl's default
    cfg = tyro.cli(TrainerConfig, default=recipe(RECIPES[family]), args=[
        "--model.flavor", "debugmodel_tiny", "--training.seq_len", str(SEQ), "--debug.seed", "3",
        "--job.dump_folder", str(out), *packed, *flags,
    ], use_underscores=True)
    engine = TrainingEngine.from_config(cfg, model_spec=model_spec(family), vocab_size=VOCAB)
    dims = engine.parallel_dims
    if stages is not None:
        pool_aux_loss_by_stage(engine.model_parts[0], stages)
    batches, loss_fn, normalizer, aux_count = (rl_microbatches(engine, cfg, rl, accumulate) if rl is not None
                                               else lm_microbatches(engine, cfg, accumulate))
    # The collectives DTensor issues (TP's, not FSDP's); counted in one forward and backward
    # without PP only (torch's pipeline schedules hang under the dispatch mode, and its module
    # tracker fails on a second forward), and never when compiled (torch.compile skips every
    # frame under a dispatch mode: the model would run eager).
    counting = not dims.pp_enabled and accumulate == 1 and not cfg.compile.enable
    comm = CommDebugMode() if counting else contextlib.nullcontext()
    with comm:
        for i, batch in enumerate(batches):
            engine.forward_backward(batch, loss_fn, global_token_count=normalizer, aux_token_count=aux_count,
                                    last_microbatch=i == len(batches) - 1)
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
        for out, family, flags, accumulate, *rl in json.loads(Path(runs_file).read_text()):
            print(f"grad_parity_worker: run {out}", file=sys.stderr, flush=True)
            run(Path(out), family, flags, accumulate, *rl)


if __name__ == "__main__":
    main(sys.argv[1])
