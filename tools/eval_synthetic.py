"""Greedy accuracy of Hugging Face model folders on the synthetic task's held-out prompts.

    python tools/eval_synthetic.py FOLDER [FOLDER ...] [--model llama3] [--task sort] [--prompts 64]

Each folder is a model of the family ``--model`` over the byte tokenizer (what the debug
recipes export with ``--checkpoint.last_save_in_hf``: ``titan sft --config sft_debug``,
``titan gkd --config gkd_debug``, ``titan rl --config grpo_debug``). The prompts are the
task's held-out strings (never trained on: ``synthetic_eval_pairs`` of the default synthetic
flags), decoded greedily by titan's native generator; an answer is the text before EOS. Prints
one line per folder: exact match (the whole answer right) and character match (the share of
answer characters right at their position), the figures the README's distillation table
quotes.
"""

from __future__ import annotations

import argparse
import json
import sys


def greedy_answers(folder: str, *, model: str, task: str, prompts: int) -> list[tuple[str, str]]:
    """(right answer, greedy answer) of the model in ``folder`` on each of the first ``prompts``
    held-out pairs."""
    import torch
    from titan.rl.generate.base import SamplingConfig
    from titan.rl.generate.build import build_teacher
    from titan.train.data.sft import SFTDataConfig, encode_prompt, synthetic_eval_pairs
    from titan.train.data.tokenizer import TokenizerConfig

    from titan.recipes.families import model_spec

    tokenizer = TokenizerConfig(kind="byte").build()
    pairs = synthetic_eval_pairs(SFTDataConfig(synthetic_task=task))[:prompts]
    encoded = [encode_prompt(prompt, tokenizer) for prompt, _ in pairs]
    new_tokens = max(len(answer) for _, answer in pairs) + 4
    generator = build_teacher(folder, model_spec(model), vocab_size=tokenizer.vocab_size,
                              seq_len=max(len(ids) for ids in encoded) + new_tokens, eos_token_id=tokenizer.eos_id,
                              device=torch.device("cpu"), flag="FOLDER")
    groups = generator.generate(encoded, SamplingConfig(temperature=0.0, max_new_tokens=new_tokens))
    out = []
    for (_, answer), (completion,) in zip(pairs, groups, strict=True):
        ids = completion.token_ids
        out.append((answer, tokenizer.decode(ids[:-1] if completion.finish_reason == "stop" else ids)))
    return out


def accuracy(answers: list[tuple[str, str]]) -> dict[str, float]:
    """``{"exact", "chars"}``: the share of answers right whole, and of answer characters right
    at their position."""
    exact = sum(got == answer for answer, got in answers)
    chars = sum(sum(a == b for a, b in zip(got, answer, strict=False)) for answer, got in answers)
    return {"exact": exact / len(answers), "chars": chars / sum(len(answer) for answer, _ in answers)}


def main(argv: list[str] | None = None) -> int:
    """Print each folder's accuracy as a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help="Hugging Face model folders (config.json + safetensors)")
    parser.add_argument("--model", default="llama3", help="the family (titan's --model.name)")
    parser.add_argument("--task", default="sort", choices=("sort", "reverse"))
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts scored")
    args = parser.parse_args(argv)
    for folder in args.folders:
        try:
            result = accuracy(greedy_answers(folder, model=args.model, task=args.task, prompts=args.prompts))
        except ValueError as err:
            print(f"eval_synthetic: {err}", file=sys.stderr)
            return 2
        print(json.dumps({"folder": folder, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
