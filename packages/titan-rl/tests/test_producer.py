"""Rollouts from one producer or from several generator ranks' shares: the shares cover the
prompts exactly once, one shard is the whole rollout, and parts merge in shard order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from titan.rl.config import RLConfig, RLSection
from titan.rl.data import Prompt
from titan.rl.generate.base import Completion, SamplingConfig
from titan.rl.producer import (
    RolloutProducer,
    held_out_means,
    hub_stop_token_ids,
    merge_rollouts,
    share,
)
from titan.rl.rollouts import Rollout


def test_shares_cover_every_item_once_in_order():
    for count in range(0, 12):
        for shards in range(1, 5):
            parts = [share(count, s, shards) for s in range(shards)]
            covered = [i for start, length in parts for i in range(start, start + length)]
            assert covered == list(range(count)), (count, shards, parts)
            assert max(p[1] for p in parts) - min(p[1] for p in parts) <= 1


class EchoGenerator:
    """Completes prompt p with tokens derived from its ids and the sampling seed: which
    prompts and seed each shard used is visible in the completions."""

    version = 7

    def generate(self, prompt_ids, sampling: SamplingConfig):
        return [[Completion(prompt_ids=ids, token_ids=[ids[0], (sampling.seed or 0) % 1000, j], logprobs=[0.0] * 3,
                            finish_reason="stop") for j in range(sampling.n)] for ids in prompt_ids]


def producer(shard: int, shards: int, **rl) -> RolloutProducer:
    config = RLConfig(rl=RLSection(prompts_per_step=5, group_size=2, rewards=("char_match",), **rl),
                      sampling=SamplingConfig(seed=100, max_new_tokens=4))
    prompts = [Prompt(ids=[10 + i], text=f"p{i}", answer=f"{i}") for i in range(40)]
    tokenizer = SimpleNamespace(eos_id=-1, vocab_size=1000, decode=lambda ids: " ".join(map(str, ids)))
    return RolloutProducer(config, generator=EchoGenerator(), tokenizer=tokenizer, train_prompts=prompts,
                           eval_prompts=prompts[:3], shard=shard, shards=shards)


def test_shards_draw_the_prompts_of_one_producer_and_merge_in_order():
    whole = producer(0, 1).produce(4)
    parts = [producer(s, 2).produce(4) for s in range(2)]
    assert [len(p.groups) for p in parts] == [3, 2]
    merged = merge_rollouts(parts)
    assert merged.prompts == whole.prompts and merged.answers == whole.answers and len(merged.prompts) == 5
    assert [g[0].token_ids[0] - 10 for g in merged.groups] == [int(p[1:]) for p in merged.prompts]  # aligned
    first_tokens = lambda r: [g[0].token_ids[0] for g in r.groups]  # noqa: E731 - the prompt of each group
    assert first_tokens(merged) == first_tokens(whole)
    assert (merged.index, merged.version) == (4, 7)
    # Shard 0 samples with the whole rollout's seed; shard 1 with a seed of its own.
    assert [g[0].token_ids[1] for g in parts[0].groups] == [g[0].token_ids[1] for g in whole.groups[:3]]
    assert parts[1].groups[0][0].token_ids[1] != whole.groups[3][0].token_ids[1]


def test_parts_keep_their_reference_logprobs_in_order():
    """Parts rescored by each rank's KL reference (every rank generating) keep those log-probs
    through the merge, in shard order; a mix of parts with and without them is refused."""
    a = Rollout(index=1, version=2, groups=[[]], rewards=[[1.0]], ref_logprobs=[[[-0.5]]])
    b = Rollout(index=1, version=2, groups=[[], []], rewards=[[0.0], [1.0]], ref_logprobs=[[[-1.0]], [[-2.0]]])
    assert merge_rollouts([a, b]).ref_logprobs == [[[-0.5]], [[-1.0]], [[-2.0]]]
    assert merge_rollouts([Rollout(index=1, version=2, groups=[], rewards=[])]).ref_logprobs is None
    with pytest.raises(RuntimeError, match="some carry the KL reference's log-probs"):
        merge_rollouts([a, Rollout(index=1, version=2, groups=[], rewards=[])])


def test_a_share_of_no_prompts_generates_nothing():
    """More ranks than prompts: the ranks past the last prompt produce an empty part."""
    part = producer(3, 8).produce(0)  # 5 prompts over 8 shards: shard 3 has 1, shard 6 none
    assert len(part.groups) == 1
    empty = producer(6, 8).produce(0)
    assert (empty.groups, empty.rewards) == ([], [])


class CollectiveEchoGenerator(EchoGenerator):
    """An engine shared with other ranks (vLLM's tensor parallel): records every call."""

    collective = True

    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []

    def generate(self, prompt_ids, sampling: SamplingConfig):
        self.calls.append(list(prompt_ids))
        return super().generate(prompt_ids, sampling)


def test_a_share_of_no_prompts_still_takes_part_in_a_shared_engine():
    """A rank without prompts calls an engine it shares with others (collective) with none, as
    often as the ranks with prompts call it, and produces an empty part; a rank's own engine is
    not called for nothing."""
    calls = {}
    for shard in (3, 6):
        part = producer(shard, 8)
        part.generator = CollectiveEchoGenerator()
        rollout, totals = part.produce(0), part.held_out_totals()  # 3 held-out prompts: shard 3 and 6 have none
        calls[shard] = part.generator.calls
    assert len(calls[3]) == len(calls[6]) == 2 and calls[6] == [[], []]
    assert len(calls[3][0]) == 1 and calls[3][1] == []  # a rollout prompt; no held-out one
    assert (rollout.groups, totals["count"]) == ([], 0)
    lone = producer(6, 8)
    lone.generator = recording = CollectiveEchoGenerator()
    recording.collective = False
    lone.produce(0)
    assert recording.calls == []


def test_parts_of_different_rollouts_do_not_merge():
    a = Rollout(index=1, version=2, groups=[], rewards=[])
    b = Rollout(index=2, version=2, groups=[], rewards=[])
    with pytest.raises(RuntimeError, match="rollout parts disagree"):
        merge_rollouts([a, b])


def test_held_out_shares_average_like_the_whole():
    whole = held_out_means([producer(0, 1).held_out_totals()])
    split = held_out_means([producer(s, 2).held_out_totals() for s in range(2)])
    assert split == pytest.approx(whole)
    assert [producer(s, 2).held_out_totals()["count"] for s in range(2)] == [2, 1]
    assert held_out_means([{"reward": 0.0, "exact_match": 0.0, "count": 0}]) == {}
    # Each reward term's mean too (one term here: it is the reward); an empty shard adds nothing.
    assert whole["eval_reward_char_match"] == pytest.approx(whole["eval_reward"])
    empty = {"reward": 0.0, "exact_match": 0.0, "count": 0}
    assert held_out_means([{"reward": 2.0, "exact_match": 1.0, "count": 4, "reward_format": 3.0}, empty]) == {
        "eval_reward": 0.5, "eval_exact_match": 0.25, "eval_reward_format": 0.75}


def test_completions_stop_where_transformers_and_vllm_stop_for_a_hub_start(tmp_path):
    """A run started from a Hugging Face folder stops completions at every end-of-sequence id
    its generation_config.json lists (Llama 3.1 Instruct: end of text, of message, of turn),
    as `generate` and vLLM do, not only at the tokenizer's."""
    from titan.ckpt import CheckpointConfig

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [128001, 128008, 128009]}')
    (tmp_path / "config.json").write_text('{"eos_token_id": 128001}')
    hub = CheckpointConfig(initial_load_path=str(tmp_path), initial_load_in_hf=True)
    assert hub_stop_token_ids(hub, vocab_size=128256) == (128001, 128008, 128009)
    (tmp_path / "generation_config.json").unlink()
    assert hub_stop_token_ids(hub, vocab_size=128256) == (128001,)  # config.json's
    assert hub_stop_token_ids(CheckpointConfig(initial_load_path=str(tmp_path)), vocab_size=128256) == ()  # DCP
    assert hub_stop_token_ids(CheckpointConfig(), vocab_size=128256) == ()

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [3, 5, 999999]}')  # beyond the vocabulary: not a token
    config = RLConfig(rl=RLSection(prompts_per_step=5, group_size=2, rewards=("char_match",)),
                      sampling=SamplingConfig(seed=100, max_new_tokens=4, stop_token_ids=(7,)), checkpoint=hub)
    tokenizer = SimpleNamespace(eos_id=5, vocab_size=1000, decode=str)
    made = RolloutProducer(config, generator=EchoGenerator(), tokenizer=tokenizer, train_prompts=[Prompt(
        ids=[1], text="p", answer="a")], eval_prompts=[])
    assert made.sampling.stop_token_ids == (7, 3)
