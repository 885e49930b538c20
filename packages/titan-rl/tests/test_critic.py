"""PPO's critic and GAE: the advantages by hand, the values' positions, the clipped value
loss, learning, and the checkpoint round trip."""

from __future__ import annotations

import pytest
import torch
from titan.rl.advantages import gae, gae_advantages
from titan.rl.critic import Critic
from titan.rl.generate.base import Completion
from titan.rl.rollouts import Rollout, rollout_rows

from titan.recipes.families import model_spec

VOCAB = 64


def _critic(lr: float = 1e-2, value_clip: float = 0.5, batch_size: int = 2, seed: int = 0) -> Critic:
    return Critic.from_model_spec(model_spec("llama3"), "debugmodel_tiny",
                                  overrides={"vocab_size": VOCAB, "max_seq_len": 32}, device=torch.device("cpu"),
                                  seed=seed, lr=lr, value_clip=value_clip, max_norm=1.0, batch_size=batch_size)


def test_gae_by_hand():
    """Rewards 0, 0, 1 and values 0.5, 0.2, 0.4: TD errors (gamma 0.9) 0 + 0.18 - 0.5 =
    -0.32, 0 + 0.36 - 0.2 = 0.16, 1 - 0.4 = 0.6; lam 0.5 chains them with 0.45."""
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.2, 0.4])
    last = 0.6
    middle = 0.16 + 0.45 * last
    first = -0.32 + 0.45 * middle
    torch.testing.assert_close(gae(rewards, values, gamma=0.9, lam=0.5),
                               torch.tensor([first, middle, last], dtype=torch.float64))
    # lam 1, gamma 1: the return (1 at every token) minus the value; lam 0: the one-step TD error.
    torch.testing.assert_close(gae(rewards, values, gamma=1.0, lam=1.0), 1.0 - values.double())
    torch.testing.assert_close(gae(rewards, values, gamma=0.9, lam=0.0),
                               torch.tensor([-0.32, 0.16, 0.6], dtype=torch.float64))
    with pytest.raises(ValueError, match="one value per token"):
        gae(rewards, values[:2], gamma=1.0, lam=1.0)


def test_gae_advantages_add_the_kl_penalty_whiten_and_return_targets():
    """Score 1 at the last token less per-token penalties; the returns are A + V (not
    whitened), the advantages whitened over every token of the batch."""
    penalties = [torch.tensor([0.1, 0.2]), torch.tensor([0.3])]
    values = [torch.tensor([0.5, 0.5]), torch.tensor([0.0])]
    advantages, returns = gae_advantages([1.0, 0.0], penalties, values, eps=0.0)
    # gamma = lam = 1: returns are the rewards-to-go 0.7, 0.8 | -0.3.
    torch.testing.assert_close(torch.cat(returns), torch.tensor([0.7, 0.8, -0.3], dtype=torch.float64))
    raw = torch.tensor([0.2, 0.3, -0.3], dtype=torch.float64)
    torch.testing.assert_close(torch.cat(advantages), (raw - raw.mean()) / raw.std(unbiased=False))


def test_rollout_rows_carry_gae_advantages_values_and_returns():
    """``rollout_rows`` with ``estimator="gae"`` reads the rollout's values and gives each row
    its per-token advantages, values and returns; without values it refuses."""
    groups = [[Completion(prompt_ids=[1, 2], token_ids=[3, 4], logprobs=[-1.0, -1.0], finish_reason="stop"),
               Completion(prompt_ids=[1, 2], token_ids=[5], logprobs=[-1.0], finish_reason="stop")]]
    rollout = Rollout(index=0, version=0, groups=groups, rewards=[[1.0, 0.0]])
    with pytest.raises(ValueError, match="critic's values"):
        rollout_rows(rollout, estimator="gae", normalize_std=False)
    rollout.values = [[[0.5, 0.5], [0.0]]]
    rows = rollout_rows(rollout, estimator="gae", normalize_std=False, gamma=1.0, gae_lambda=1.0)
    assert [r.returns for r in rows] == [[1.0, 1.0], [0.0]]
    assert [r.values for r in rows] == [[0.5, 0.5], [0.0]]
    raw = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    expected = ((raw - raw.mean()) / (raw.std(unbiased=False) + 1e-6)).float()
    torch.testing.assert_close(torch.tensor(rows[0].token_advantages + rows[1].token_advantages), expected)


def test_values_are_read_at_the_positions_before_each_token():
    """V_t is the output at the position before completion token t: it sees the prompt and
    the tokens before t, not t itself, and batching or padding does not change it."""
    critic = _critic()
    prompt, completion = [1, 2, 3], [4, 5, 6]
    values = critic.values([prompt], [completion])[0]
    assert len(values) == 3
    changed_last = critic.values([prompt], [[4, 5, 9]])[0]
    assert changed_last[:3] == pytest.approx(values[:3], abs=1e-6)  # token 6 is not seen by any of them
    changed_first = critic.values([prompt], [[7, 5, 6]])[0]
    assert changed_first[0] == pytest.approx(values[0], abs=1e-6) and changed_first[1] != pytest.approx(values[1])
    # With a longer row beside it (padding on the right) the values stay the same.
    batched = critic.values([prompt, [1, 2, 3, 4, 5, 6, 7]], [completion, [8, 9, 10]])
    assert batched[0] == pytest.approx(values, abs=1e-5)
    # The score head is the output at those positions: the model's own last column.
    with torch.no_grad():
        direct = critic.model(torch.tensor([prompt + completion]))[0, 2:5, 0]
    assert values == pytest.approx(direct.tolist(), abs=1e-6)


def test_clipped_value_loss_by_hand():
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, +-0.2) - R)^2): a prediction moved 1 from
    the old value toward the return keeps the clipped (larger) error."""
    critic = _critic(value_clip=0.2)
    predicted, old, returns = torch.tensor([1.0, 0.1]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0])
    loss, clipped = critic.value_loss(predicted, old, returns)
    assert float(loss) == pytest.approx(0.5 * (0.8**2 + 0.1**2))
    assert int(clipped) == 1


def test_update_fits_the_returns_and_reports_its_statistics():
    """AdamW steps on fixed returns lower the value error; the statistics are the token means
    over the passes."""
    critic = _critic(lr=1e-2, value_clip=100.0)
    prompts, completions = [[1, 2], [3, 4, 5]], [[6, 7, 8], [9]]
    returns = [[1.0, 1.0, 1.0], [-1.0]]

    def error() -> float:
        values = critic.values(prompts, completions)
        return sum((v - r) ** 2 for vs, rs in zip(values, returns, strict=True) for v, r in zip(vs, rs, strict=True))

    errors = [error()]
    for _ in range(3):
        stats = critic.update(prompts, completions, critic.values(prompts, completions), returns, epochs=4,
                              minibatches=2)
        errors.append(error())
    assert errors[-1] < errors[0], errors  # a sign error or a step that never happens would not fall
    assert set(stats) == {"value_loss", "value_clipfrac", "value_grad_norm", "values_mean", "returns_mean",
                          "value_explained_var"}
    assert stats["value_clipfrac"] == 0.0 and stats["returns_mean"] == pytest.approx(0.5)
    assert stats["value_loss"] > 0


def test_take_keeps_the_fresh_head_and_the_checkpoint_round_trips():
    """take() copies every body weight of the policy and leaves the score head; a state
    dict restores weights and AdamW's moments, so the next update is identical."""
    from titan.models.llama3 import build_llama3

    policy = build_llama3("debugmodel_tiny", vocab_size=VOCAB, max_seq_len=32)
    critic = _critic(seed=1)
    head = critic.model.output.weight.clone()
    critic.take(policy.state_dict().items())
    assert critic.taken
    torch.testing.assert_close(critic.model.tok_embeddings.weight, policy.tok_embeddings.weight)
    torch.testing.assert_close(critic.model.output.weight, head)
    with pytest.raises(ValueError, match="no weights for"):
        _critic().take([])

    prompts, completions, returns = [[1, 2]], [[3, 4]], [[1.0, 0.5]]
    critic.update(prompts, completions, critic.values(prompts, completions), returns)
    saved = {k: v for k, v in critic.state_dict().items()}
    copy = _critic(seed=2)
    copy.load_state_dict(_cloned(saved))
    assert copy.taken
    for one, other in ((critic, copy),):
        one.update(prompts, completions, one.values(prompts, completions), returns)
        other.update(prompts, completions, other.values(prompts, completions), returns)
    for name, tensor in critic.model.state_dict().items():
        torch.testing.assert_close(copy.model.state_dict()[name], tensor, rtol=0, atol=0)


def _cloned(state):
    """A deep copy of a nested dict of tensors (what a checkpoint gives back)."""
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    return state.clone()


def test_critic_flags_are_refused_without_gae_and_checked_with_it():
    from titan.rl.config import RLSection

    from titan.recipes.cli import parse_train_args

    for flag, value in (("gae_lambda", 0.95), ("critic_lr", 1e-4), ("value_clip", 0.2), ("critic_model", "rm")):
        with pytest.raises(ValueError, match=f"--rl.{flag} is read by the critic of --rl.advantage_estimator gae"):
            RLSection(**{flag: value})
    with pytest.raises(ValueError, match="--rl.gae_lambda must be in"):
        RLSection(advantage_estimator="gae", gae_lambda=1.5)
    with pytest.raises(ValueError, match="--rl.critic_lr and --rl.value_clip must be > 0"):
        RLSection(advantage_estimator="gae", value_clip=0.0)
    with pytest.raises(ValueError, match="gae whitens over the rollout's tokens"):
        RLSection(advantage_estimator="gae", normalize_std=True)
    section = RLSection(advantage_estimator="gae", gamma=0.99, group_size=1, drop_zero_variance=False)
    assert not section.use_std and section.advantage_options()["gae_lambda"] == 1.0
    parsed = parse_train_args(["--config", "grpo_debug", "--rl.advantage_estimator", "gae", "--rl.gae_lambda", "0.95",
                               "--rl.critic_lr", "2e-5", "--rl.value_clip", "0.2"], command="rl").rl
    assert (parsed.gae_lambda, parsed.critic_lr, parsed.value_clip) == (0.95, 2e-5, 0.2)


def test_values_equal_transformers_scores_and_a_reward_model_folder_loads(tmp_path):
    """The critic's value at each position is what transformers' LlamaForSequenceClassification
    computes there (its score head over the last hidden states, before pooling); a critic
    started from that folder (--rl.critic_model) gives the same values, and a folder of
    another shape is refused by name."""
    import json

    from safetensors.torch import save_file
    from titan.ckpt.hf import load_hf

    transformers = pytest.importorskip("transformers")
    critic = _critic()
    with torch.no_grad():  # every weight off its init, so a swapped name shows
        gen = torch.Generator().manual_seed(3)
        for param in critic.model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    spec = model_spec("llama3")
    adapter = spec.adapter(critic.model)
    save_file({k: v.contiguous() for k, v in adapter.to_hf(critic.model.state_dict()).items()},
              str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**adapter.hf_config(torch_dtype="float32"), "pad_token_id": 0}))

    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]]
    values = critic.values(prompts, completions)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path)).eval()
    for prompt, completion, mine in zip(prompts, completions, values, strict=True):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt + completion])).last_hidden_state
            scores = hf.score(hidden)[0, :, 0]
        theirs = scores[len(prompt) - 1 : len(prompt) + len(completion) - 1]
        torch.testing.assert_close(torch.tensor(mine, dtype=torch.float64), theirs.double(), rtol=1e-5, atol=1e-6)

    started = _critic(seed=7)
    started.load_reward_model(str(tmp_path), spec.adapter(started.model), load_hf)
    assert started.taken
    assert sum(started.values(prompts, completions), []) == pytest.approx(sum(values, []), abs=1e-6)
    wider = Critic.from_model_spec(spec, "debugmodel_tiny", overrides={"vocab_size": VOCAB * 2, "max_seq_len": 32},
                                   device=torch.device("cpu"), lr=1e-3, value_clip=0.5, max_norm=1.0, batch_size=2)
    with pytest.raises(ValueError, match="not shaped like the policy with one score column: tok_embeddings"):
        wider.load_reward_model(str(tmp_path), spec.adapter(wider.model), load_hf)
