"""RL prompts of the synthetic task, and the warm-up's fixed set of demonstrations."""

from __future__ import annotations

import pytest
from titan.rl.data import RLDataConfig, build_prompts
from titan.train.data.sft import SyntheticSFTTask
from titan.train.data.tokenizer import ByteTokenizer


def test_warm_up_demonstrations_are_the_first_training_prompts_and_keep_the_held_out_set():
    tokenizer = ByteTokenizer()
    cfg = RLDataConfig(sft_demonstrations=16)
    train, held_out = build_prompts(cfg, tokenizer)
    demos = SyntheticSFTTask(cfg.sft_config(demonstrations_only=True), tokenizer)
    assert len(train) == cfg.synthetic_examples and len(demos) == 16
    assert demos.train_pairs == [(p.text, p.answer) for p in train[:16]]
    assert demos.eval_pairs == [(p.text, p.answer) for p in held_out]
    # 0: the warm-up sees every training prompt.
    assert len(SyntheticSFTTask(RLDataConfig().sft_config(demonstrations_only=True), tokenizer)) == len(train)
    with pytest.raises(ValueError, match="--rl_data.sft_demonstrations"):
        RLDataConfig(sft_demonstrations=cfg.synthetic_examples + 1)
