"""Loss normalization with padding: one optimizer step over microbatches with unequal numbers
of ignored (-100) labels equals one ``F.cross_entropy`` over the whole batch.

Averaging each microbatch (or each rank) separately would weigh a token of a mostly padded
microbatch more than one of a full microbatch; the trainer divides every microbatch's summed
loss by the valid-token count of the whole global batch instead. The reference here is the
definition: the mean cross-entropy over the union of every microbatch of every rank, computed
in one call on an unsharded copy of the same weights. Checked in one process with gradient
accumulation and under FSDP 2 (two gloo ranks, each with its own microbatches).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from launching import launch
from titan.models.llama3 import build_llama3
from titan.train.trainer import Trainer

from titan.recipes.cli import parse_train_args
from titan.recipes.families import model_spec

SEQ_LEN, ROWS = 32, 2
VOCAB = 320  # the byte tokenizer's 259 ids padded to a multiple of 64
RTOL = 1e-5
FLAGS = [
    "--config", "llama3_debug_synthetic",
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", str(SEQ_LEN),
    "--training.local_batch_size", str(ROWS),
    "--training.steps", "1",
    "--training.max_norm", "0",  # no clipping: the gradients are compared as computed
    "--debug.seed", "3",
    "--metrics.no_enable_progress_bar",
    "--dataset.synthetic_documents", "100",
]  # fmt: skip


def microbatches(ignored: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """One [ROWS, SEQ_LEN] microbatch per entry of ``ignored``, with that many labels set to
    -100 at random positions (so the valid-token counts differ between microbatches)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for count in ignored:
        input_ids = torch.randint(0, 259, (ROWS, SEQ_LEN), generator=gen)
        labels = torch.randint(0, 259, (ROWS, SEQ_LEN), generator=gen)
        masked = torch.randperm(ROWS * SEQ_LEN, generator=gen)[:count]
        labels.view(-1)[masked] = -100
        out.append({"input_ids": input_ids, "labels": labels})
    return out


def reference_model(initial: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An unsharded copy of the model holding the parameters ``initial``."""
    model = build_llama3("debugmodel_tiny", vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    model.init_weights(seed=0)  # the buffers; every parameter is overwritten below
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(initial[name])
    return model


def reference(initial: dict[str, torch.Tensor], batches: list[dict[str, torch.Tensor]]):
    """(loss, grads, grad norm) of one ``F.cross_entropy`` over the concatenation of
    ``batches``, on an unsharded model holding the weights ``initial``."""
    model = reference_model(initial)
    input_ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    loss = F.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
    return loss.item(), grads, norm.item()


def naive_mean(initial: dict[str, torch.Tensor], batches: list[dict[str, torch.Tensor]]) -> float:
    """The wrong normalization: the mean of each microbatch's own mean loss (over the
    microbatches with any valid label; an all-padding one has no mean)."""
    model = reference_model(initial)
    with torch.no_grad():
        means = [
            F.cross_entropy(
                model(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=-100
            )
            for b in batches
            if (b["labels"] != -100).any()
        ]
    return float(torch.stack(means).mean())


def check_against_reference(got: dict, batches: list[dict[str, torch.Tensor]]) -> None:
    """The trainer's step (``got``: initial weights, gradients, loss, tokens, grad norm) equals
    the whole-batch cross-entropy; and the batches are uneven enough that a per-microbatch
    mean would not."""
    ref_loss, ref_grads, ref_norm = reference(got["initial"], batches)
    assert got["tokens"] == sum(int((b["labels"] != -100).sum()) for b in batches)
    assert abs(naive_mean(got["initial"], batches) - ref_loss) > 100 * RTOL * ref_loss
    assert float(got["rank_loss"]) == pytest.approx(ref_loss, rel=RTOL)
    assert got["grad_norm"] == pytest.approx(ref_norm, rel=RTOL)
    assert got["grads"].keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        diff = float((got["grads"][name] - ref).norm() / ref.norm())
        assert diff <= RTOL, f"{name}: gradient relative difference {diff:.1e}"


def one_step(trainer, batches, full) -> dict:
    """One ``train_step`` over ``batches``: the initial parameters, the gradients the optimizer
    is handed (caught by a step pre-hook, since the step zeroes them), the loss share, tokens
    and grad norm. ``full`` turns a parameter or gradient into a whole plain tensor."""
    (model,) = trainer.model_parts
    (optimizer,) = trainer.optimizers
    initial = {name: full(p) for name, p in model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def catch_grads(*_):
        grads.update({name: full(p.grad) for name, p in model.named_parameters()})

    handle = optimizer.register_step_pre_hook(catch_grads)
    try:
        result = trainer.train_step(batches)
    finally:
        handle.remove()
    assert grads, "the optimizer step did not run"
    return {
        "initial": initial,
        "grads": grads,
        "rank_loss": result.rank_loss.detach().cpu().clone(),
        "tokens": result.tokens,
        "grad_norm": result.grad_norm,
    }


def test_accumulation_over_uneven_padding_equals_one_cross_entropy(tmp_path):
    """Three microbatches of 64 label slots with 0, 40 and all 64 ignored."""
    batches = microbatches([0, 40, 64])
    cfg = parse_train_args([*FLAGS, "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    try:
        got = one_step(trainer, batches, lambda t: t.detach().cpu().clone())
    finally:
        trainer.close()
    check_against_reference(got, batches)


@pytest.mark.slow
def test_fsdp2_uneven_padding_across_ranks_equals_one_cross_entropy(tmp_path):
    """FSDP 2: rank 0 gets microbatches with 0 and 50 ignored labels, rank 1 with 10 and 64
    (its second one entirely padding), so the ranks hold 78 and 54 valid tokens; FSDP's
    gradient average over ranks must not weigh them equally."""
    batches = microbatches([0, 50, 10, 64])
    per_rank = [batches[:2], batches[2:]]
    torch.save(per_rank, tmp_path / "batches.pt")
    out = tmp_path / "result.pt"
    flags = [
        *FLAGS,
        "--parallelism.data_parallel_shard_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "run"),
    ]
    # Two gloo ranks with torchrun's worker environment, forked from the preloaded server.
    worker = Path(__file__).with_name("loss_normalization_worker.py")
    launch(2, [str(worker), str(tmp_path / "batches.pt"), str(out), *flags], tmp_path / "launch.log", timeout=300,
           torchrun=False)
    got = torch.load(out)
    # The technique ran: two data-parallel ranks, parameters sharded by FSDP.
    assert got["dp_world_size"] == 2 and got["sharded"], got
    check_against_reference(got, batches)
