"""PPO's critic and GAE: the advantages by hand, the values' positions, the clipped value
loss, learning, and the checkpoint round trip."""

from __future__ import annotations

import types

import pytest
import torch
from titan.rl.advantages import gae, gae_advantages
from titan.rl.critic import Critic, clipped_value_loss
from titan.rl.generate.base import Completion
from titan.rl.rollouts import Rollout, Row, build_batch, rollout_rows

from titan.recipes.cli import parse_train_args
from titan.recipes.families import model_spec


def _critic(tmp_path, *flags: str, reward_model: str | None = None) -> Critic:
    """The critic of `titan rl --config grpo_debug --rl.advantage_estimator gae` in this
    process (one rank), with ``flags`` (and built as the reward model in that folder)."""
    config = parse_train_args(["--config", "grpo_debug", "--rl.advantage_estimator", "gae", "--job.dump_folder",
                               str(tmp_path), "--training.local_batch_size", "2", *flags], command="rl")
    tokenizer = config.tokenizer.build()
    return Critic.from_config(config, model_spec=model_spec("llama3"),
                              vocab_size=config.model.resolve_vocab_size(tokenizer.vocab_size), tokenizer=tokenizer,
                              reward_model=reward_model)


def _model(critic: Critic) -> torch.nn.Module:
    return critic.engine.model_parts[0]


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


def test_values_are_read_at_the_positions_before_each_token(tmp_path):
    """V_t is the output at the position before completion token t: it sees the prompt and
    the tokens before t, not t itself, and batching, padding and the rows' dealing into
    microbatches (of 2 here) do not change it."""
    critic = _critic(tmp_path)
    prompt, completion = [1, 2, 3], [4, 5, 6]
    values = critic.values([prompt], [completion])[0]
    assert len(values) == 3
    changed_last = critic.values([prompt], [[4, 5, 9]])[0]
    assert changed_last == pytest.approx(values, abs=1e-6)  # token 6 is not seen by any of them
    changed_first = critic.values([prompt], [[7, 5, 6]])[0]
    assert changed_first[0] == pytest.approx(values[0], abs=1e-6) and changed_first[1] != pytest.approx(values[1])
    batched = critic.values([[9, 9], prompt, [1, 2, 3, 4, 5, 6, 7]], [[8], completion, [8, 9, 10]])
    assert batched[1] == pytest.approx(values, abs=1e-5)
    with torch.no_grad():  # the score head's output at those positions
        direct = _model(critic)(torch.tensor([prompt + completion]))[0, 2:5, 0]
    assert values == pytest.approx(direct.tolist(), abs=1e-6)


def test_clipped_value_loss_by_hand():
    """0.5 max((V - R)^2, (V_old + clip(V - V_old, +-0.2) - R)^2): a prediction moved 1 from
    the old value toward the return keeps the clipped (larger) error."""
    predicted, old, returns = torch.tensor([1.0, 0.1]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 0.0])
    losses, clipped = clipped_value_loss(predicted, old, returns, 0.2)
    torch.testing.assert_close(losses, torch.tensor([0.5 * 0.8**2, 0.5 * 0.1**2]))
    assert clipped.tolist() == [True, False]


def _value_rows(critic: Critic, prompts, completions, returns) -> list[Row]:
    old = critic.values(prompts, completions)
    return [Row(prompt_ids=p, token_ids=c, logprobs=[0.0] * len(c), advantage=0.0, train=True, values=v, returns=r)
            for p, c, v, r in zip(prompts, completions, old, returns, strict=True)]


def _minibatches(rows: list[Row]):
    tokens = float(sum(len(r.token_ids) for r in rows))
    return [(tokens, tokens, [build_batch(rows, seq_len=32, pad_id=0)])]


def test_update_fits_the_returns_and_reports_its_statistics(tmp_path):
    """AdamW steps on fixed returns lower the value error; the statistics are token means
    over the passes, the mean value and return those of the rows."""
    critic = _critic(tmp_path, "--rl.critic_lr", "1e-2", "--rl.value_clip", "100")
    prompts, completions = [[1, 2], [3, 4, 5]], [[6, 7, 8], [9]]
    returns = [[1.0, 1.0, 1.0], [-1.0]]

    def error() -> float:
        values = critic.values(prompts, completions)
        return sum((v - r) ** 2 for vs, rs in zip(values, returns, strict=True) for v, r in zip(vs, rs, strict=True))

    errors = [error()]
    for _ in range(3):
        rows = _value_rows(critic, prompts, completions, returns)
        stats = critic.update(_minibatches(rows), epochs=4, rows=rows)
        errors.append(error())
    assert errors[-1] < errors[0], errors  # a sign error or a step that never happens would not fall
    assert set(stats) == {"value_loss", "value_clipfrac", "value_grad_norm", "values_mean", "returns_mean",
                          "value_explained_var", "value_updates", "value_lr"}
    assert stats["value_lr"] == 1e-2  # constant without --rl.critic_lr_warmup_steps
    assert stats["value_updates"] == 4 * len(_minibatches(rows))  # one optimizer step per minibatch and pass
    assert stats["value_clipfrac"] == 0.0 and stats["returns_mean"] == pytest.approx(0.5)
    assert stats["values_mean"] == pytest.approx(sum(sum(r.values) for r in rows) / 4)
    assert stats["value_loss"] > 0 and stats["value_grad_norm"] > 0


def test_the_critic_lr_warms_up_over_its_optimizer_steps(tmp_path):
    """--rl.critic_lr_warmup_steps 4: the critic's steps apply critic_lr x 1/4, 2/4, 3/4, then
    critic_lr from the fourth on (every minibatch and pass is a step: two passes take two)."""
    critic = _critic(tmp_path, "--rl.critic_lr", "1e-2", "--rl.critic_lr_warmup_steps", "4")
    rows = _value_rows(critic, [[1, 2]], [[3, 4]], [[1.0, 0.5]])
    lrs = []
    for epochs in (1, 2, 1, 1):
        stats = critic.update(_minibatches(rows), epochs=epochs, rows=rows)
        lrs.append(stats["value_lr"])  # the last step's
    assert lrs == pytest.approx([0.25e-2, 0.75e-2, 1e-2, 1e-2], rel=1e-12)


def test_take_keeps_the_fresh_head_and_the_checkpoint_round_trips(tmp_path):
    """take() copies every body weight of the policy's engine and leaves the score head; a
    state dict restores weights, AdamW's moments, the warm-up count and the place in the LR
    warmup (--rl.critic_lr_warmup_steps: a copy restarting it would take a smaller step), so
    the next update is identical and a resumed warm-up does not start over."""
    from titan.models.llama3 import build_llama3

    warmup = ("--rl.critic_lr_warmup_steps", "3")
    critic = _critic(tmp_path / "a", *warmup)
    policy = build_llama3("debugmodel_tiny", vocab_size=_model(critic).tok_embeddings.weight.shape[0], max_seq_len=32)
    head = _model(critic).output.weight.detach().clone()
    critic.take(types.SimpleNamespace(model_parts=[policy]))
    assert critic.taken
    torch.testing.assert_close(_model(critic).tok_embeddings.weight, policy.tok_embeddings.weight)
    torch.testing.assert_close(_model(critic).output.weight, head)
    with pytest.raises(ValueError, match="could not start from the policy"):
        _critic(tmp_path / "b").take(types.SimpleNamespace(model_parts=[torch.nn.Linear(2, 2)]))

    prompts, completions, returns = [[1, 2]], [[3, 4]], [[1.0, 0.5]]
    rows = _value_rows(critic, prompts, completions, returns)
    critic.update(_minibatches(rows), epochs=1, rows=rows)
    critic.warmed_up = 2
    copy = _critic(tmp_path / "c", "--debug.seed", "5", *warmup)
    copy.load_state_dict(_cloned(critic.state_dict()))
    assert copy.taken and copy.warmed_up == 2
    for one in (critic, copy):
        rows = _value_rows(one, prompts, completions, returns)
        assert one.update(_minibatches(rows), epochs=1, rows=rows)["value_lr"] == pytest.approx(1e-5 * 2 / 3)
    for name, tensor in _model(critic).state_dict().items():
        torch.testing.assert_close(_model(copy).state_dict()[name], tensor, rtol=0, atol=0)


def _cloned(state):
    """A deep copy of a nested dict of tensors (what a checkpoint gives back)."""
    if isinstance(state, dict):
        return {k: _cloned(v) for k, v in state.items()}
    return state.clone() if isinstance(state, torch.Tensor) else state


def test_critic_flags_are_refused_without_gae_and_checked_with_it():
    from titan.rl.config import RLSection

    from titan.recipes.cli import parse_train_args

    for flag, value in (("gae_lambda", 0.95), ("critic_lr", 1e-4), ("value_clip", 0.2), ("critic_model", "rm"),
                        ("critic_warmup", 2), ("critic_epochs", 2), ("critic_lr_warmup_steps", 10)):
        with pytest.raises(ValueError, match=f"--rl.{flag} is read by the critic of --rl.advantage_estimator gae"):
            RLSection(**{flag: value})
    with pytest.raises(ValueError, match="--rl.gae_lambda must be in"):
        RLSection(advantage_estimator="gae", gae_lambda=1.5)
    with pytest.raises(ValueError, match="--rl.critic_lr and --rl.value_clip must be > 0"):
        RLSection(advantage_estimator="gae", value_clip=0.0)
    with pytest.raises(ValueError, match="--rl.critic_epochs must be >= 1, got 0"):
        RLSection(advantage_estimator="gae", critic_epochs=0)
    assert RLSection(advantage_estimator="gae", ppo_epochs=2).critic_passes == 2
    assert RLSection(advantage_estimator="gae", ppo_epochs=2, critic_epochs=3).critic_passes == 3
    with pytest.raises(ValueError, match="--rl.critic_warmup counts rollouts and must be >= 0, got -1"):
        RLSection(advantage_estimator="gae", critic_warmup=-1)
    with pytest.raises(ValueError, match="--rl.critic_lr_warmup_steps counts the critic's optimizer steps"):
        RLSection(advantage_estimator="gae", critic_lr_warmup_steps=-1)
    with pytest.raises(ValueError, match="gae whitens over the rollout's tokens"):
        RLSection(advantage_estimator="gae", normalize_std=True)
    section = RLSection(advantage_estimator="gae", gamma=0.99, group_size=1, drop_zero_variance=False)
    assert not section.use_std and section.advantage_options()["gae_lambda"] == 1.0
    parsed = parse_train_args(["--config", "grpo_debug", "--rl.advantage_estimator", "gae", "--rl.gae_lambda", "0.95",
                               "--rl.critic_lr", "2e-5", "--rl.value_clip", "0.2", "--rl.critic_warmup", "3"],
                              command="rl").rl
    assert (parsed.gae_lambda, parsed.critic_lr, parsed.value_clip, parsed.critic_warmup) == (0.95, 2e-5, 0.2, 3)


def test_values_equal_transformers_scores_and_a_reward_model_folder_loads(tmp_path):
    """The critic's value at each position is what transformers' LlamaForSequenceClassification
    computes there (its score head over the last hidden states, before pooling). A critic
    started from that folder (--rl.critic_model) takes its architecture (one layer here, the
    policy four) and gives the same values; what cannot be a critic is refused by name."""
    import json

    from safetensors.torch import save_file
    from titan.ckpt.hf import load_hf

    transformers = pytest.importorskip("transformers")
    critic = _critic(tmp_path / "a", "--model.n_layers", "1")
    with torch.no_grad():  # every weight off its init, so a swapped name shows
        gen = torch.Generator().manual_seed(3)
        for param in _model(critic).parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    adapter = critic.engine.hf_adapter
    folder = tmp_path / "rm"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in adapter.to_hf(_model(critic).state_dict()).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**adapter.hf_config(torch_dtype="float32"), "pad_token_id": 0}))

    prompts, completions = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]]
    values = critic.values(prompts, completions)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    for prompt, completion, mine in zip(prompts, completions, values, strict=True):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([prompt + completion])).last_hidden_state
            scores = hf.score(hidden)[0, :, 0]
        theirs = scores[len(prompt) - 1 : len(prompt) + len(completion) - 1]
        torch.testing.assert_close(torch.tensor(mine, dtype=torch.float64), theirs.double(), rtol=1e-5, atol=1e-6)

    started = _critic(tmp_path / "b", "--debug.seed", "7", reward_model=str(folder))
    assert len(_model(started).layers) == 1 and len(_model(_critic(tmp_path / "p")).layers) == 4
    started.load_reward_model(str(folder), load_hf)
    assert started.taken
    assert sum(started.values(prompts, completions), []) == pytest.approx(sum(values, []), abs=1e-6)
    with pytest.raises(ValueError, match="not shaped like the policy with one score column: tok_embeddings"):
        _critic(tmp_path / "c", "--model.vocab_size", "1024").load_reward_model(str(folder), load_hf)
    with pytest.raises(ValueError, match="the critic must read the policy's tokenizer"):
        _critic(tmp_path / "d", "--model.vocab_size", "1024", reward_model=str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="has 0 score columns"):
        _critic(tmp_path / "e", reward_model=str(folder))
