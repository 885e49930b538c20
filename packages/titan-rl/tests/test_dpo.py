"""`titan dpo`'s loop in one process, against a hand computation on unpacked sequences.

The reference table must be the starting weights' log-probs of each pair's two completions,
computed here one sequence at a time with a plain forward (no packing, no document mask), and
a batch's loss must be the hand-written DPO / IPO / RPO formula over those sequences.
"""

from __future__ import annotations

import copy
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from preference_runs import tiny_run
from titan.rl.dpo import DPOConfig, DPOSection, DPOTrainer
from titan.rl.preference_data import build_preference_source

from titan.recipes.families import model_spec


def _config(tmp_path, *, steps=2, **dpo) -> DPOConfig:
    cfg = tiny_run(DPOConfig(), tmp_path, steps=steps, examples=256)
    for key, value in dpo.items():
        setattr(cfg.dpo, key, value)
    return cfg


def _trainer(cfg: DPOConfig) -> DPOTrainer:
    return DPOTrainer(cfg, model_spec=model_spec("llama3"))


def _sequence_logprob(model, example) -> tuple[float, int]:
    """(sum, count) of the log-probs of ``example``'s target tokens, from one plain forward of
    the sequence alone."""
    ids = torch.as_tensor(example.ids)[None]
    with torch.no_grad():
        logits = model(ids[:, :-1]).float()
    logp = F.log_softmax(logits, dim=-1)[0].gather(-1, ids[0, 1:, None])[:, 0]
    targets = torch.as_tensor(example.targets[1:])
    return float(logp[targets].sum()), int(targets.sum())


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _one_loss(loss_type: str, beta: float, pc, nc, pr, nr, rc, rr) -> float:
    """One pair's loss of ``loss_type`` from its summed log-probs and token counts."""
    if loss_type == "ipo":
        h = (pc / nc - rc / nc) - (pr / nr - rr / nr)
        return (h - 1 / (2 * beta)) ** 2
    if loss_type == "orpo":  # mean log-probs, no reference
        mc, mr = pc / nc, pr / nr
        log_odds = (mc - math.log(1 - math.exp(mc))) - (mr - math.log(1 - math.exp(mr)))
        return -beta * _log_sigmoid(log_odds)
    if loss_type == "nca_pair":  # absolute implicit rewards, not only their margin
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
        return -_log_sigmoid(chosen) - 0.5 * _log_sigmoid(-chosen) - 0.5 * _log_sigmoid(-rejected)
    assert loss_type == "sigmoid"
    return -_log_sigmoid(beta * ((pc - rc) - (pr - rr)))


def _hand_loss(policy, reference, pairs, source, dpo: DPOSection) -> float:
    """The batch's mean DPO-family loss over ``pairs``, written out from the papers' formulas
    (several loss types: their weighted sum)."""
    types = (dpo.loss_type,) if isinstance(dpo.loss_type, str) else tuple(dpo.loss_type)
    weights = dpo.loss_weights or (1.0,) * len(types)
    losses, chosen_nll, chosen_tokens = [], 0.0, 0
    for index in pairs:
        pair = source.example(index)
        (pc, nc), (pr, nr) = (_sequence_logprob(policy, side) for side in pair.sides)
        (rc, _), (rr, _) = (_sequence_logprob(reference, side) for side in pair.sides)
        chosen_nll, chosen_tokens = chosen_nll - pc, chosen_tokens + nc
        losses.append(sum(w * _one_loss(t, dpo.beta, pc, nc, pr, nr, rc, rr)
                          for t, w in zip(types, weights, strict=True) if t != "sft"))
    # the chosen NLL: rpo_alpha, ORPO's own, and sft's weight in a list
    nll_weight = dpo.rpo_alpha + sum(w for t, w in zip(types, weights, strict=True) if t in ("orpo", "sft"))
    return sum(losses) / len(losses) + nll_weight * chosen_nll / chosen_tokens


@pytest.mark.parametrize("dpo", [{}, {"loss_type": "ipo", "beta": 0.5}, {"rpo_alpha": 0.5},
                                 {"loss_type": "nca_pair", "beta": 0.5}, {"loss_type": "orpo", "beta": 0.5},
                                 {"loss_type": ("sigmoid", "ipo"), "loss_weights": (0.8, 0.2), "rpo_alpha": 0.3},
                                 {"loss_type": ("ipo", "sft"), "loss_weights": (0.6, 0.4)}],
                         ids=["sigmoid", "ipo", "rpo", "nca_pair", "orpo", "weighted_sum", "with_sft"])
def test_reference_and_loss_match_a_hand_computation(tmp_path, dpo):
    cfg = _config(tmp_path, **dpo)
    trainer = _trainer(cfg)
    try:
        start = copy.deepcopy(trainer.model_parts[0]).eval()
        records = trainer.train()
        source = build_preference_source(cfg.dpo_data, trainer.tokenizer)
        known = trainer.reference.known.nonzero()[:, 0].tolist()
        if cfg.dpo.uses_reference:
            # The table: the starting weights' log-probs, pair by pair.
            assert len(known) >= 2 * cfg.training.local_batch_size
            for index in known[:6]:
                for side, column in zip(source.example(index).sides, range(2), strict=True):
                    want, _ = _sequence_logprob(start, side)
                    assert float(trainer.reference.logprobs[index, column]) == pytest.approx(want, abs=2e-4)
            # Step 1: the policy is the reference, so every margin is 0.
            assert records[0]["rewards_margins"] == pytest.approx(0, abs=1e-5)
            assert records[-1]["rewards_margins"] > 0  # and the update moved them
        else:
            assert not known  # no reference pass
        if not dpo:
            assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
        # The next batch's loss from the trainer's packed rows = the hand computation (its
        # pairs are past the run's steps, so their reference values are written in by hand).
        rows = trainer._with_rows(next(trainer.dataloader))
        pairs = sorted({int(i) for i in rows["pair_index"].unique() if i >= 0})
        for index in pairs:
            for column, side in enumerate(source.example(index).sides):
                trainer.reference.logprobs[index, column] = _sequence_logprob(start, side)[0]
            trainer.reference.known[index] = True
        batch = trainer._with_reference(rows, trainer.reference)
        count = torch.tensor(float(len(pairs)))
        chosen_tokens = (batch["labels"][batch["document_ids"] % 2 == 0] >= 0).sum().float()
        trainer.engine.train(False)
        total = trainer.engine.forward_only(trainer.engine.to_device(batch), lambda logits, b: trainer._pair_loss(
            logits, b, global_pairs=count, global_chosen_tokens=chosen_tokens))
        policy = trainer.model_parts[0]
        want = _hand_loss(policy, start, pairs, source, cfg.dpo)
        assert float(total) / len(pairs) == pytest.approx(want, rel=1e-4)
    finally:
        trainer.close()


def test_resume_continues_exactly_and_refuses_steps_the_reference_never_scored(tmp_path):
    cfg = _config(tmp_path, steps=4)
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = 2
    trainer = _trainer(cfg)
    try:
        full = trainer.train()
    finally:
        trainer.close()
    folder = tmp_path / "run" / "checkpoint"
    shutil.rmtree(folder / "step-4")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    trainer = _trainer(cfg)
    try:
        resumed = trainer.train()
        assert not trainer.reference.known.all()  # the table of the first run, not a new pass
    finally:
        trainer.close()
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:], strict=True):
        assert got["loss"] == want["loss"] and got["rewards_margins"] == want["rewards_margins"]
    validating = _config(tmp_path, steps=4)
    validating.checkpoint.enable = True
    validating.validation.enable = True
    validating.checkpoint.exclude_from_loading = ["dpo_eval_reference"]  # the first run saved none
    shutil.rmtree(folder / "step-4")
    trainer = _trainer(validating)
    try:
        with pytest.raises(ValueError, match="held-out pairs were not scored"):
            trainer.train()
    finally:
        trainer.close()
    longer = _config(tmp_path, steps=40)
    longer.checkpoint.enable = True
    trainer = _trainer(longer)
    try:
        with pytest.raises(ValueError, match="did not score"):
            trainer.train()
    finally:
        trainer.close()


def test_flags_dpo_cannot_honour_are_refused(tmp_path):
    for change, match in ((lambda c: setattr(c.training, "document_mask", False), "no_document_mask"),
                          (lambda c: setattr(c.training, "loss_type", "dft"), "loss_type"),
                          (lambda c: setattr(c.validation.dataset, "path", "corpus.txt"), "--dpo_data.eval_path")):
        cfg = _config(tmp_path)
        change(cfg)
        with pytest.raises(ValueError, match=match):
            _trainer(cfg)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOSection(loss_type=("hinge",), label_smoothing=0.1)
    DPOSection(loss_type=("hinge", "sigmoid"), label_smoothing=0.1)  # sigmoid reads it
    with pytest.raises(ValueError, match="one positive weight per --dpo.loss_type"):
        DPOSection(loss_type=("sigmoid", "ipo"), loss_weights=(1.0,))
    with pytest.raises(ValueError, match="sft alone is supervised fine-tuning"):
        DPOSection(loss_type=("sft",))
    with pytest.raises(ValueError, match="add the same term"):
        DPOSection(loss_type=("sigmoid", "sft"), rpo_alpha=0.5)
    with pytest.raises(ValueError, match="at most once"):
        DPOSection(loss_type=("sigmoid", "sigmoid"))
    with pytest.raises(ValueError, match="simpo_gamma is read by --dpo.loss_type simpo"):
        DPOSection(loss_type=("sigmoid", "ipo"), simpo_gamma=1.0)
    with pytest.raises(ValueError, match="beta"):
        DPOSection(beta=0)


def test_reference_free_compares_against_a_uniform_reference(tmp_path):
    cfg = _config(tmp_path, steps=1, reference_free=True)
    trainer = _trainer(cfg)
    try:
        start = copy.deepcopy(trainer.model_parts[0]).eval()
        batch = trainer.next_microbatches(iter(trainer._preference_loader(0, 1)))[0]
        records = trainer.train()
        assert not trainer.reference.known.any()  # no reference pass
        source = build_preference_source(cfg.dpo_data, trainer.tokenizer)
        pairs = sorted({int(i) for i in batch["pair_index"].unique() if i >= 0})
        beta = cfg.dpo.beta
        margins = []
        for index in pairs:
            (pc, _), (pr, _) = (_sequence_logprob(start, side) for side in source.example(index).sides)
            margins.append(beta * (pc - pr))
        assert records[0]["rewards_margins"] == pytest.approx(sum(margins) / len(margins), rel=1e-4)
    finally:
        trainer.close()


def test_validation_scores_held_out_pairs_against_the_starting_reference(tmp_path):
    cfg = _config(tmp_path, steps=2, rpo_alpha=0.3)
    cfg.dpo_data.synthetic_eval_examples = 12
    cfg.validation.enable = True
    cfg.validation.steps = -1  # every held-out pair
    trainer = _trainer(cfg)
    try:
        start = copy.deepcopy(trainer.model_parts[0]).eval()
        records = trainer.train()
        held_out = build_preference_source(cfg.dpo_data, trainer.tokenizer, held_out=True)
        assert len(held_out) == 12 and bool(trainer.eval_reference.known.all())
        scored = [r for r in records if "validation_loss" in r]
        assert [r["step"] for r in scored] == [2]
        assert scored[0]["validation_pairs"] == 12
        want = _hand_loss(trainer.model_parts[0], start, range(12), held_out, cfg.dpo)
        assert scored[0]["validation_loss"] == pytest.approx(want, rel=1e-4)
        assert 0 <= scored[0]["validation_rewards_accuracies"] <= 1
    finally:
        trainer.close()
