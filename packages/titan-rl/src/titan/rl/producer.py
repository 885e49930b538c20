"""Generating and scoring rollouts: what a generator's process does with its generator.

One :class:`RolloutProducer` wraps one generator (native or vLLM) with the prompt samplers,
the rewards and the sampling settings. A colocated run has one, on rank 0, for all prompts; a
disaggregated run has one on each generator rank, for its share of each rollout's prompts
(``shard`` of ``shards``, contiguous). Shares are cut so that one producer over all prompts
and ``n`` producers over their shares draw the same prompts, and with one shard the same
completions: rollout ``i``'s prompts, refill prompts and sampling seed are functions of ``i``
(and of the shard), so a resumed run regenerates the same rollouts.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from typing import Any

from titan.rl.data import Prompt, PromptSampler
from titan.rl.generate.base import SamplingConfig, take_part
from titan.rl.rewards import build_reward, overlong_penalty
from titan.rl.rollouts import Rollout

logger = logging.getLogger("titan")

SHARD_SEED_STRIDE = 2**48
"""Sampling seeds of different shards are this far apart (refill rounds are 2**32 apart)."""


def share(count: int, shard: int, shards: int) -> tuple[int, int]:
    """The contiguous ``(start, length)`` of ``shard``'s part of ``count`` items split over
    ``shards`` (the first ``count % shards`` parts one longer)."""
    size, extra = divmod(count, shards)
    return shard * size + min(shard, extra), size + (shard < extra)


def _with_variance(groups: list, rewards: list[list[float]], *aligned: list) -> tuple[list, ...]:
    """The groups (with their rewards and the other lists ``aligned`` with them) whose rewards
    are not all equal."""
    keep = [i for i, r in enumerate(rewards) if max(r) > min(r)]
    return tuple([values[i] for i in keep] for values in (groups, rewards, *aligned))


def hub_stop_token_ids(checkpoint: Any, vocab_size: int) -> tuple[int, ...]:
    """The end-of-sequence ids of the Hugging Face folder a run starts from
    (``--checkpoint.initial_load_path`` with ``initial_load_in_hf``): its
    ``generation_config.json``'s ``eos_token_id`` (one or a list, as Llama 3.1 Instruct's
    end-of-text, end-of-message and end-of-turn), else its ``config.json``'s. transformers'
    ``generate`` and vLLM stop at every one of them; () without such a folder."""
    if not (checkpoint.initial_load_in_hf and checkpoint.initial_load_path):
        return ()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(checkpoint.initial_load_path, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
        if value is not None:
            ids = value if isinstance(value, list) else [value]
            return tuple(sorted({int(i) for i in ids if 0 <= int(i) < vocab_size}))
    return ()


class RolloutProducer:
    """Rollouts and held-out scores from one generator (see the module docstring).

    ``config`` is the run's ``RLConfig``; ``generator`` has ``generate(prompt_ids, sampling)``
    and a ``version``; ``tokenizer`` decodes completions for the rewards; ``model_spec``, the
    policy's family, runs a reward model of that family on titan's code."""

    def __init__(self, config: Any, *, generator: Any, tokenizer: Any, train_prompts: list[Prompt],
                 eval_prompts: list[Prompt], shard: int = 0, shards: int = 1, device: Any = "cpu",
                 model_spec: Any | None = None) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not one of {shards} shards")
        self.config, self.generator, self.tokenizer = config, generator, tokenizer
        self.eval_prompts = eval_prompts
        self.shard, self.shards = shard, shards
        self.sampler = PromptSampler(train_prompts, seed=config.debug.seed)
        self.refill_sampler = PromptSampler(train_prompts, seed=config.debug.seed + 1)  # DAPO dynamic sampling
        rl = config.rl
        self.reward = build_reward(
            rl.rewards, weights=rl.reward_weights, format_regex=rl.format_regex, function=rl.reward_function,
            numeric_tolerance=rl.numeric_tolerance, timeout_s=rl.reward_timeout_s, reward_model=rl.reward_model,
            reward_model_batch_size=rl.reward_model_batch_size, device=device, model_spec=model_spec,
        )
        stops = config.sampling.stop_token_ids
        hub_stops = tuple(t for t in hub_stop_token_ids(config.checkpoint, tokenizer.vocab_size)
                          if t not in stops and t != tokenizer.eos_id)
        if hub_stops and shard == 0:
            logger.info("completions also stop at %s, the end-of-sequence ids of %s (as transformers and vLLM "
                        "stop there)", list(hub_stops), config.checkpoint.initial_load_path)
        self.sampling = dataclasses.replace(config.sampling, n=rl.group_size, stop_token_ids=(*stops, *hub_stops))

    def produce(self, index: int) -> Rollout:
        """Generate and score this shard's part of rollout ``index``. With
        --rl.max_refill_rounds, groups without reward variance are replaced by groups of fresh
        prompts (DAPO's dynamic sampling), at most that many extra rounds."""
        start = time.perf_counter()
        rl = self.config.rl
        total = rl.prompts_per_step
        first, count = share(total, self.shard, self.shards)
        version = self.generator.version
        timeouts_before = self.reward.timeouts
        prompts = self.sampler.for_rollout(index, total)[first : first + count]
        groups, rewards, texts, terms = self._generate_scored(prompts, index, 0)
        generated, generated_terms = list(rewards), list(terms)
        rounds = 0
        if rl.max_refill_rounds:
            groups, rewards, texts, terms, prompts = _with_variance(groups, rewards, texts, terms, prompts)
            while len(groups) < count and rounds < rl.max_refill_rounds:
                rounds += 1
                # A stream of its own, positioned by (rollout, round, share): a resumed run refills alike.
                position = ((index * rl.max_refill_rounds) + rounds - 1) * total + first
                fresh = self.refill_sampler.window(position, count)
                more = self._generate_scored(fresh, index, rounds)
                generated += more[1]
                generated_terms += more[3]
                kept = _with_variance(*more, fresh)
                groups, rewards, texts, terms, prompts = (
                    a + b for a, b in zip((groups, rewards, texts, terms, prompts), kept, strict=True))
            groups, rewards, texts, terms, prompts = (
                values[:count] for values in (groups, rewards, texts, terms, prompts))
        return Rollout(index=index, version=version, groups=groups, rewards=rewards, texts=texts,
                       reward_timeouts=self.reward.timeouts - timeouts_before, generated_rewards=generated,
                       refill_rounds=rounds, generation_s=time.perf_counter() - start,
                       prompts=[p.text for p in prompts], answers=[p.answer for p in prompts],
                       reward_terms=terms, generated_reward_terms=generated_terms)

    def _generate_scored(self, prompts: list[Prompt], index: int, round_: int):
        """Completions of ``prompts`` (sampling seeded by rollout, refill round and shard),
        their texts, their rewards (the soft overlong penalty included) and each reward term's
        values per group."""
        rl, sampling = self.config.rl, self.sampling
        if not prompts:  # a share of none: more shards than prompts
            take_part(self.generator, sampling)  # a shared engine still needs this rank
            return [], [], [], []
        if sampling.seed is not None:
            seed = sampling.seed + index + round_ * 2**32 + self.shard * SHARD_SEED_STRIDE
            sampling = dataclasses.replace(sampling, seed=seed)
        groups = self.generator.generate([p.ids for p in prompts], sampling)
        texts = [[self.decode(c.token_ids) for c in group] for group in groups]
        # Every completion in one call: a reward model scores them in batches across groups.
        owners = [p for p, g in zip(prompts, texts, strict=True) for _ in g]
        scores, by_term = self.reward.score_terms([p.text for p in owners], [t for g in texts for t in g],
                                                  [p.answer for p in owners], [p.reward_context for p in owners])
        if rl.overlong_buffer_len:
            penalties = [overlong_penalty(len(c.token_ids), max_new_tokens=sampling.max_new_tokens,
                                          buffer_len=rl.overlong_buffer_len, factor=rl.overlong_penalty_factor)
                         for group in groups for c in group]
            scores = [s + p for s, p in zip(scores, penalties, strict=True)]
            by_term["overlong_penalty"] = penalties
        ends = list(itertools.accumulate(len(g) for g in texts))
        spans = [(end - len(g), end) for g, end in zip(texts, ends, strict=True)]
        rewards = [scores[a:b] for a, b in spans]
        terms = [{label: values[a:b] for label, values in by_term.items()} for a, b in spans]
        return groups, rewards, texts, terms

    def decode(self, token_ids: list[int]) -> str:
        """A completion's text without its stop token."""
        ids = [t for t in token_ids if t != self.tokenizer.eos_id and t not in self.sampling.stop_token_ids]
        return self.tokenizer.decode(ids)

    def held_out_totals(self) -> dict[str, float]:
        """This shard's greedy completions of the held-out prompts (the first
        --rl.eval_prompts), scored: summed reward, summed exact match, each reward term's sum
        (``reward_<label>``) and the count."""
        prompts = self.eval_prompts[: self.config.rl.eval_prompts]
        first, count = share(len(prompts), self.shard, self.shards)
        prompts = prompts[first : first + count]
        greedy = SamplingConfig(temperature=0.0, max_new_tokens=self.sampling.max_new_tokens,
                                stop_token_ids=self.sampling.stop_token_ids, n=1, seed=0)
        if not prompts:
            take_part(self.generator, greedy)
            return {"reward": 0.0, "exact_match": 0.0, "count": 0}
        groups = self.generator.generate([p.ids for p in prompts], greedy)
        texts = [self.decode(g[0].token_ids) for g in groups]
        rewards, terms = self.reward.score_terms([p.text for p in prompts], texts, [p.answer for p in prompts],
                                                 [p.reward_context for p in prompts])
        exact = [float(t.strip() == (p.answer or "").strip()) for t, p in zip(texts, prompts, strict=True)]
        return {"reward": sum(rewards), "exact_match": sum(exact), "count": len(prompts),
                **{f"reward_{label}": sum(values) for label, values in terms.items()}}


def held_out_means(totals: list[dict[str, float]]) -> dict[str, float]:
    """Mean held-out reward, exact match and each reward term (``eval_reward_<label>``) over
    every shard's totals (a shard without prompts holds no term sums)."""
    count = sum(t["count"] for t in totals)
    if not count:
        return {}
    keys = dict.fromkeys(k for t in totals for k in t if k.startswith("reward_"))
    return {"eval_reward": sum(t["reward"] for t in totals) / count,
            "eval_exact_match": sum(t["exact_match"] for t in totals) / count,
            **{f"eval_{key}": sum(t.get(key, 0.0) for t in totals) / count for key in keys}}


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    """One rollout from its shards' parts, in shard order (they must share index and version)."""
    first = parts[0]
    if any(p.index != first.index or p.version != first.version for p in parts):
        raise RuntimeError(f"rollout parts disagree: {[(p.index, p.version) for p in parts]} (index, version)")
    with_reference = {p.ref_logprobs is not None for p in parts}
    if len(with_reference) > 1:
        raise RuntimeError("rollout parts disagree: some carry the KL reference's log-probs, some do not")
    return Rollout(
        ref_logprobs=[r for p in parts for r in p.ref_logprobs] if with_reference == {True} else None,
        index=first.index, version=first.version,
        groups=[g for p in parts for g in p.groups], rewards=[r for p in parts for r in p.rewards],
        texts=[t for p in parts for t in p.texts], generation_s=max(p.generation_s for p in parts),
        reward_timeouts=sum(p.reward_timeouts for p in parts),
        generated_rewards=[r for p in parts for r in (p.generated_rewards or p.rewards)],
        refill_rounds=max(p.refill_rounds for p in parts),
        prompts=[t for p in parts for t in p.prompts], answers=[a for p in parts for a in p.answers],
        reward_terms=[t for p in parts for t in p.reward_terms],
        generated_reward_terms=[t for p in parts for t in (p.generated_reward_terms
                                                           if p.generated_reward_terms is not None
                                                           else p.reward_terms)],
    )


__all__ = ["RolloutProducer", "held_out_means", "merge_rollouts", "share"]
