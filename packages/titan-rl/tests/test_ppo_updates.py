"""Several optimizer steps per rollout (--rl.ppo_epochs, --rl.minibatches_per_rollout) with
the trainer's own old log-probs and truncated importance weights, against a hand-written PPO
loop over a second, identically initialized engine: the same rollout, the same updates."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from titan.rl.config import RLSection
from titan.rl.controller import RLTrainer
from titan.rl.generate.base import Completion
from titan.rl.rollout_loss import RolloutLoss
from titan.rl.rollouts import Rollout

WORKER = Path(__file__).with_name("sync_worker.py")
PROMPTS = [[5, 6, 7], [9, 10]]
COMPLETIONS = [[[11, 12, 13], [14, 15]], [[16, 17, 18, 19], [20]]]  # 2 prompts x group of 2
REWARDS = [[1.0, 0.0], [0.0, 1.0]]
SEQ = 16


def load_worker():
    spec = importlib.util.spec_from_file_location("rl_sync_worker_ppo", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def label_logprobs(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The engine model's log-probs of ``tokens`` after ``prompt`` (no grad)."""
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = engine.model_parts[0](seq[:, :-1]).float()
    logp = torch.log_softmax(logits, -1)[0, len(prompt) - 1 :]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def make_rollout(engine, *, exact: bool = False) -> Rollout:
    """Completions whose generator log-probs are the model's own shifted per token (so the
    importance weights are not 1: 1.5, 0.8 and a capped 3 among them); ``exact``: unshifted."""
    shifts = [0.0] * 4 if exact else [math.log(1.5), math.log(0.8), math.log(3.0), 0.0]
    groups = []
    for prompt, completions in zip(PROMPTS, COMPLETIONS, strict=True):
        group = []
        for tokens in completions:
            exact = label_logprobs(engine, prompt, tokens)
            gen = [float(v) - shifts[t % len(shifts)] for t, v in enumerate(exact)]
            group.append(Completion(prompt_ids=prompt, token_ids=tokens, logprobs=gen, finish_reason="stop"))
        groups.append(group)
    return Rollout(index=0, version=0, groups=groups, rewards=REWARDS)


def trainer_over(engine, rl: RLSection, rollout: Rollout) -> RLTrainer:
    """An RLTrainer around ``engine`` whose next rollout is ``rollout`` (no generator)."""
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.config = SimpleNamespace(rl=rl, training=SimpleNamespace(seq_len=SEQ, local_batch_size=1, steps=100,
                                                                    loss_chunk_tokens=0))
    trainer.engine, trainer.is_rank0 = engine, True
    trainer.sampling = SimpleNamespace(temperature=1.0, max_new_tokens=4)
    trainer.loss = RolloutLoss(rl, temperature=1.0, chunk_tokens=0)
    trainer.tokenizer = SimpleNamespace(pad_id=0)
    trainer.state = SimpleNamespace(rollout_index=0, skipped=0, entropy_coef=rl.entropy_coef,
                                    kl_in_reward_coef=rl.kl_in_reward_coef)
    trainer.metrics = SimpleNamespace(record_tokens=lambda n: None)
    trainer.timings = {"generation_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
    trainer.next_rollout = lambda: rollout
    return trainer


def hand_written_updates(engine, rollout: Rollout, *, epochs: int, minibatches: int, cap: float) -> None:
    """PPO as written in the papers: old log-probs once before any update, a detached
    truncated weight min(pi_old / pi_gen, cap) per token, GRPO's per-completion token mean
    over each minibatch's completions, one optimizer step per minibatch per epoch."""
    rows = []
    for i, group in enumerate(rollout.groups):
        rewards = torch.tensor(REWARDS[i], dtype=torch.float64)
        adv = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        rows += [(c, float(adv[j])) for j, c in enumerate(group)]
    old = [label_logprobs(engine, c.prompt_ids, c.token_ids) for c, _ in rows]
    weights = [torch.clamp(torch.exp(o - torch.tensor(c.logprobs)), max=cap) for o, (c, _) in zip(old, rows, strict=True)]
    per = len(rows) // minibatches
    for _ in range(epochs):
        for m in range(minibatches):
            chosen = range(m * per, (m + 1) * per)

            def loss(logits, batch, chosen=chosen):
                total = 0.0
                for k, r in enumerate(chosen):
                    completion, adv = rows[r]
                    first = len(completion.prompt_ids) - 1
                    logp = torch.log_softmax(logits[k].float(), -1)[first : first + len(completion.token_ids)]
                    logp = logp.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
                    ratio = torch.exp(logp - old[r])
                    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
                    total = total - (weights[r] * surrogate).mean()
                return total

            seqs = [rows[r][0].prompt_ids + rows[r][0].token_ids for r in chosen]
            input_ids = torch.zeros(len(seqs), SEQ, dtype=torch.long)
            for k, seq in enumerate(seqs):
                input_ids[k, : len(seq) - 1] = torch.tensor(seq[:-1])
            engine.forward_backward({"input_ids": input_ids}, loss, global_token_count=float(len(seqs)))
            engine.optimizer_step()


@pytest.mark.parametrize(("epochs", "minibatches"), [(2, 1), (1, 2), (2, 2)])
def test_ppo_updates_equal_a_hand_written_loop(tmp_path, monkeypatch, epochs, minibatches):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_worker()
    # Adam's eps 1: the update is ~lr * gradient, so float32 rounding differences between the
    # two ways of writing the loss are not amplified by the division by sqrt(v) of tiny
    # gradients (with eps 1e-8 a 1e-9 gradient difference can move a weight by 1e-6). No
    # weight decay: every change of a weight is the loss's doing.
    ours, reference = (worker.make_engine(str(tmp_path / name), adam_eps=1.0, weight_decay=0.0)
                       for name in ("ours", "reference"))
    try:
        rollout = make_rollout(ours)
        initial = {k: v.clone() for k, v in ours.full_state_dict()}
        rl = RLSection(group_size=2, prompts_per_step=2, ppo_epochs=epochs, minibatches_per_rollout=minibatches,
                       old_logprobs="trainer", is_level="token", is_cap=2.0)
        record = trainer_over(ours, rl, rollout).rl_step()
        hand_written_updates(reference, rollout, epochs=epochs, minibatches=minibatches, cap=2.0)
        assert ours.step == reference.step == epochs * minibatches == record["updates"]
        # The importance weights the run logged: the third token of the 3- and 4-token
        # completions has weight 3 (capped at 2): 2 of the 10 tokens.
        assert record["is_weight_max"] == pytest.approx(3.0, rel=1e-5)
        assert record["is_capped_fraction"] == pytest.approx(2 / 10)
        assert record["logprob_diff_max"] == pytest.approx(math.log(3.0), rel=1e-5)
        ours_weights, reference_weights = dict(ours.full_state_dict()), dict(reference.full_state_dict())
        for name, value in reference_weights.items():
            update = value - initial[name]
            assert torch.count_nonzero(update), f"{name} did not move"
            # The same updates with the loss written two ways: they agree to 0.1% of the
            # largest update, plus a few float32 ulps of the weights they were added to.
            tolerance = 1e-3 * float(update.abs().max()) + 8 * torch.finfo(torch.float32).eps * float(value.abs().max())
            torch.testing.assert_close(ours_weights[name] - initial[name], update, rtol=0, atol=tolerance,
                                       msg=lambda m, name=name: f"{name}: {m}")
    finally:
        ours.close()
        reference.close()


def test_the_mismatch_is_measured_before_any_update_in_bypass_mode(tmp_path, monkeypatch, caplog):
    """Bypass mode has no pre-update pass: with 2 minibatches the second one trains after a
    step, so only the first may be compared with the generator (exact here: a difference
    means policy drift was counted as trainer/generator mismatch, and warned about)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_worker()
    engine = worker.make_engine(str(tmp_path))
    try:
        rollout = make_rollout(engine, exact=True)
        rl = RLSection(group_size=2, prompts_per_step=2, old_logprobs="generator", minibatches_per_rollout=2,
                       max_logprob_diff=1e-4)
        with caplog.at_level("WARNING", logger="titan"):
            record = trainer_over(engine, rl, rollout).rl_step()
        assert record["updates"] == 2 and record["logprob_diff_max"] <= 1e-5, record
        assert not [r for r in caplog.records if "max_logprob_diff" in r.getMessage()]
    finally:
        engine.close()


def test_several_updates_do_not_reuse_stale_old_logprobs(tmp_path, monkeypatch):
    """The second update's ratio is against the pre-update log-probs, not the current ones:
    after the first step the ratio moves away from 1 and clipping can start to act."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_worker()
    engine = worker.make_engine(str(tmp_path))
    try:
        rollout = make_rollout(engine)
        rl = RLSection(group_size=2, prompts_per_step=2, ppo_epochs=3, clip_eps_low=0.0, clip_eps_high=0.0)
        record = trainer_over(engine, rl, rollout).rl_step()
        # eps 0: any ratio != 1 is clipped. The first pass has ratio exactly 1 (nothing
        # clipped); the two later passes have moved weights, so some tokens clip.
        assert 0 < record["clip_fraction"] < 1
    finally:
        engine.close()


def test_router_aux_loss_weight_does_not_depend_on_the_loss_type(tmp_path, monkeypatch):
    """An MoE policy with the router's balancing loss on and zero advantages (only the aux
    loss has a gradient): grpo (divides by completions) and dapo (by tokens) take the same
    step, the step a hand-written token-weighted mean of the microbatches' aux losses takes."""
    from titan.rl.rollouts import build_batch, rollout_rows

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_worker()
    moe = {"spec": worker.qwen3_moe_spec(), "overrides": {"router_aux_loss_coef": 0.05},
           "adam_eps": 1.0, "weight_decay": 0.0}
    engines = {name: worker.make_engine(str(tmp_path / name), **moe) for name in ("grpo", "dapo", "hand")}
    try:
        rollout = make_rollout(engines["grpo"])
        rollout.rewards = [[1.0, 1.0], [0.0, 0.0]]  # every advantage 0
        initial = {k: v.clone() for k, v in engines["grpo"].full_state_dict()}
        for loss_type in ("grpo", "dapo"):
            rl = RLSection(group_size=2, prompts_per_step=2, loss_type=loss_type, drop_zero_variance=False)
            trainer_over(engines[loss_type], rl, rollout).rl_step()
        hand = engines["hand"]
        model = hand.model_parts[0]
        rows = rollout_rows(rollout, drop_zero_variance=False)
        total_tokens = sum(len(r.token_ids) for r in rows)
        loss = 0.0
        for row in rows:  # one row per microbatch, as local_batch_size 1
            batch = build_batch([row], seq_len=SEQ, pad_id=0)
            model(batch["input_ids"])  # the test engines run without document masking
            loss = loss + model.aux_loss() * len(row.token_ids) / total_tokens
        loss.backward()
        hand.optimizer_step()
        weights = {name: dict(engine.full_state_dict()) for name, engine in engines.items()}
        router = [k for k in initial if k.endswith("router.gate.weight")]
        assert router and all(torch.count_nonzero(weights["hand"][k] - initial[k]) for k in router)
        for name, value in weights["hand"].items():
            assert torch.equal(weights["grpo"][name], weights["dapo"][name]), name
            update = value - initial[name]
            tolerance = 1e-3 * float(update.abs().max()) + 8 * torch.finfo(torch.float32).eps * float(value.abs().max())
            torch.testing.assert_close(weights["grpo"][name] - initial[name], update, rtol=0, atol=tolerance,
                                       msg=lambda m, name=name: f"{name}: {m}")
    finally:
        for engine in engines.values():
            engine.close()
