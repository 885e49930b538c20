"""`titan reward`: a score head ranks chosen over rejected. The rows hold what the reward model
will score, a sequence's reward is the score at its last token, and the loss is the
Bradley-Terry one by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from preference_runs import resumed_without_the_last_save, tiny_run
from titan.rl.reward_data import RewardDataConfig, encode_scored
from titan.rl.reward_trainer import (
    RewardConfig,
    RewardSection,
    RewardTrainer,
    last_tokens,
    with_score_head,
)
from titan.train.data import TokenizerConfig
from titan.train.data.chat import encode_chat

from titan.recipes.families import model_spec


def _config(tmp_path, *, steps=3, **reward) -> RewardConfig:
    cfg = tiny_run(RewardConfig(), tmp_path, steps=steps, examples=256)
    for key, value in reward.items():
        setattr(cfg.reward, key, value)
    return cfg


def _sequence_reward(model, example) -> float:
    """The score of ``example``'s sequence alone (the ids the rows feed: all but the closing
    token) at its last token, from one plain forward."""
    ids = torch.as_tensor(example.ids[:-1])[None]
    with torch.no_grad():
        return float(model(ids)[0, -1, 0])


def test_last_tokens_mark_each_documents_end():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 1, 1, 1, 1, 1, 1, 1]])
    want = [[0, 0, 1, 0, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0, 0, 1]]
    assert last_tokens(docs).tolist() == want


def test_a_side_is_what_the_reward_model_reads():
    tokenizer = TokenizerConfig(kind="byte").build()
    text = encode_scored("sort: cab\n", "abc", tokenizer, None)
    # prompt + completion as one text, no special tokens; one closing token the rows do not feed
    assert text.ids[:-1].tolist() == tokenizer.encode("sort: cab\nabc") and text.targets.all()
    prompt = [{"role": "user", "content": "hi"}]
    chat = encode_scored(prompt, [{"role": "assistant", "content": "hello"}], tokenizer, None)
    rendered = encode_chat([*prompt, {"role": "assistant", "content": "hello"}], tokenizer, trained_from=1)
    assert np.array_equal(chat.ids[:-1], rendered.ids)  # the whole rendering, its last token included
    with pytest.raises(ValueError, match="all strings or all lists"):
        encode_scored("p", [{"role": "assistant", "content": "x"}], tokenizer, None)


@pytest.mark.parametrize("reward", [{}, {"center_rewards_coefficient": 0.1}], ids=["bradley_terry", "centered"])
def test_loss_and_rewards_match_a_hand_computation(tmp_path, reward):
    cfg = _config(tmp_path, **reward)
    trainer = RewardTrainer(cfg, model_spec=model_spec("llama3"))
    try:
        model = trainer.model_parts[0]
        assert model.output.weight.shape == (1, model.args.dim)  # the score head
        records = trainer.train()
        assert records[-1]["pairs"] > 0
        source = RewardDataConfig(synthetic_examples=256).source(trainer.tokenizer)
        # The next batch's loss and rewards from the trainer's packed rows = the hand
        # computation over each sequence alone.
        rows = trainer.prepare_rows(next(trainer.dataloader), None)
        pairs = sorted({int(i) for i in rows["pair_index"].unique() if i >= 0})
        model.eval()
        hand = [[_sequence_reward(model, side) for side in source.example(i).sides] for i in pairs]
        coefficient = cfg.reward.center_rewards_coefficient
        want = sum(-math.log(1 / (1 + math.exp(-(c - r)))) + coefficient * (c + r) ** 2 for c, r in hand) / len(pairs)
        stats = trainer._new_stats()
        total = trainer.engine.forward_only(trainer.engine.to_device(rows), lambda logits, b: trainer._pair_loss(
            logits, b, global_pairs=torch.tensor(1.0), global_chosen_tokens=torch.tensor(1.0), stats=stats))
        assert float(total) / len(pairs) == pytest.approx(want, rel=1e-5)
        got = trainer.reduce_stats(stats)
        assert got["pairs"] == len(pairs)
        assert got["rewards_chosen"] == pytest.approx(sum(c for c, _ in hand) / len(pairs), rel=1e-5, abs=1e-6)
        assert got["rewards_accuracies"] == pytest.approx(sum(c > r for c, r in hand) / len(pairs))
        # score(): every document's reward, chosen then rejected in each pair slot
        scores = trainer.score({k: v for k, v in rows.items() if k not in ("row_index", "last_token")})
        flat = [s for pair in hand for s in pair]
        assert sorted(scores[scores != 0].tolist()) == pytest.approx(sorted(flat), rel=1e-5)
    finally:
        trainer.close()


def _margin_rows(path, rows: int = 48):
    import json

    letters = "abcdefghijklmnopqrstuvwxyz"
    with open(path, "w") as f:
        for i in range(rows):
            word = "".join(letters[(i * 7 + k * 3) % 26] for k in range(3 + i % 4))
            answer = "".join(sorted(word))
            f.write(json.dumps({"prompt": f"sort: {word}\n", "chosen": answer, "rejected": answer[::-1] + "x",
                                "margin": (i % 3) * 0.5}) + "\n")


def test_a_margin_column_shifts_each_pairs_loss(tmp_path):
    _margin_rows(tmp_path / "prefs.jsonl")
    cfg = _config(tmp_path, steps=2)
    cfg.reward_data = RewardDataConfig(path=str(tmp_path / "prefs.jsonl"))
    trainer = RewardTrainer(cfg, model_spec=model_spec("llama3"))
    try:
        trainer.train()
        source = cfg.reward_data.source(trainer.tokenizer)
        assert source.has_margins and source.example(4).margin == 0.5
        rows = trainer.prepare_rows(next(trainer.dataloader), None)
        assert "margin" in rows
        pairs = sorted({int(i) for i in rows["pair_index"].unique() if i >= 0})
        model = trainer.model_parts[0].eval()
        want = 0.0
        for index in pairs:
            example = source.example(index)
            chosen, rejected = (_sequence_reward(model, side) for side in example.sides)
            want += -math.log(1 / (1 + math.exp(-(chosen - rejected - example.margin))))
        assert {source.example(i).margin for i in pairs} == {0.0, 0.5, 1.0}  # the margins differ: they matter
        total = trainer.engine.forward_only(trainer.engine.to_device(rows), lambda logits, b: trainer._pair_loss(
            logits, b, global_pairs=torch.tensor(1.0), global_chosen_tokens=torch.tensor(1.0)))
        assert float(total) / len(pairs) == pytest.approx(want / len(pairs), rel=1e-5)
    finally:
        trainer.close()


def test_margin_columns_are_checked(tmp_path):
    import json

    tokenizer = TokenizerConfig(kind="byte").build()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b", "margin": "big"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 \(the 1st\): the margin 'big' is not a number"):
        RewardDataConfig(path=str(bad)).source(tokenizer)
    _margin_rows(tmp_path / "prefs.jsonl")
    with pytest.raises(ValueError, match="rows have no 'gap' column"):
        RewardDataConfig(path=str(tmp_path / "prefs.jsonl"), margin_field="gap").source(tokenizer)
    with pytest.raises(ValueError, match="margin_field describe data files"):
        RewardDataConfig(margin_field="gap")
    assert not RewardDataConfig().source(tokenizer).has_margins  # the synthetic task has none


def test_conversational_pairs_are_the_whole_rendered_conversations(tmp_path):
    """An implicit-prompt row (two whole conversations): each side is the conversation rendered
    whole by the chat template, as --rl.rewards model renders a prompt and its completion."""
    import json

    user = {"role": "user", "content": "What is 2+2?"}
    row = {"chosen": [user, {"role": "assistant", "content": "4"}],
           "rejected": [user, {"role": "assistant", "content": "5"}]}
    (tmp_path / "chat.jsonl").write_text(json.dumps(row) + "\n")
    tokenizer = TokenizerConfig(kind="byte").build()
    pair = RewardDataConfig(path=str(tmp_path / "chat.jsonl")).source(tokenizer).example(0)
    for side, conversation in zip(pair.sides, (row["chosen"], row["rejected"]), strict=True):
        want = encode_chat(conversation, tokenizer, trained_from=1).ids
        assert np.array_equal(side.ids[:-1], want)
    assert pair.chosen.ids[:-1].tolist() != pair.rejected.ids[:-1].tolist() and pair.margin is None


def test_training_ranks_chosen_over_rejected(tmp_path):
    trainer = RewardTrainer(_config(tmp_path, steps=30), model_spec=model_spec("llama3"))
    try:
        records = trainer.train()
    finally:
        trainer.close()
    first, last = records[0], records[-1]
    assert last["loss"] < first["loss"] * 0.5
    assert last["rewards_margins"] > first["rewards_margins"] + 1 and last["rewards_accuracies"] > 0.9


def test_resume_continues_exactly(tmp_path):
    cfg = _config(tmp_path, steps=4)
    cfg.checkpoint.enable = True
    cfg.checkpoint.interval = 2
    cfg.checkpoint.last_save_model_only = False
    trainer = RewardTrainer(cfg, model_spec=model_spec("llama3"))
    try:
        full = trainer.train()
        assert set(trainer.checkpointer.states) >= {"model", "dataloader"}
        assert not {"dpo_reference", "dpo_eval_reference"} & set(trainer.checkpointer.states)  # no reference
    finally:
        trainer.close()
    resumed = resumed_without_the_last_save(lambda: RewardTrainer(cfg, model_spec=model_spec("llama3")), tmp_path,
                                            last_step=4)
    assert [r["step"] for r in resumed] == [3, 4]
    for got, want in zip(resumed, full[2:], strict=True):
        assert (got["loss"], got["rewards_margins"], got["pairs"]) == (want["loss"], want["rewards_margins"],
                                                                       want["pairs"])


def test_what_titan_reward_cannot_do_is_refused():
    with pytest.raises(ValueError, match="center_rewards_coefficient must be >= 0"):
        RewardSection(center_rewards_coefficient=-1.0)
    from types import SimpleNamespace

    headless = SimpleNamespace(name="toy", flavors={"tiny": SimpleNamespace(dim=8)})
    with pytest.raises(ValueError, match="toy family does not have"):
        with_score_head(headless, "tiny")
    for family in ("qwen3", "qwen3_moe", "deepseek_v3"):
        spec = with_score_head(model_spec(family), "debugmodel")
        with torch.device("meta"):
            assert spec.build("debugmodel").output.weight.shape[0] == 1, family
