"""The trainer against a hand-written PyTorch loop: an outside reference for the whole step.

The parity matrix compares layouts with one process, so a bug every layout shares (a wrong
loss normalization, decay groups, clipping or LR schedule) would pass it. Here the real
``Trainer`` (recipe ``llama3_debug_synthetic``, ``debugmodel_tiny``, fp32) runs a few steps
and a plain loop written from the definitions replays them on the same model and batches:
``F.cross_entropy`` averaged over the whole global batch, ``torch.optim.AdamW`` with decay
groups listed by name, ``torch.nn.utils.clip_grad_norm_`` and the warmup-stable-decay
schedule written out by hand. Losses, gradient norms and every weight must agree to 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from titan.models.llama3 import build_llama3
from titan.train.data import build_dataloader
from titan.train.trainer import Trainer

from titan.recipes.families import model_spec
from titan.recipes.recipes import llama3_debug_synthetic

SEED = 7
SEQ_LEN = 32
LOCAL_BATCH, GLOBAL_BATCH = 2, 4  # two accumulation microbatches per step in the trainer
PEAK_LR = 1e-2
WEIGHT_DECAY = 0.1
MAX_NORM = 0.3  # below the natural grad norm (~0.8 at init), so clipping acts every step
# AdamW divides each gradient entry by its own RMS plus eps: with eps 1e-8 an entry whose
# gradient is ~0 by cancellation turns summation-order noise (~1e-10) into a visible update,
# and the trainer accumulates two microbatches where the reference runs one batch. 1e-5 keeps
# that noise below the tolerance while staying ~1% of a typical gradient entry.
EPS = 1e-5
BETAS = (0.9, 0.95)
# Five steps cover the three phases of the schedule: warmup (steps 1-2), stable (3), decay (4-5).
STEPS, WARMUP, DECAY_RATIO, MIN_LR_FACTOR = 5, 2, 0.6, 0.1
RTOL = 1e-5


def expected_lr(step: int) -> float:
    """The LR of 1-based optimizer ``step``, from the schedule's definition (torchtitan's):
    linear warmup from peak/WARMUP to the peak, flat, then a sqrt decay over the last
    DECAY_RATIO of the steps toward MIN_LR_FACTOR x peak, reached at a virtual step after the
    last."""
    if step <= WARMUP:
        return PEAK_LR * step / WARMUP
    decay_steps = round(STEPS * DECAY_RATIO)
    decay_start = STEPS + 1 - decay_steps
    if step <= decay_start:
        return PEAK_LR
    progress = (step - decay_start) / decay_steps
    return PEAK_LR * (MIN_LR_FACTOR + (1 - MIN_LR_FACTOR) * (1 - math.sqrt(progress)))


def trainer_config(tmp_path):
    """The recipe with the flags a user would pass for this run."""
    cfg = llama3_debug_synthetic()
    cfg.model.flavor = "debugmodel_tiny"
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.seq_len = SEQ_LEN
    cfg.training.local_batch_size = LOCAL_BATCH
    cfg.training.global_batch_size = GLOBAL_BATCH
    cfg.training.steps = STEPS
    cfg.training.max_norm = MAX_NORM
    cfg.training.mixed_precision_param = "float32"
    cfg.optimizer.lr = PEAK_LR
    cfg.optimizer.weight_decay = WEIGHT_DECAY
    cfg.optimizer.eps = EPS
    cfg.optimizer.beta1, cfg.optimizer.beta2 = BETAS
    cfg.lr_scheduler.warmup_steps = WARMUP
    cfg.lr_scheduler.decay_ratio = DECAY_RATIO
    cfg.lr_scheduler.decay_type = "sqrt"
    cfg.lr_scheduler.min_lr_factor = MIN_LR_FACTOR
    cfg.debug.seed = SEED
    cfg.metrics.log_freq = 1
    cfg.metrics.enable_progress_bar = False
    cfg.dataset.synthetic_documents = 200
    return cfg


def global_batches(cfg) -> list[dict[str, torch.Tensor]]:
    """The STEPS global batches of the run, from a fresh loader built like the trainer's (one
    process: the global batch is GLOBAL_BATCH consecutive rows of the packed stream)."""
    loader = build_dataloader(
        cfg.dataset, cfg.tokenizer.build(), dp_rank=0, dp_world_size=1,
        local_batch_size=GLOBAL_BATCH, seq_len=SEQ_LEN, seed=SEED,
    )  # fmt: skip
    it = iter(loader)
    return [next(it) for _ in range(STEPS)]


def reference_model() -> torch.nn.Module:
    """The same Llama built on one device: byte vocab 259 padded to a multiple of 64."""
    model = build_llama3("debugmodel_tiny", vocab_size=320, max_seq_len=SEQ_LEN)
    model.init_weights(seed=SEED)
    return model.train()


def decay_groups(model: torch.nn.Module, *, exempt_embedding: bool = True) -> list[dict]:
    """AdamW groups by name: the embedding and every norm scale are exempt from weight decay."""
    decay, exempt = [], []
    for name, param in model.named_parameters():
        is_exempt = (exempt_embedding and name == "tok_embeddings.weight") or name.endswith(
            "norm.weight"
        )
        (exempt if is_exempt else decay).append(param)
    # The tiny Llama has 4 blocks x 2 norms + the final norm, and no biases.
    assert len(exempt) == exempt_embedding + 4 * 2 + 1, [n for n, _ in model.named_parameters()]
    return [
        {"params": decay, "weight_decay": WEIGHT_DECAY},
        {"params": exempt, "weight_decay": 0.0},
    ]


def reference_run(
    batches, *, max_norm: float = MAX_NORM, lr=expected_lr, exempt_embedding: bool = True
):
    """The plain loop: whole-batch mean cross-entropy, clip, AdamW, LR set by hand each step.
    Returns (losses, pre-clip grad norms, final weights). The keywords switch one ingredient
    off, to show the comparison is sensitive to it."""
    model = reference_model()
    groups = decay_groups(model, exempt_embedding=exempt_embedding)
    opt = torch.optim.AdamW(groups, lr=PEAK_LR, betas=BETAS, eps=EPS, foreach=False)
    losses, norms = [], []
    for step, batch in enumerate(batches, start=1):
        for group in opt.param_groups:
            group["lr"] = lr(step)
        opt.zero_grad(set_to_none=True)
        logits = model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer_run(cfg):
    """The real trainer's loop; returns its logged records and final weights."""
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    try:
        records = trainer.train()
        weights = {k: v.detach().cpu().clone() for k, v in trainer.model_parts[0].state_dict().items()}
    finally:
        trainer.close()
    return records, weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two tensors in the 2-norm."""
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The trainer's run and the reference loop's, on the same batches (built once)."""
    tmp_path = tmp_path_factory.mktemp("reference_loop")
    cfg = trainer_config(tmp_path)
    batches = global_batches(cfg)
    records, weights = trainer_run(cfg)
    return batches, records, weights, reference_run(batches)


def test_schedule_formula_covers_every_phase():
    """The hand-written schedule itself: warmup, stable and two decay steps (3 decay steps, the
    last a virtual one after the run, so the run's last step still learns)."""
    factors = [expected_lr(s) / PEAK_LR for s in range(1, STEPS + 1)]
    decay = [0.1 + 0.9 * (1 - math.sqrt(k / 3)) for k in (1, 2)]
    assert factors == pytest.approx([0.5, 1.0, 1.0, *decay])


@pytest.mark.slow
def test_trainer_matches_hand_written_loop(runs):
    _, records, weights, (ref_losses, ref_norms, ref_weights) = runs

    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    norms = [r["grad_norm"] for r in records]
    print(f"losses {losses}\nreference {ref_losses}\nnorms {norms}\nreference {ref_norms}")
    # Clipping engaged on every step (so its scale reaches AdamW's moments), and the model learns.
    assert min(ref_norms) > MAX_NORM and min(norms) > MAX_NORM, (norms, ref_norms)
    assert ref_losses[-1] < ref_losses[0] - 0.1, ref_losses

    assert losses == pytest.approx(ref_losses, rel=RTOL)
    assert norms == pytest.approx(ref_norms, rel=RTOL)
    assert weights.keys() == ref_weights.keys()
    diffs = {k: rel(weights[k], ref) for k, ref in ref_weights.items()}
    worst = max(diffs, key=diffs.get)
    print(f"weights: worst relative difference {diffs[worst]:.1e} ({worst})")
    assert diffs[worst] <= RTOL, diffs
    for name, ref in ref_weights.items():  # and entry by entry (atol for entries near zero)
        torch.testing.assert_close(weights[name], ref, rtol=RTOL, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    [dict(max_norm=math.inf), dict(exempt_embedding=False), dict(lr=lambda step: PEAK_LR)],
    ids=["no_clipping", "embedding_decayed", "constant_lr"],
)
def test_reference_is_sensitive_to_each_ingredient(runs, change):
    """The comparison above can fail: switching off clipping, the decay exemption or the
    schedule in the hand-written loop moves the final weights far beyond the tolerance."""
    batches, _, _, (_, _, ref) = runs
    _, _, changed = reference_run(batches, **change)
    assert max(rel(changed[k], w) for k, w in ref.items()) > 100 * RTOL


@pytest.mark.slow
def test_logged_lr_is_the_lr_the_step_used(runs):
    """Each record's ``lr`` is the LR its optimizer step applied (the weights above prove the
    applied LRs follow the schedule)."""
    _, records, _, _ = runs
    assert [r["lr"] for r in records] == pytest.approx(
        [expected_lr(s) for s in range(1, STEPS + 1)]
    )
