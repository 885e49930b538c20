"""The model reward (`--rl.rewards model`): a Hugging Face sequence-classification model scores
prompt + completion as TRL scores them (its chat template for conversations, right padding, no
added special tokens, the one logit), in batches whose padding changes no score; what cannot be
a reward model is refused; a `titan rl` run trains on those scores."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from titan.rl.config import RLSection
from titan.rl.rewards import RewardContext, RewardError, build_reward

transformers = pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def reward_model_folder(folder, *, labels: int = 1, chat_template: bool = True):
    """A tiny Llama sequence-classification model with a byte-level BPE tokenizer (no pad
    token: padded with its end-of-sequence token, as TRL pads), saved as the Hub lays one out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["sort: abcd\nWhat is 2+2? The answer is 4. system user assistant"] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    if chat_template:
        tokenizer.chat_template = CHATML
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_labels=labels, pad_token_id=tokenizer.eos_token_id)
    model = transformers.LlamaForSequenceClassification(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def transformers_scores(folder, texts: list[str]) -> list[float]:
    """Each text scored alone by transformers (no padding at all)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0]) for t in texts]


@pytest.mark.parametrize("backend", ["titan", "transformers"])
def test_scores_are_the_models_logit_for_prompt_plus_completion(tmp_path, backend, caplog):
    """Text prompts read prompt + completion; conversations are rendered by the reward model's
    template with the completion as the assistant's turn. Scored in batches of 2 (padded on the
    right), each score equals the text's own score alone by transformers within float32
    rounding; a second reward adds on top with its weight. A reward model of the policy's
    family (Llama here) runs on titan's model code, tokenizer and template renderer; given
    no family, on transformers."""
    import logging

    from titan.recipes.families import model_spec

    folder = str(reward_model_folder(tmp_path / "rm"))
    with caplog.at_level(logging.INFO, logger="titan"):
        reward = build_reward(["model", "exact_match"], weights=[1.0, 2.0], reward_model=folder,
                              reward_model_batch_size=2, model_spec=model_spec("llama3") if backend == "titan" else None)
    assert f"reward model {folder} runs on {backend}'s model code" in caplog.text
    conversation = [{"role": "user", "content": "What is 2+2?"}]
    prompts = ["sort: dcba\n", "sort: ab\n", "ignored when rendered"]
    completions = ["abcd", "a much longer completion than the others", "4"]
    answers = ["abcd", "ab", "4"]
    contexts = [None, None, RewardContext(messages=conversation)]
    got = reward.score(prompts, completions, answers, contexts)
    rendered = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"  # CHATML by hand
    want = transformers_scores(folder, ["sort: dcba\nabcd", "sort: ab\na much longer completion than the others",
                                        rendered])
    assert got == pytest.approx([w + 2.0 * m for w, m in zip(want, [1.0, 0.0, 1.0], strict=True)], abs=1e-5)
    assert len({round(w, 4) for w in want}) == 3  # the texts score differently: the model reads them


def test_what_cannot_be_a_reward_model_is_refused(tmp_path):
    from titan.recipes.families import model_spec

    classifier = str(reward_model_folder(tmp_path / "classifier", labels=2))
    for family in (None, model_spec("llama3")):  # transformers, then titan's code
        with pytest.raises(ValueError, match="has 2 labels; a reward model scores with one"):
            build_reward(["model"], reward_model=classifier, model_spec=family)
    with pytest.raises(ValueError, match="no such folder"):
        build_reward(["model"], reward_model=str(tmp_path / "missing"))
    plain = build_reward(["model"], reward_model=str(reward_model_folder(tmp_path / "plain", chat_template=False)))
    with pytest.raises(RewardError, match="has no chat template"):
        plain.score(["p"], ["c"], [None], [RewardContext(messages=[{"role": "user", "content": "p"}])])
    with pytest.raises(ValueError, match="--rl.rewards model needs --rl.reward_model"):
        RLSection(rewards=("model",))
    with pytest.raises(ValueError, match="is read by --rl.rewards model, which this run does not name"):
        RLSection(reward_model="org/rm")
    with pytest.raises(ValueError, match="--rl.reward_model_batch_size must be >= 1"):
        RLSection(rewards=("model",), reward_model="org/rm", reward_model_batch_size=0)


@pytest.mark.slow
def test_titan_rl_trains_on_the_reward_models_scores(tmp_path):
    """`titan rl --rl.rewards model --rl.reward_model FOLDER`: every logged completion's reward
    is the reward model's score of its prompt and completion as transformers computes it."""
    folder = reward_model_folder(tmp_path / "rm")
    dump = tmp_path / "run"
    cmd = [sys.executable, "-m", "titan.recipes.cli", "rl", "--config", "grpo_debug", "--job.dump_folder", str(dump),
           "--metrics.no_enable_progress_bar", "--training.steps", "4", "--rl.sft_warmup_steps", "1",
           "--rl.eval_freq", "0", "--rl.ppo_epochs", "1", "--rl.prompts_per_step", "2", "--rl.group_size", "4", "--training.local_batch_size",
           "8", "--metrics.log_freq", "1", "--rl.rewards", "model", "--rl.reward_model", str(folder),
           "--rl.log_completions"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (dump / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 8  # 3 RL steps x 2 prompts x 4 completions
    want = transformers_scores(folder, [r["prompt"] + r["completion"] for r in rows])
    assert [r["reward"] for r in rows] == pytest.approx(want, abs=1e-5)
    rl = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if '"rl"' in line]
    assert rl and all(r["reward_std"] > 0 for r in rl)  # continuous scores: every group has something to learn
