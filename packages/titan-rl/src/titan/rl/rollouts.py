"""Rollouts: groups of scored completions, and the engine batches they become.

A :class:`Rollout` is what one RL step trains on: for each of N prompts a group of G
completions (from the generator, with the generator's per-token log-probabilities), their
rewards, and the policy version that generated them. :func:`rollout_rows` scores the groups
(advantages, zero-variance groups dropped, truncated completions masked) into one row per
completion, and :func:`build_batch` lays rows out as the engine's batch: a dict of
``[B, S]`` tensors, one completion per row (``prompt + completion`` right-padded to ``S``):

- ``input_ids``: the sequence without its last token; ``labels``: the next token at each
  position, ``-100`` where that token is part of the prompt or padding;
- ``positions`` (0, 1, ...) and ``document_ids`` (0 for the sequence, -1 for the padding:
  its own document, and marked as padding so an MoE router does not count it);
- ``old_logprobs``: the generator's log-probability of each label token (0 elsewhere);
- ``advantages``: the completion's advantage on each of its label tokens;
- ``loss_mask``: 1 where the label is a completion token that carries loss (0 for a
  truncated completion when ``--rl.mask_truncated``);
- ``sequence_lengths``: each loss token's completion length (for GRPO's per-completion token
  mean when context parallel splits a row);
- ``ref_logprobs`` (only when the rows carry them): a frozen reference's log-probabilities;
- ``returns`` and ``old_values`` (only with GAE's rows): each completion token's return and
  the critic's value of it when the rollout was scored, what the critic trains on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from titan.rl.advantages import (
    AGGREGATIONS,
    decoupled_advantages,
    gae_advantages,
    group_advantages,
    nonzero_variance_groups,
    reinforce_pp_advantages,
    whiten_over_tokens,
)
from titan.rl.generate.base import Completion
from titan.rl.losses import kl_estimate, loss_normalizer
from titan.train.data.packing import best_fit_decreasing
from titan.train.loss import IGNORE_INDEX


@dataclass
class Rollout:
    """The completions of one step's prompts, scored."""

    index: int
    """Which rollout of the run this is (0, 1, ...)."""
    version: int
    """Policy version of the weights that generated it."""
    groups: list[list[Completion]]
    """N prompts x G completions."""
    rewards: list[list[float]]
    """N x G rewards."""
    texts: list[list[str]] = field(default_factory=list)
    """N x G decoded completions (for logs)."""
    generation_s: float = 0.0
    """Wall time spent generating (and scoring) it."""
    ref_logprobs: list[list[list[float]]] | None = None
    """N x G per-token log-probs of a frozen reference model (only with the KL penalty)."""
    reward_timeouts: int = 0
    """Reward calls that timed out while scoring it (each scored 0)."""
    generated_rewards: list[list[float]] | None = None
    """The rewards of every group generated for it, before groups without variance were
    replaced (--rl.max_refill_rounds); None: the same as ``rewards``."""
    refill_rounds: int = 0
    """Extra generation rounds it took to replace groups without reward variance."""
    prompts: list[str] = field(default_factory=list)
    """N prompt texts (as the rewards see them), for the completion log; may be empty."""
    answers: list[str | None] = field(default_factory=list)
    """N reference answers (None where the row has none), for the completion log; may be empty."""
    reward_terms: list[dict[str, list[float]]] = field(default_factory=list)
    """Per group, each reward term's unweighted values of its G completions (by the reward's
    label; ``overlong_penalty`` too when on); may be empty."""
    generated_reward_terms: list[dict[str, list[float]]] | None = None
    """The same for every group generated for it (refills included); None: ``reward_terms``."""
    values: list[list[list[float]]] | None = None
    """N x G per-token values of the critic (``--rl.advantage_estimator gae``): the return it
    expects from the state before each completion token."""


@dataclass
class Row:
    """One completion ready for a batch."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    advantage: float
    train: bool
    """False for a truncated completion under --rl.mask_truncated (no loss on its tokens)."""
    ref_logprobs: list[float] | None = None
    """The reference model's log-probs of the tokens (KL penalty only)."""
    token_advantages: list[float] | None = None
    """One advantage per token (REINFORCE++'s returns, GAE), in place of ``advantage``."""
    values: list[float] | None = None
    """GAE: the critic's value of each token when the rollout was scored."""
    returns: list[float] | None = None
    """GAE: each token's return, the critic's regression target."""


class Advantages(NamedTuple):
    """A rollout's advantages (:func:`completion_advantages`)."""

    per_completion: torch.Tensor
    """``[N, G]``: each completion's advantage (its first token's when they differ per token)."""
    keep: torch.Tensor
    """Bool ``[N]``: the groups that train."""
    per_token: list[list[torch.Tensor]] | None = None
    """N x G per-token advantages (REINFORCE++, GAE), None when each completion has one."""
    returns: list[list[torch.Tensor]] | None = None
    """GAE: N x G per-token returns (the critic's targets); None for the other estimators."""


def rollout_rows(
    rollout: Rollout,
    *,
    normalize_std: bool = True,
    drop_zero_variance: bool = True,
    mask_truncated: bool = False,
    estimator: str = "grpo",
    std: str = "population",
    std_scope: str = "group",
    aggregation: str = "sum_then_normalize",
    term_weights: Mapping[str, float] | None = None,
    kl_in_reward_coef: float = 0.0,
    kl_in_reward_estimator: str = "k1",
    gamma: float = 1.0,
    gae_lambda: float = 1.0,
) -> list[Row]:
    """One row per completion, with its advantage (:func:`completion_advantages`);
    completions of groups whose rewards are all equal are left out when
    ``drop_zero_variance``. A rollout without groups (dynamic sampling dropped every one) has
    no rows."""
    if not rollout.groups:
        return []
    advantages, keep, per_token, returns = completion_advantages(
        rollout, normalize_std=normalize_std, drop_zero_variance=drop_zero_variance, estimator=estimator, std=std,
        std_scope=std_scope, aggregation=aggregation, term_weights=term_weights, kl_in_reward_coef=kl_in_reward_coef,
        kl_in_reward_estimator=kl_in_reward_estimator, gamma=gamma, gae_lambda=gae_lambda)
    rows = []
    for i, group in enumerate(rollout.groups):
        if not keep[i]:
            continue
        for j, completion in enumerate(group):
            rows.append(Row(
                prompt_ids=list(completion.prompt_ids),
                token_ids=list(completion.token_ids),
                logprobs=list(completion.logprobs),
                advantage=float(advantages[i, j]),
                train=not (mask_truncated and completion.finish_reason == "length"),
                ref_logprobs=None if rollout.ref_logprobs is None else list(rollout.ref_logprobs[i][j]),
                token_advantages=None if per_token is None else per_token[i][j].tolist(),
                values=None if returns is None else list(rollout.values[i][j]),
                returns=None if returns is None else returns[i][j].tolist(),
            ))
    return rows


def kl_in_reward_penalties(rollout: Rollout, coef: float, estimator: str = "k1") -> list[list[torch.Tensor]]:
    """N x G per-token penalties ``coef x KL`` of the completions (verl's KL in the reward):
    the generator's log-probs against the frozen reference's (``rollout.ref_logprobs``),
    with ``estimator`` (k1, k2, k3). Zeros when ``coef`` is 0 or the reference has not been
    taken yet (the first RL rollout is generated by the reference itself)."""
    out = []
    for i, group in enumerate(rollout.groups):
        row = []
        for j, completion in enumerate(group):
            if coef and rollout.ref_logprobs is not None:
                kl = kl_estimate(torch.tensor(completion.logprobs, dtype=torch.float64),
                                 torch.tensor(rollout.ref_logprobs[i][j], dtype=torch.float64), estimator)
                row.append(coef * kl)
            else:
                row.append(torch.zeros(len(completion.token_ids), dtype=torch.float64))
        out.append(row)
    return out


def mean_token_kl(rollout: Rollout, estimator: str = "k1") -> tuple[float, int]:
    """The KL of a rollout's completions to the reference (``rollout.ref_logprobs``): each
    completion's per-token mean of ``estimator``, averaged over the completions with tokens;
    and how many those are (verl's ``current_kl`` and batch size for its adaptive controller).
    ``(0.0, 0)`` before the reference is taken."""
    if rollout.ref_logprobs is None:
        return 0.0, 0
    means = [float(kl.mean()) for group in kl_in_reward_penalties(rollout, 1.0, estimator) for kl in group if len(kl)]
    return (sum(means) / len(means) if means else 0.0), len(means)


def adapted_kl_coef(coef: float, current_kl: float, *, target: float, horizon: int, completions: int) -> float:
    """The adaptive KL controller of Ziegler et al. 2019 (verl's ``kl_ctrl.type adaptive``,
    OpenRLHF's ``--kl_target``): ``coef`` times ``1 + e x completions / horizon``, with ``e`` the
    measured KL's relative error to ``target`` clipped to [-0.2, 0.2]: the coefficient grows
    while the policy drifts further than the target from the reference and shrinks while it
    stays closer."""
    error = min(max(current_kl / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * completions / horizon)


def completion_advantages(rollout: Rollout, *, normalize_std: bool = True, drop_zero_variance: bool = True,
                          estimator: str = "grpo", std: str = "population", std_scope: str = "group",
                          aggregation: str = "sum_then_normalize", term_weights: Mapping[str, float] | None = None,
                          kl_in_reward_coef: float = 0.0, kl_in_reward_estimator: str = "k1",
                          gamma: float = 1.0, gae_lambda: float = 1.0) -> Advantages:
    """The advantages of a rollout with groups and which groups train (all do unless
    ``drop_zero_variance`` leaves out those whose rewards are all equal). ``aggregation``:
    ``sum_then_normalize`` (``estimator`` grpo or rloo: :func:`group_advantages` of the summed
    rewards) or ``normalize_then_sum`` (GDPO, :func:`decoupled_advantages` of the rollout's
    reward terms with ``term_weights``). ``kl_in_reward_coef`` (verl's KL in the reward):
    each completion's reward loses ``coef x`` its summed per-token KL to the reference
    (:func:`kl_in_reward_penalties`), per token for REINFORCE++ (``gamma`` discounts its
    returns); the groups dropped for zero variance are judged on the rewards alone. ``gae``:
    PPO's advantages from the critic's values in ``rollout.values`` (:func:`_gae`)."""
    rewards = torch.tensor(rollout.rewards, dtype=torch.float64)
    keep = nonzero_variance_groups(rewards) if drop_zero_variance else torch.ones(len(rewards), dtype=torch.bool)
    if estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"):  # per-token rewards
        penalties = kl_in_reward_penalties(rollout, kl_in_reward_coef, kl_in_reward_estimator)
        if estimator == "gae":
            return _gae(rollout, penalties, keep, std=std, gamma=gamma, lam=gae_lambda)
        return _reinforce_pp(rollout, penalties, keep, baseline=estimator.endswith("baseline"), std=std, gamma=gamma)
    if kl_in_reward_coef:
        penalties = kl_in_reward_penalties(rollout, kl_in_reward_coef, kl_in_reward_estimator)
        rewards = rewards - torch.tensor([[float(p.sum()) for p in row] for row in penalties], dtype=torch.float64)
    if aggregation == "normalize_then_sum":
        if not rollout.reward_terms:
            raise ValueError("--rl.multi_objective_aggregation normalize_then_sum needs each reward's own values, "
                             f"and rollout {rollout.index} has none")
        terms = {label: torch.tensor([group[label] for group in rollout.reward_terms], dtype=torch.float64)
                 for label in rollout.reward_terms[0]}
        return Advantages(decoupled_advantages(terms, term_weights or {}, keep=keep, std=std), keep)
    if aggregation != "sum_then_normalize":
        raise ValueError(f"--rl.multi_objective_aggregation must be one of {', '.join(AGGREGATIONS)}, got {aggregation!r}")
    advantages = group_advantages(rewards, normalize_std=normalize_std, estimator=estimator, std=std,
                                  std_scope=std_scope)
    return Advantages(advantages, keep)


def _reinforce_pp(rollout: Rollout, penalties: list[list[torch.Tensor]], keep: torch.Tensor, *, baseline: bool,
                  std: str, gamma: float) -> Advantages:
    """REINFORCE++ over the kept groups' tokens: per-token returns whitened
    (:func:`reinforce_pp_advantages`), or with ``baseline`` the rewards less their group mean
    (and the KL penalties), whitened over the tokens (one value per completion)."""
    kept = [i for i in range(len(rollout.groups)) if keep[i]]
    scores = [rollout.rewards[i][j] for i in kept for j in range(len(rollout.groups[i]))]
    token_penalties = [penalties[i][j] for i in kept for j in range(len(rollout.groups[i]))]
    if baseline:
        totals = [[rollout.rewards[i][j] - float(penalties[i][j].sum()) for j in range(len(rollout.groups[i]))]
                  for i in kept]
        centred = [t - sum(group) / len(group) for group in totals for t in group]
        per_token_flat = whiten_over_tokens([torch.full((len(p),), c, dtype=torch.float64)
                                             for c, p in zip(centred, token_penalties, strict=True)], std=std)
    else:
        per_token_flat = reinforce_pp_advantages(scores, token_penalties, gamma=gamma, std=std)
    per_completion = torch.zeros(len(rollout.groups), len(rollout.groups[0]), dtype=torch.float64)
    per_token: list[list[torch.Tensor]] = [[torch.zeros(len(c.token_ids), dtype=torch.float64) for c in group]
                                           for group in rollout.groups]
    flat = iter(per_token_flat)
    for i in kept:
        for j in range(len(rollout.groups[i])):
            values = next(flat)
            per_token[i][j] = values
            per_completion[i, j] = float(values[0]) if len(values) else 0.0
    return Advantages(per_completion.float(), keep, None if baseline else [[v.float() for v in g] for g in per_token])


def _gae(rollout: Rollout, penalties: list[list[torch.Tensor]], keep: torch.Tensor, *, std: str, gamma: float,
         lam: float) -> Advantages:
    """GAE over the kept groups' completions (:func:`~titan.rl.advantages.gae_advantages`), from
    the critic's values the rollout carries: per-token advantages whitened over those
    completions' tokens, and the returns the critic trains on."""
    if rollout.values is None:
        raise ValueError(f"GAE advantages need the critic's values of rollout {rollout.index}, and it has none")
    kept = [(i, j) for i in range(len(rollout.groups)) if keep[i] for j in range(len(rollout.groups[i]))]
    advantages, returns = gae_advantages(
        [rollout.rewards[i][j] for i, j in kept], [penalties[i][j] for i, j in kept],
        [torch.tensor(rollout.values[i][j], dtype=torch.float64) for i, j in kept], gamma=gamma, lam=lam, std=std)
    per_completion = torch.zeros(len(rollout.groups), len(rollout.groups[0]), dtype=torch.float64)
    per_token = [[torch.zeros(len(c.token_ids)) for c in group] for group in rollout.groups]
    per_token_returns = [[torch.zeros(len(c.token_ids)) for c in group] for group in rollout.groups]
    for (i, j), advantage, target in zip(kept, advantages, returns, strict=True):
        per_token[i][j], per_token_returns[i][j] = advantage.float(), target.float()
        per_completion[i, j] = float(advantage[0]) if len(advantage) else 0.0
    return Advantages(per_completion.float(), keep, per_token, per_token_returns)


def build_batch(rows: Sequence[Row], *, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The engine batch of ``rows`` (module docstring), ``[len(rows), seq_len]``: one
    completion per row."""
    return build_packed_batch([[row] for row in rows], seq_len=seq_len, pad_id=pad_id)


def pack_rows(rows: Sequence[Row], *, seq_len: int) -> list[list[Row]]:
    """``rows`` packed several to a batch row (``--rl.padding_free``): best-fit decreasing by
    sequence length (prompt + completion - 1 positions), so short completions fill the gaps."""
    lengths = [len(r.prompt_ids) + len(r.token_ids) - 1 for r in rows]
    for row, n in zip(rows, lengths, strict=True):
        if n > seq_len:
            _raise_too_long(row, seq_len)
    return [[rows[i] for i in packed] for packed in best_fit_decreasing(lengths, seq_len)]


def padding_fraction(batches: Sequence[Mapping[str, torch.Tensor]]) -> float:
    """The share of the batches' positions outside every sequence with a completion token
    (padding, and the prompts of the rows that only fill a microbatch)."""
    filled = total = 0
    for batch in batches:
        docs, labels = batch["document_ids"], batch["labels"]
        # One key per (row, document); a position is filled when its document has a label.
        keys = torch.arange(len(docs))[:, None] * (docs.shape[1] + 1) + docs
        inside = docs >= 0
        completed = keys[inside & (labels != IGNORE_INDEX)].unique()
        filled += int((torch.isin(keys, completed) & inside).sum())
        total += docs.numel()
    return 1.0 - filled / max(total, 1)


def _raise_too_long(row: Row, seq_len: int) -> None:
    raise ValueError(
        f"a prompt of {len(row.prompt_ids)} tokens plus {len(row.token_ids)} generated ones does not "
        f"fit --training.seq_len {seq_len}; raise it to at least {len(row.prompt_ids) + len(row.token_ids) - 1} or "
        "lower --sampling.max_new_tokens"
    )


def build_packed_batch(packed: Sequence[Sequence[Row]], *, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """The engine batch of ``packed`` rows, ``[len(packed), seq_len]``: each batch row holds
    its completions end to end, each a document of its own (positions restart, attention stays
    inside it), then padding (a document of its own, positions from 0)."""
    batch_size = len(packed)
    input_ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.long)
    positions = torch.arange(seq_len).repeat(batch_size, 1)
    document_ids = torch.full((batch_size, seq_len), -1, dtype=torch.long)  # padding until set
    old_logprobs = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    advantages = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    loss_mask = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    lengths = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    with_ref = any(row.ref_logprobs is not None for rows in packed for row in rows)
    ref_logprobs = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    with_returns = any(row.returns is not None for rows in packed for row in rows)
    returns = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    old_values = torch.zeros((batch_size, seq_len), dtype=torch.float32)
    for r, rows in enumerate(packed):
        start = 0
        for doc, row in enumerate(rows):
            sequence = row.prompt_ids + row.token_ids
            n = len(sequence) - 1
            if n > seq_len:
                _raise_too_long(row, seq_len)
            if start + n > seq_len:
                raise ValueError(f"packed row {r} holds {start + n} positions, more than --training.seq_len {seq_len}")
            end = start + n
            input_ids[r, start:end] = torch.tensor(sequence[:-1])
            positions[r, start:end] = torch.arange(n)
            document_ids[r, start:end] = doc
            first = start + len(row.prompt_ids) - 1  # the position that predicts the first generated token
            completion = slice(first, end)
            labels[r, completion] = torch.tensor(row.token_ids)
            old_logprobs[r, completion] = torch.tensor(row.logprobs, dtype=torch.float32)
            advantages[r, completion] = (row.advantage if row.token_advantages is None
                                         else torch.tensor(row.token_advantages, dtype=torch.float32))
            if row.ref_logprobs:
                ref_logprobs[r, completion] = torch.tensor(row.ref_logprobs, dtype=torch.float32)
            if row.returns:
                returns[r, completion] = torch.tensor(row.returns, dtype=torch.float32)
                old_values[r, completion] = torch.tensor(row.values, dtype=torch.float32)
            if row.train:
                loss_mask[r, completion] = 1.0
                lengths[r, completion] = float(len(row.token_ids))
            start = end
        positions[r, start:] = torch.arange(seq_len - start)  # padding restarts, as its own document
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "positions": positions,
        "document_ids": document_ids,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "loss_mask": loss_mask,
        "sequence_lengths": lengths,
    }
    if with_ref:
        batch["ref_logprobs"] = ref_logprobs
    if with_returns:  # PPO's critic trains on them
        batch["returns"], batch["old_values"] = returns, old_values
    return batch


def rows_loss_normalizer(rows: Sequence[Row], loss_type: str, *, max_new_tokens: int) -> float:
    """The global divisor of a step's summed policy loss over ``rows`` (every row of the
    global batch): :func:`titan.rl.losses.loss_normalizer` of their loss tokens, at least 1."""
    lengths = [len(r.token_ids) if r.train else 0 for r in rows]
    mask = torch.zeros(len(rows), max(lengths + [1]))
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return max(float(loss_normalizer(loss_type, mask, max_new_tokens=max_new_tokens)), 1.0)


def padding_row(prompt_ids: list[int]) -> Row:
    """A row that carries no loss (fills a data-parallel rank's last microbatch)."""
    return Row(prompt_ids=list(prompt_ids), token_ids=[], logprobs=[], advantage=0.0, train=False)


def split_rows(rows: Sequence[Row], *, dp_rank: int, dp_world_size: int, microbatch_size: int) -> list[list[Row]]:
    """This data-parallel rank's microbatches of ``rows``: the rows are dealt out in contiguous
    blocks, and every rank gets the same number of full microbatches (short ones are filled
    with rows that carry no loss), so every rank runs the same collectives."""
    per_step = dp_world_size * microbatch_size
    steps = max(1, -(-len(rows) // per_step))
    filler = padding_row(rows[0].prompt_ids if rows else [0, 0])
    padded = list(rows) + [filler] * (steps * per_step - len(rows))
    share = steps * microbatch_size
    mine = padded[dp_rank * share : (dp_rank + 1) * share]
    return [mine[i : i + microbatch_size] for i in range(0, share, microbatch_size)]


def reward_term_stats(rollout: Rollout) -> dict[str, float]:
    """``reward_<label>_mean`` / ``_std`` of each reward term over every completion generated
    for the rollout (as ``reward_mean``), TRL's per-reward-function metrics."""
    groups = rollout.generated_reward_terms if rollout.generated_reward_terms is not None else rollout.reward_terms
    out: dict[str, float] = {}
    for label in groups[0] if groups else ():
        values = torch.tensor([v for group in groups for v in group[label]], dtype=torch.float64)
        out[f"reward_{label}_mean"] = float(values.mean())
        out[f"reward_{label}_std"] = float(values.std(unbiased=False))
    return out


def rollout_stats(rollout: Rollout) -> dict[str, float]:
    """Reward statistics of every group generated for a rollout (refill rounds included,
    before any filtering), length statistics of the completions it keeps."""
    scored = rollout.generated_rewards if rollout.generated_rewards is not None else rollout.rewards
    rewards = torch.tensor(scored, dtype=torch.float64).flatten()
    completions = [c for group in rollout.groups for c in group]
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float64)
    truncated = sum(c.finish_reason == "length" for c in completions)
    groups = torch.tensor(scored, dtype=torch.float64)
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        **reward_term_stats(rollout),
        "response_length_mean": float(lengths.mean()),
        "response_length_min": float(lengths.min()) if len(lengths) else 0.0,
        "response_length_max": float(lengths.max()) if len(lengths) else 0.0,
        "truncated_fraction": truncated / max(len(completions), 1),
        "zero_variance_fraction": float((~nonzero_variance_groups(groups)).double().mean()),
        "reward_timeouts": rollout.reward_timeouts,
        "refill_rounds": rollout.refill_rounds,
        "groups": len(rollout.groups),
    }
