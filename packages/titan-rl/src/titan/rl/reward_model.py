"""A learned reward: a Hugging Face sequence-classification model scoring prompt + completion
(``--rl.rewards model --rl.reward_model PATH``), as TRL's ``GRPOTrainer`` scores with a
reward model and OpenRLHF with its ``--reward_pretrain``.

The text scored is the prompt followed by the completion: for a conversational prompt, the
conversation with the completion as the assistant's turn, rendered by the *reward model's*
chat template (its tokenizer folder's, not the policy's); for a text prompt, the two texts
concatenated. It is tokenized by the reward model's tokenizer without adding special tokens,
padded on the right, and the reward is the model's single logit (``logits[:, 0]``), all as TRL
does. A model with more than one label (a classifier) is refused, not read column by column.

A reward model of the policy's family (its ``config.json``'s ``model_type``, a
``...ForSequenceClassification`` with one label: what ``titan reward`` exports) runs on
titan's own model code (:class:`TitanScorer`, built from its ``config.json`` at any size, read
by the family's adapter, tokenized by titan's ``HFTokenizer`` and rendered by titan's
``ChatTemplate``, no transformers needed); a score is read at each text's last token that is
not the padding id, as transformers pools. Any other architecture loads with ``transformers``
(:class:`TransformersScorer`, the ``titan-rl[reward-model]`` extra). Either runs in the dtype
its checkpoint holds, on the device of the rank that scores (rank 0, each generating rank with
``--rl.colocated_generation every_rank``, or each generator rank), in evaluation mode; a
rollout's completions are scored in batches of ``--rl.reward_model_batch_size``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from titan.models.common.hf_config import hf_num_labels

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


def _read_config(path: str) -> dict[str, Any]:
    """The folder's ``config.json`` (empty when it has none: transformers then says why)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


class TransformersScorer:
    """A reward model loaded by transformers (any architecture it knows)."""

    backend = "transformers"

    def __init__(self, path: str, device: torch.device) -> None:
        transformers = _require_transformers()
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            self.model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype="auto")
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"--rl.reward_model {path} cannot be loaded as a sequence-classification model with its "
                             f"tokenizer: {err}") from None
        _check_one_label(path, int(self.model.config.num_labels))
        if self.tokenizer.pad_token is None:  # as TRL: pad with the end-of-sequence token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.model.to(device).eval()

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer folder has a chat template."""
        return bool(self.tokenizer.chat_template)

    def render(self, conversation: list[dict]) -> str:
        """The conversation as text, by the reward model's own chat template."""
        return self.tokenizer.apply_chat_template(conversation, tokenize=False)

    @torch.no_grad()
    def scores(self, texts: list[str]) -> list[float]:
        """One forward over ``texts`` (padded on the right): each text's logit."""
        inputs = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                                add_special_tokens=False).to(self.device)
        return self.model(**inputs).logits[:, 0].float().tolist()


class TitanScorer:
    """A reward model of ``model_spec``'s family on titan's model code (module docstring)."""

    backend = "titan"

    def __init__(self, path: str, config: dict[str, Any], model_spec: Any, device: torch.device) -> None:
        from titan.ckpt.hf import load_hf
        from titan.rl.generate.native import NativeGenerator
        from titan.train.data.chat import ChatTemplate
        from titan.train.data.tokenizer import HFTokenizer

        spec = model_spec.with_flavor("reward_model", model_spec.args_from_hf_config(config))
        holder = NativeGenerator.from_model_spec(spec, "reward_model", device=device)  # as the teacher is built
        state = load_hf(path, spec.adapter(holder.model))
        holder.load_weights(state.items(), version=0)  # every weight, by name and shape
        dtype = next(t.dtype for t in state.values() if t.is_floating_point())
        self.model = holder.model.to(dtype=dtype)  # in the dtype its checkpoint holds, in evaluation mode
        self.device = device
        self.tokenizer = HFTokenizer(path)
        self.template = ChatTemplate.from_tokenizer_files(path)
        pad = config.get("pad_token_id")
        self.pad_id = int(pad) if isinstance(pad, int) else self.tokenizer.pad_id

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer folder has a chat template."""
        return self.template is not None

    def render(self, conversation: list[dict]) -> str:
        """The conversation as text, by the reward model's own chat template."""
        return self.template.render(conversation)

    @torch.no_grad()
    def scores(self, texts: list[str]) -> list[float]:
        """One forward over ``texts`` (padded on the right with the padding id): each text's
        score at its last token that is not the padding id, as transformers reads it."""
        rows = [self.tokenizer.encode(t) for t in texts]
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        positions = torch.arange(width).expand_as(ids)
        last = torch.where(ids != self.pad_id, positions, torch.zeros_like(positions)).amax(dim=1)
        out = self.model(ids.to(self.device))[..., 0].float()
        return out[torch.arange(len(rows)), last.to(self.device)].tolist()


def _check_one_label(path: str, labels: int) -> None:
    if labels != 1:
        raise ValueError(f"--rl.reward_model {path} has {labels} labels; a reward model scores with one (a "
                         "classifier's logits are not a reward)")


def _runs_on_titan(path: str, config: dict[str, Any], model_spec: Any | None) -> bool:
    """Whether titan's code can run the folder's model: a score head of ``model_spec``'s
    family, with a ``tokenizer.json`` titan's tokenizer reads."""
    return (model_spec is not None and model_spec.args_from_hf_config is not None and model_spec.adapter is not None
            and config.get("model_type") == model_spec.hf_model_type and hf_num_labels(config) > 0
            and os.path.isfile(os.path.join(path, "tokenizer.json")))


class RewardModel:
    """Scores (prompt, completion) pairs with a sequence-classification model (module
    docstring). ``path``: a local folder with the model's config, weights and tokenizer;
    ``model_spec``: the policy's family, whose reward models titan runs itself."""

    batched = True
    """Scored a batch at a time (:meth:`score_batch`), not one completion per call."""

    def __init__(self, path: str, *, device: torch.device | str = "cpu", batch_size: int = 32,
                 model_spec: Any | None = None) -> None:
        if not os.path.isdir(path):
            raise ValueError(f"--rl.reward_model {path}: no such folder; give a Hugging Face sequence-classification "
                             "model folder (config.json, weights, tokenizer) or its Hub id")
        self.path, self.device, self.batch_size = path, torch.device(device), batch_size
        config = _read_config(path)
        if _runs_on_titan(path, config, model_spec):
            _check_one_label(path, hf_num_labels(config))
            self.scorer: TitanScorer | TransformersScorer = TitanScorer(path, config, model_spec, self.device)
        else:
            self.scorer = TransformersScorer(path, self.device)
        logger.info("reward model %s runs on %s's model code", path, self.scorer.backend)

    def text(self, prompt: str, completion: str, messages: list[dict] | None) -> str:
        """What the model reads: the conversation rendered by its own chat template with the
        completion as the assistant's turn, or the text prompt followed by the completion."""
        if messages is None:
            return prompt + completion
        if not self.scorer.has_chat_template:
            raise ValueError(f"--rl.reward_model {self.path}: the prompts are conversations and the reward model's "
                             "tokenizer has no chat template to render them with")
        return self.scorer.render([*messages, {"role": "assistant", "content": completion}])

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """The model's score for each text, in batches of ``batch_size``."""
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            scores += self.scorer.scores(list(texts[start : start + self.batch_size]))
        return scores

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    contexts: Sequence[Any | None]) -> list[float]:
        """Rewards of aligned prompts and completions (``contexts``' ``messages``: the
        conversation a prompt was, None for text)."""
        texts = [self.text(p, c, getattr(x, "messages", None)) for p, c, x in zip(prompts, completions, contexts,
                                                                                strict=True)]
        return self.score_texts(texts)


__all__ = ["RewardModel", "TitanScorer", "TransformersScorer"]
