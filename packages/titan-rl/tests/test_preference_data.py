"""Preference pairs: encoding (text, conversational, implicit prompt), packing in pairs, resume."""

import json

import numpy as np
import pytest
from titan.rl.preference_data import (
    PreferenceDataConfig,
    build_preference_dataloader,
    build_preference_source,
    near_miss,
    split_shared_prompt,
)
from titan.train.data.chat import encode_prompt_completion
from titan.train.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _loader(cfg, **kw):
    args = dict(dp_rank=0, dp_world_size=1, local_batch_size=2, seq_len=64, seed=0)
    return build_preference_dataloader(cfg, TOK, **{**args, **kw})


def test_text_pairs_are_encoded_as_sft_prompt_completion(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    pair = build_preference_source(PreferenceDataConfig(path=path), TOK).example(0)
    want = encode_prompt_completion("2+2=", "4", TOK)
    np.testing.assert_array_equal(pair.chosen.ids, want.ids)
    np.testing.assert_array_equal(pair.chosen.targets, want.targets)
    np.testing.assert_array_equal(pair.rejected.ids, encode_prompt_completion("2+2=", "5", TOK).ids)
    assert len(pair) - 1 == (len(want) - 1) * 2


def test_implicit_prompt_is_the_shared_start_of_both_conversations(tmp_path):
    user = {"role": "user", "content": "hi"}
    good, bad = {"role": "assistant", "content": "hello"}, {"role": "assistant", "content": "go away"}
    assert split_shared_prompt([user, good], [user, bad]) == ([user], [good], [bad])
    implicit = _write(tmp_path / "i.jsonl", [{"chosen": [user, good], "rejected": [user, bad]}])
    explicit = _write(tmp_path / "e.jsonl", [{"prompt": [user], "chosen": [good], "rejected": [bad]}])
    a = build_preference_source(PreferenceDataConfig(path=implicit), TOK).example(0)
    b = build_preference_source(PreferenceDataConfig(path=explicit), TOK).example(0)
    for x, y in zip(a.sides, b.sides, strict=True):
        np.testing.assert_array_equal(x.ids, y.ids)
        np.testing.assert_array_equal(x.targets, y.targets)
    # only the assistant's own turn is trained: the user's words are not targets
    trained = bytes(int(i) for i, t in zip(a.chosen.ids, a.chosen.targets, strict=True) if t and i < 256)
    assert b"hello" in trained and b"hi" not in trained


def test_bad_rows_and_flags_are_refused_naming_what_to_fix(tmp_path):
    no_rejected = _write(tmp_path / "a.jsonl", [{"prompt": "p", "chosen": "c"}])
    with pytest.raises(ValueError, match="'rejected'"):
        build_preference_source(PreferenceDataConfig(path=no_rejected), TOK)
    mixed = _write(tmp_path / "b.jsonl", [{"prompt": "p", "chosen": "c", "rejected": [{"role": "assistant",
                                                                                      "content": "x"}]}])
    with pytest.raises(ValueError, match="row 0"):
        build_preference_source(PreferenceDataConfig(path=mixed), TOK).example(0)
    text = _write(tmp_path / "t.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    with pytest.raises(ValueError, match="--dpo_data.chat_template_kwargs sets a for a tokenizer's chat template"):
        build_preference_source(PreferenceDataConfig(path=text, chat_template_kwargs='{"a": 1}'), TOK)
    # (a template the tokenizer can render; the byte tokenizer cannot, so the check alone)
    from titan.rl.preference_data import refuse_template_flags_for_text

    with pytest.raises(ValueError, match="--dpo_data.chat_template_path sets a chat template, and the rows of x are"):
        refuse_template_flags_for_text(PreferenceDataConfig(path=text, chat_template_path="t.jinja"), "text", "x")
    refuse_template_flags_for_text(PreferenceDataConfig(path=text, chat_template_path="t.jinja"), [{}], "x")
    with pytest.raises(ValueError, match="--dpo_data.prompt_field"):
        PreferenceDataConfig(prompt_field="question")  # synthetic reads no file
    with pytest.raises(ValueError, match="--dpo_data.path"):
        PreferenceDataConfig(format="preference")


def test_a_row_holds_whole_pairs_chosen_then_rejected():
    cfg = PreferenceDataConfig(synthetic_examples=40)
    loader = _loader(cfg, seq_len=160)
    source = build_preference_source(cfg, TOK)
    batch = next(loader)
    for row in range(2):
        docs = batch["document_ids"][row]
        pairs = batch["pair_index"][row]
        n_docs = int(docs.max()) + 1
        assert n_docs % 2 == 0 and n_docs >= 4  # several pairs packed, two documents each
        for k in range(n_docs // 2):
            chosen, rejected = (docs == 2 * k), (docs == 2 * k + 1)
            index = int(pairs[chosen][0])
            assert (pairs[chosen] == index).all() and (pairs[rejected] == index).all()
            pair = source.example(index)
            np.testing.assert_array_equal(batch["input_ids"][row][chosen].numpy(), pair.chosen.ids[:-1])
            np.testing.assert_array_equal(batch["input_ids"][row][rejected].numpy(), pair.rejected.ids[:-1])
        assert (pairs[docs < 0] == -1).all()


def test_pairs_longer_than_a_row_are_dropped_and_counted():
    cfg = PreferenceDataConfig(synthetic_examples=30, synthetic_min_len=3, synthetic_max_len=12)
    loader = _loader(cfg, seq_len=40)
    seen = set()
    for _ in range(8):
        batch = next(loader)
        seen.update(int(i) for i in batch["pair_index"].unique() if i >= 0)
    source = build_preference_source(cfg, TOK)
    too_long = {i for i in range(len(source)) if len(source.example(i)) - 1 > 40}
    assert too_long and not (seen & too_long)
    assert loader.dropped_examples >= len(too_long)
    with pytest.raises(ValueError, match=r"none of the 30 preference pairs fits in seq_len 8 \(chosen and rejected"):
        next(_loader(cfg, seq_len=8))


def test_resume_continues_with_the_same_rows():
    cfg = PreferenceDataConfig(synthetic_examples=50)
    first = _loader(cfg)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    expected = next(first)
    resumed = _loader(cfg)
    resumed.load_state_dict(state)
    got = next(resumed)
    for key in expected:
        assert (got[key] == expected[key]).all(), key
    with pytest.raises(ValueError, match="--training.seq_len"):
        _loader(cfg, seq_len=48).load_state_dict(state)


def test_synthetic_rejected_answer_is_a_near_miss():
    assert near_miss("abc") == "abd" and near_miss("az") == "aa"
    pair = build_preference_source(PreferenceDataConfig(synthetic_examples=4), TOK).example(0)
    chosen = bytes(pair.chosen.ids[pair.chosen.targets][:-1].tolist())
    rejected = bytes(pair.rejected.ids[pair.rejected.targets][:-1].tolist())
    assert chosen != rejected and chosen[:-1] == rejected[:-1]
