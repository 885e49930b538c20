"""A learned reward: a Hugging Face sequence-classification model scoring prompt + completion
(``--rl.rewards model --rl.reward_model PATH``), as TRL's ``GRPOTrainer`` scores with a
reward model and OpenRLHF with its ``--reward_pretrain``.

The text scored is the prompt followed by the completion: for a conversational prompt, the
conversation with the completion as the assistant's turn, rendered by the *reward model's*
chat template (its tokenizer folder's, not the policy's); for a text prompt, the two texts
concatenated. It is tokenized by the reward model's tokenizer without adding special tokens,
padded on the right, and the reward is the model's single logit (``logits[:, 0]``), all as TRL
does. A model with more than one label (a classifier) is refused, not read column by column.

The model loads with ``transformers`` (the ``titan-rl[reward-model]`` extra) in the dtype its
checkpoint holds, on the device of the rank that scores (rank 0, each generating rank with
``--rl.colocated_generation every_rank``, or each generator rank), in evaluation mode; a
rollout's completions are scored in batches of ``--rl.reward_model_batch_size``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger("titan")


def _require_transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError(
            "--rl.rewards model needs the transformers package to run the reward model; install the "
            "titan-rl[reward-model] extra (pip install 'titan-rl[reward-model]')"
        ) from None
    return transformers


class RewardModel:
    """Scores (prompt, completion) pairs with a sequence-classification model (module
    docstring). ``path``: a local folder with the model's config, weights and tokenizer."""

    batched = True
    """Scored a batch at a time (:meth:`score_batch`), not one completion per call."""

    def __init__(self, path: str, *, device: torch.device | str = "cpu", batch_size: int = 32) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"--rl.reward_model {path}: no such folder; give a Hugging Face sequence-classification "
                             "model folder (config.json, weights, tokenizer) or its Hub id")
        transformers = _require_transformers()
        self.path, self.device, self.batch_size = path, torch.device(device), batch_size
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype="auto")
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--rl.reward_model {path} cannot be loaded as a sequence-classification model with its "
                             f"tokenizer: {err}") from None
        labels = int(self.model.config.num_labels)
        if labels != 1:
            raise ValueError(f"--rl.reward_model {path} has {labels} labels; a reward model scores with one (a "
                             "classifier's logits are not a reward)")
        if self.tokenizer.pad_token is None:  # as TRL: pad with the end-of-sequence token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()

    def text(self, prompt: str, completion: str, messages: list[dict] | None) -> str:
        """What the model reads: the conversation rendered by its own chat template with the
        completion as the assistant's turn, or the text prompt followed by the completion."""
        if messages is None:
            return prompt + completion
        if not self.tokenizer.chat_template:
            raise ValueError(f"--rl.reward_model {self.path}: the prompts are conversations and the reward model's "
                             "tokenizer has no chat template to render them with")
        conversation = [*messages, {"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(conversation, tokenize=False)

    @torch.no_grad()
    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """The model's logit for each text, in batches of ``batch_size``."""
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start : start + self.batch_size])
            inputs = self.tokenizer(chunk, return_tensors="pt", padding=True, padding_side="right",
                                    add_special_tokens=False).to(self.device)
            scores += self.model(**inputs).logits[:, 0].float().tolist()
        return scores

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    contexts: Sequence[Any | None]) -> list[float]:
        """Rewards of aligned prompts and completions (``contexts``' ``messages``: the
        conversation a prompt was, None for text)."""
        texts = [self.text(p, c, getattr(x, "messages", None)) for p, c, x in zip(prompts, completions, contexts,
                                                                                strict=True)]
        return self.score_texts(texts)


__all__ = ["RewardModel"]
