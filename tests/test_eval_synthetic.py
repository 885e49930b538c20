"""tools/eval_synthetic.py: greedy answers of a Hugging Face folder on the synthetic task's
held-out prompts, against transformers' greedy decoding; the rates by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import eval_synthetic  # noqa: E402


def test_greedy_answers_are_transformers_and_the_rates_are_counted_by_hand(tmp_path, capsys):
    from titan.train.data.sft import SFTDataConfig, encode_prompt, synthetic_eval_pairs
    from titan.train.data.tokenizer import TokenizerConfig

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, initializer_range=0.3)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path / "model"))
    answers = eval_synthetic.greedy_answers(str(tmp_path / "model"), model="llama3", task="sort", prompts=6)
    tokenizer = TokenizerConfig(kind="byte").build()
    pairs = synthetic_eval_pairs(SFTDataConfig(synthetic_task="sort"))[:6]
    new_tokens = max(len(a) for _, a in pairs) + 4
    for (prompt, answer), (right, got) in zip(pairs, answers, strict=True):
        ids = encode_prompt(prompt, tokenizer)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)[0, len(ids):].tolist()
        assert right == answer and got == tokenizer.decode(out[:out.index(tokenizer.eos_id)] if tokenizer.eos_id in out
                                                           else out)
    fake = [("abc", "abc"), ("abcd", "abxd"), ("ab", "")]
    assert eval_synthetic.accuracy(fake) == {"exact": 1 / 3, "chars": (3 + 3 + 0) / 9}
    assert eval_synthetic.main([str(tmp_path / "model"), "--prompts", "6"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line == {"folder": str(tmp_path / "model"), **eval_synthetic.accuracy(answers)}
    assert eval_synthetic.main([str(tmp_path / "missing")]) == 2
