"""GRPO-family policy losses as pure functions of tensors.

Every loss takes per-token tensors of one microbatch, ``[B, S]`` with one completion per row:

- ``logprobs``: the trainer's log-probabilities of the completion tokens (with gradient);
- ``old_logprobs``: the log-probabilities the PPO ratio is taken against: the trainer's own
  log-probs of the rollout before its first update (``--rl.old_logprobs trainer``), or the
  generator's (``generator``, verl's bypass mode);
- ``advantages``: ``[B]`` (one per completion) or ``[B, S]`` (already broadcast per token);
- ``loss_mask``: 1 on the completion tokens that carry loss, 0 elsewhere.

and returns ``(summed_loss, stats)``. The loss is a **sum** over tokens (or sequences) with the
type's per-token weights; the caller divides it by the global normalizer of
:func:`loss_normalizer` (the engine does, through ``global_token_count``), so every rank and
microbatch adds its share of one global mean. ``stats`` are token sums (``tokens``,
``clipped``, ``kl``, ``entropy`` when computed) that add across microbatches and ranks; divide
by ``tokens`` for the means (:func:`stat_means`).

The types (ratio ``r = exp(logprobs - old_logprobs)``, clipped surrogate
``l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``):

- ``grpo``: token mean within each completion, then mean over completions
  (per-token weight ``1 / |o_i|``, normalizer = number of completions);
- ``dapo``: asymmetric clip (``eps_high > eps_low``), every token of the global batch weighs
  the same (weight 1, normalizer = number of loss tokens);
- ``dr_grpo``: no length normalization: weight 1, normalizer = completions x the generation
  budget (a constant, so long and short completions are not reweighted);
- ``gspo``: one ratio per sequence, the geometric mean of its token ratios
  ``s_i = exp(mean_t(logprobs - old_logprobs))``, clipped per sequence; normalizer = number of
  completions;
- ``cispo`` (MiniMax-M1): no token is dropped from the update; the *weight* is clipped
  instead: ``l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi``, computed as
  ``-sg(clip(r) / r) r A`` (the same gradient, with the weighted advantage as its value);
  every token weighs the same (normalizer = number of loss tokens, as dapo). Its default has
  no lower bound (``eps_low`` 1, as the paper) and DAPO's upper one;
- ``luspo`` (length-unbiased GSPO): GSPO's clipped sequence ratio, each sequence's loss
  weighed by its length (a sum over its tokens, not a mean), so GSPO's bias against long
  completions goes; normalizer = number of completions; the paper's clip 2e-3 / 2.5e-3;
- ``sapo`` (soft adaptive policy optimization): no hard clip; a soft gate
  ``l = -sigmoid(tau (r - 1)) 4 / tau A`` whose gradient is the surrogate's at ``r = 1`` and
  fades smoothly as the ratio leaves 1, faster for negative advantages (``tau`` is
  ``sapo_temperature_pos`` when ``A > 0``, ``sapo_temperature_neg`` otherwise); weights and
  normalizer as grpo.

Two corrections for tokens sampled by a generator that is not exactly the trainer:

- ``is_weights`` (decoupled mode): a detached weight per token (or per sequence) that
  multiplies the clipped surrogate, e.g. the truncated importance weight
  ``min(pi_old / pi_generator, C)`` of :func:`importance_weights` (verl ``rollout_is``, TRL's
  vLLM importance-sampling correction). The PPO ratio then stays a trust region around the
  trainer's own ``pi_old``.
- ``is_cap`` (bypass mode, the ratio is against the generator): the *value* of the unclipped
  branch's ratio is capped at ``is_cap`` while its gradient direction is kept
  (``r * min(1, cap / r)`` with the factor detached), so a token the generator found far less
  likely than the trainer does cannot dominate the update (the clipped surrogate leaves ``r``
  unbounded for negative advantages). Which branch a token takes is decided on the raw ratio
  *before* the cap, so a cap below ``1 + eps_high`` never turns a clipped token (no gradient)
  into an unclipped one.

Dual-clip PPO (``dual_clip`` C, off by default; verl's ``clip_ratio_c``, TRL's ``delta``): for a
negative advantage the surrogate leaves the ratio unbounded above; the loss is held at
``-C A`` once ``r > C``, so such a token adds no gradient.

KL to a frozen reference (``kl_coef > 0``, off by default) adds ``kl_coef * k`` per token
with the estimator ``k1 = log(p/q)``, ``k2 = (log(p/q))^2 / 2`` or
``k3 = q/p - 1 - log(q/p)`` (``p`` the policy, ``q`` the reference), weighted like the policy
term. An entropy bonus (``entropy_coef > 0``) subtracts ``entropy_coef * H`` per token.

High-entropy tokens only (``policy_mask``, TRL's ``top_entropy_quantile``, after Wang et al.
2025, "Beyond the 80/20 Rule"): a 0/1 mask per token multiplies the policy term alone, so only
the "forking" tokens where the policy is least certain carry the policy gradient; the KL and
entropy terms and the normalizer are unchanged. :func:`entropy_threshold` gives the cut.
The same mask carries DeepSeek-V3.2's off-policy sequence masking (:func:`off_policy_mask`,
TRL's ``off_policy_mask_threshold``): a completion with a negative advantage whose tokens the
sampling policy found, on average, more than ``delta`` nats likelier than the policy does
now trains no policy term.

``kl_bias_correction`` (DeepSeek-V3.2's unbiased KL estimate, TRL's
``use_bias_correction_kl``): the tokens were sampled from the policy the ratio is taken
against, not from the current one, so each token's KL estimate is multiplied by the ratio
``r`` (with its gradient), which makes it an unbiased estimate of KL(policy || reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch
from titan.rl.logprobs import token_entropy  # noqa: F401 - the entropy bonus's input, importable here too

LossType = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo", "luspo", "sapo"]
KLEstimator = Literal["k1", "k2", "k3"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "luspo", "sapo")
SAPO_TEMPERATURES: tuple[float, float] = (1.0, 1.05)
"""sapo's default gate temperatures for positive and for other advantages (the paper's)."""
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")

DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "dr_grpo": (0.2, 0.2),
    # Sequence-level ratios move far less than token ratios: GSPO clips in a narrow band.
    "gspo": (3e-4, 4e-4),
    # The clipped quantity is the update's weight, not the update: no lower bound (1 - 1 = 0).
    "cispo": (1.0, 0.28),
    "luspo": (2e-3, 2.5e-3),
    "sapo": (0.0, 0.0),  # not read: sapo has no hard clip
}
"""(eps_low, eps_high) each type uses unless the caller sets them."""

Stats = dict[str, torch.Tensor]

Totals = Callable[[torch.Tensor], torch.Tensor]
"""``totals(x)``: for a per-token ``[B, S]`` tensor, each token's total of ``x`` over its whole
completion, broadcastable to ``[B, S]``: ``[B, 1]`` row sums when each row holds one
completion (:func:`row_totals`), ``[B, S]`` per-token document sums when rows are packed
(:func:`document_totals`). Differentiable; under context parallel summed over the ranks that
hold the completion's other positions."""


def row_totals(sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Totals:
    """:data:`Totals` of rows holding one completion each: ``x.sum(-1, keepdim=True)``, summed
    over the context-parallel ranks by ``sequence_sum`` when given."""
    def totals(x: torch.Tensor) -> torch.Tensor:
        row = x.sum(-1, keepdim=True)
        return sequence_sum(row) if sequence_sum is not None else row

    return totals


def document_sums(values: torch.Tensor, document_ids: torch.Tensor, slots: int) -> torch.Tensor:
    """Per row and document slot, the sums of ``values`` (``[B, S]`` or ``[B, S, C]``) over each
    document's tokens (``document_ids`` ``[B, S]``, document d in slot d; -1, padding, counts
    nowhere): ``[B, slots]`` (or ``[B, slots, C]``). Differentiable in ``values``."""
    inside = (document_ids >= 0).to(values.dtype)
    index = document_ids.clamp(min=0)
    if values.dim() == 3:
        inside, index = inside.unsqueeze(-1), index.unsqueeze(-1).expand_as(values)
    sums = values.new_zeros(values.shape[0], slots, *values.shape[2:])
    return sums.scatter_add(1, index, values * inside)


def document_totals(document_ids: torch.Tensor, slots: int,
                    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Totals:
    """:data:`Totals` of packed rows (``--rl.padding_free``): each token gets the sum over the
    tokens of its own document (``document_ids`` ``[B, S]``, -1 on padding, which gets 0);
    ``slots``: at least the documents a whole row can hold (its length), the same on every
    context-parallel rank, whose shares are summed by ``sequence_sum``."""
    inside = (document_ids >= 0)
    index = document_ids.clamp(min=0)

    def totals(x: torch.Tensor) -> torch.Tensor:
        sums = document_sums(x, document_ids, slots)
        if sequence_sum is not None:
            sums = sequence_sum(sums)
        return sums.gather(1, index) * inside.to(x.dtype)

    return totals


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    log_ratio = logprobs - ref_logprobs  # log p/q
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        # q/p - 1 - log(q/p): unbiased, always >= 0.
        return torch.exp(-log_ratio) - 1 + log_ratio
    raise ValueError(f"--rl.kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def truncate_ratio(ratio: torch.Tensor, cap: float) -> torch.Tensor:
    """``ratio`` with its value capped at ``cap`` and its gradient scaled alike (cap <= 0: off)."""
    if cap <= 0:
        return ratio
    return ratio * (cap / ratio.detach()).clamp(max=1.0)


def _per_token(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Advantages as ``[B, S]`` (a ``[B]`` vector is broadcast along the sequence)."""
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages of shape {tuple(advantages.shape)} do not match logprobs {tuple(like.shape)}")
    return advantages


def _clipped_surrogate(ratio, advantages, eps_low, eps_high, cap: float = 0.0,
                       dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element PPO loss ``-min(r A, clip(r) A)`` and where clipping took effect; with
    ``cap`` the unclipped branch uses the truncated ratio (the branch is chosen on the raw
    ratio first: the module docstring); with ``dual_clip`` C, a negative advantage's loss is
    at most ``-C A`` (dual-clip PPO: a ratio above C adds no gradient)."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    take_clipped = clipped < unclipped  # the clipped branch is the minimum
    loss = -torch.where(take_clipped, clipped, truncate_ratio(ratio, cap) * advantages)
    if dual_clip > 0:
        bound = -dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        take_clipped = take_clipped | dual
    return loss, take_clipped.float()


def importance_weights(
    old_logprobs: torch.Tensor,
    generator_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    level: str = "token",
    cap: float = 2.0,
    mask_low: float = 0.0,
    mask_high: float = 0.0,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    totals: Totals | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Detached weights ``[B, S]`` correcting the trainer/generator mismatch, and their stats.

    The raw weight is ``w = pi_old / pi_generator`` per token (``level="token"``) or, per
    sequence, the product over its loss tokens (``"sequence"``: ``exp(sum_t log w_t)``, given
    to every token of the row). Masked IS: a token (sequence) whose raw weight lies outside
    ``[mask_low, mask_high]`` gets weight 0 (a bound of 0 is no bound). Truncated IS: what
    remains is capped at ``cap`` (0: no cap). Stats are sums over loss tokens:
    ``is_weight`` (the weights used), ``is_capped`` and ``is_masked`` (counts), and
    ``is_weight_max`` (the largest raw weight, a max not a sum). ``sequence_sum``: adds a
    ``[B, 1]`` per-row value over the ranks holding the rows' other positions (context
    parallel splits each row's tokens; a sequence's weight needs all of them); None: whole
    rows are here. ``totals`` (:data:`Totals`, in its place): a completion's sums, for packed
    rows."""
    if level not in ("token", "sequence"):
        raise ValueError(f"--rl.is_level must be token, sequence or off, got {level!r}")
    mask = loss_mask.to(torch.float32)
    log_w = (old_logprobs.detach().float() - generator_logprobs.float()) * mask
    if level == "sequence":
        totals = totals or row_totals(sequence_sum)
        log_w = totals(log_w).expand_as(mask)
    raw = torch.exp(log_w)
    keep = torch.ones_like(mask, dtype=torch.bool)
    if mask_low > 0:
        keep &= raw >= mask_low
    if mask_high > 0:
        keep &= raw <= mask_high
    capped = (raw > cap) & keep if cap > 0 else torch.zeros_like(keep)
    weights = torch.where(keep, raw.clamp(max=cap) if cap > 0 else raw, torch.zeros_like(raw)) * mask
    on = mask > 0
    stats: Stats = {
        "is_weight": weights.sum(),
        "is_capped": (capped & on).float().sum(),
        "is_masked": (~keep & on).float().sum(),
        "is_weight_max": raw[on].max() if on.any() else torch.zeros((), device=raw.device),
    }
    return weights, stats


def entropy_threshold(entropies: torch.Tensor, quantile: float) -> torch.Tensor:
    """The ``quantile`` of ``entropies`` (1-D, any order) with linear interpolation between
    the two nearest values, as ``torch.quantile`` computes it but without its 16M-element
    limit: the tokens at or above it are the top ``1 - quantile`` by entropy."""
    if entropies.dim() != 1 or not entropies.numel():
        raise ValueError(f"entropy_threshold needs a non-empty 1-D tensor, got shape {tuple(entropies.shape)}")
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    ordered = entropies.double().sort().values
    position = quantile * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def off_policy_mask(logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, threshold: float, *,
                    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    totals: Totals | None = None) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, ``[B, S]`` of 0/1: 0 on a token whose
    advantage is negative when its completion's mean ``log pi_sampling - log pi`` over the
    loss tokens exceeds ``threshold`` (the policy has moved away from what it sampled and
    the sample is a bad one), 1 elsewhere. Detached. ``sequence_sum``: under context parallel,
    the sum over the ranks holding the rows' other positions. ``totals``: a completion's sums
    (:data:`Totals`; packed rows)."""
    totals = totals or row_totals(sequence_sum)
    mask = loss_mask.to(logprobs.dtype)
    drift = (sampling_logprobs - logprobs.detach()) * mask
    mean_drift = totals(drift) / totals(mask).clamp(min=1)
    adv = _per_token(advantages.to(logprobs.dtype), logprobs)
    return 1.0 - ((adv < 0) & (mean_drift > threshold)).to(logprobs.dtype)


def sapo_gate(ratio: torch.Tensor, advantages: torch.Tensor, temperatures: tuple[float, float]) -> torch.Tensor:
    """sapo's soft gate ``sigmoid(tau (r - 1)) 4 / tau`` per token (``tau`` the first
    temperature where the advantage is positive, the second elsewhere): 2 / tau at r = 1,
    with slope 1 there, as the unclipped surrogate's."""
    tau = torch.where(advantages > 0, temperatures[0], temperatures[1]).to(ratio.dtype)
    return torch.sigmoid(tau * (ratio - 1)) * 4 / tau


def _gspo_terms(log_ratio, adv, mask, eps_low, eps_high, is_cap, is_weights, totals, dual_clip=0.0,
                policy_mask=None, length_weighted=False):
    """GSPO's policy sum, the per-token weights of its KL and entropy terms (per-sequence token
    means) and its clipped tokens. Its ratio is a sequence's geometric mean of the token
    ratios: ``totals`` (:data:`Totals`) gives each completion's sums, whole under context
    parallel (each rank holds a share of every row's tokens: the shares are summed
    differentiably, the backward sums the gradient back) and per document in packed rows; each
    rank counts its token share of each sequence's loss, which sums to the whole over the
    ranks. ``length_weighted`` (luspo): a sequence's loss counts once per token instead of once
    in all."""
    lengths = totals(mask.detach()).clamp(min=1)
    seq_ratio = torch.exp(totals(log_ratio) / lengths)  # geometric mean
    seq_adv = totals((adv * mask).detach()) / lengths  # the completion's advantage
    seq_loss, seq_clipped = _clipped_surrogate(seq_ratio, seq_adv, eps_low, eps_high, is_cap, dual_clip)
    if is_weights is not None:  # the sequence's mean token weight (its weight, per sequence)
        seq_loss = seq_loss * totals(is_weights.detach() * mask) / lengths
    # Each token carries its sequence's loss / length: this rank's share (all of it without CP),
    # less the tokens --rl.top_entropy_quantile leaves out.
    carrying = mask if policy_mask is None else mask * policy_mask
    per_token = 1 if length_weighted else 1 / lengths
    policy_sum = (seq_loss * carrying * per_token).sum()
    return policy_sum, mask * per_token, seq_clipped.expand_as(mask) * mask


def _kept(weights: torch.Tensor, policy_mask: torch.Tensor | None) -> torch.Tensor:
    """The policy term's per-token weights with the tokens ``policy_mask`` leaves out at 0."""
    return weights if policy_mask is None else weights * policy_mask.to(weights.dtype)


def _sequence_lengths(loss_mask: torch.Tensor, sequence_lengths: torch.Tensor | None) -> torch.Tensor:
    """Loss tokens per row, ``[B, 1]`` (or per token ``[B, S]`` when the caller gives them,
    e.g. under context parallel where a row's shard does not see all its tokens)."""
    if sequence_lengths is not None:
        return sequence_lengths.clamp(min=1)
    return loss_mask.sum(-1, keepdim=True).clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    clip_eps_low: float | None = None,
    clip_eps_high: float | None = None,
    is_cap: float = 0.0,
    is_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    sequence_lengths: torch.Tensor | None = None,
    sequence_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
    totals: Totals | None = None,
    dual_clip: float = 0.0,
    policy_mask: torch.Tensor | None = None,
    kl_bias_correction: bool = False,
    sapo_temperatures: tuple[float, float] = SAPO_TEMPERATURES,
) -> tuple[torch.Tensor, Stats]:
    """The summed loss of one microbatch for ``loss_type`` and its token-sum stats (module
    docstring). ``sequence_lengths`` (optional, ``[B, S]``): each token's completion length,
    for the ``grpo`` weights when rows are split (context parallel). ``is_weights``
    (optional, ``[B, S]``, detached): per-token importance weights on the policy term.
    ``sequence_sum``: under context parallel, a differentiable sum over the ranks holding
    the rows' other positions, for ``gspo``'s sequence ratio (:func:`_gspo_terms`);
    ``totals`` (:data:`Totals`, in its place): a completion's sums, for packed rows.
    ``dual_clip`` C > 1 (0: off): a negative advantage's loss is at most ``-C A`` (verl's
    ``clip_ratio_c``, TRL's ``delta``), counted as clipped; cispo has its own weight clip.
    ``policy_mask`` (optional, ``[B, S]`` of 0/1): the tokens that carry the policy term
    (high-entropy tokens, :func:`off_policy_mask`); the stat ``policy_tokens`` counts them.
    ``kl_bias_correction``: multiply each token's KL estimate by its ratio to ``old_logprobs``
    (module docstring). ``sapo_temperatures``: sapo's gate temperatures for positive and
    other advantages."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"--rl.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    default_low, default_high = DEFAULT_CLIP[loss_type]
    eps_low = default_low if clip_eps_low is None else clip_eps_low
    eps_high = default_high if clip_eps_high is None else clip_eps_high
    mask = loss_mask.to(logprobs.dtype)
    adv = _per_token(advantages.to(logprobs.dtype), logprobs)
    log_ratio = (logprobs - old_logprobs) * mask  # masked tokens contribute 0 (exp -> 1)

    if loss_type in ("gspo", "luspo"):
        policy_sum, weights, clipped = _gspo_terms(log_ratio, adv, mask, eps_low, eps_high, is_cap, is_weights,
                                                   totals or row_totals(sequence_sum), dual_clip, policy_mask,
                                                   length_weighted=loss_type == "luspo")
    elif loss_type == "cispo":
        ratio = torch.exp(log_ratio)
        weight = ratio.clamp(1 - eps_low, 1 + eps_high).detach()
        if is_weights is not None:
            weight = weight * is_weights.detach()
        token_loss = -(weight / ratio.detach()) * ratio * adv  # gradient: -weight * A * grad log pi
        weights = mask
        policy_sum = (token_loss * _kept(weights, policy_mask)).sum()
        clipped = ((ratio.detach() < 1 - eps_low) | (ratio.detach() > 1 + eps_high)).float() * mask
    else:
        if loss_type == "sapo":  # a soft gate, nothing clipped
            token_loss = -sapo_gate(torch.exp(log_ratio), adv, sapo_temperatures) * adv
            token_clipped = torch.zeros_like(token_loss)
        else:
            token_loss, token_clipped = _clipped_surrogate(torch.exp(log_ratio), adv, eps_low, eps_high, is_cap,
                                                           dual_clip)
        if is_weights is not None:
            token_loss = token_loss * is_weights.detach()
        weights = mask / _sequence_lengths(mask, sequence_lengths) if loss_type in ("grpo", "sapo") else mask
        policy_sum = (token_loss * _kept(weights, policy_mask)).sum()
        clipped = token_clipped * mask

    total = policy_sum
    stats: Stats = {"tokens": mask.sum().detach(), "clipped": clipped.sum().detach()}
    if policy_mask is not None:
        stats["policy_tokens"] = (mask * policy_mask).sum().detach()
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator)
        if kl_bias_correction:
            kl = kl * torch.exp(log_ratio)  # the sampled tokens' importance ratio, with its gradient
        if kl_coef > 0:
            total = total + kl_coef * (kl * weights).sum()
        stats["kl"] = (kl.detach() * mask).sum()
    if entropy is not None:
        if entropy_coef > 0:
            total = total - entropy_coef * (entropy * weights).sum()
        stats["entropy"] = (entropy.detach() * mask).sum()
    return total, stats


def adapted_entropy_coef(coef: float, entropy: float, *, target: float, delta: float, low: float,
                         high: float) -> float:
    """The entropy bonus's next coefficient under adaptive entropy control (TRL's
    use_adaptive_entropy): ``delta`` up (at most ``high``) when the step's mean token entropy
    is at or below ``target`` (the policy is collapsing: push it to explore), ``delta`` down (at
    least ``low``) when above."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def loss_normalizer(loss_type: str, loss_mask: torch.Tensor, *, max_new_tokens: int) -> torch.Tensor:
    """What this microbatch adds to the global divisor of the summed loss: completions with
    loss tokens (grpo, gspo, luspo, sapo), loss tokens (dapo, cispo), or completions x
    ``max_new_tokens`` (dr_grpo). Sum it over every microbatch and data-parallel rank of the step."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"--rl.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    mask = loss_mask.float()
    if loss_type in ("dapo", "cispo"):
        return mask.sum()
    completions = (mask.sum(-1) > 0).float().sum()
    if loss_type == "dr_grpo":
        return completions * max_new_tokens
    return completions


def stat_means(stats: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Per-token means of summed stats (tensors or numbers): ``clip_fraction``, ``kl``,
    ``entropy`` (when present)."""
    tokens = max(float(stats["tokens"]), 1.0)
    out = {"clip_fraction": float(stats["clipped"]) / tokens}
    for key in ("kl", "entropy"):
        if key in stats:
            out[key] = float(stats[key]) / tokens
    return out
