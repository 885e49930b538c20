"""Reward-model data (``--reward_data.*``): preference pairs, each side the sequence the reward
model will be asked to score.

The rows are ``titan dpo``'s (TRL's preference datasets: explicit or implicit prompt, text or
conversations, or the synthetic task; :mod:`titan.rl.preference_data`), packed the same way:
a pair's chosen and rejected sequences are documents ``2k`` and ``2k + 1`` of one row. What
differs is each side's tokens. A reward model is trained on exactly what ``titan rl --rl.rewards
model`` (:mod:`titan.rl.reward_model`, as TRL's GRPO) feeds it when scoring a completion:

- text: ``prompt + completion`` tokenized as one text, with no special tokens added;
- conversations: ``prompt + completion`` rendered whole by the chat template (its own special
  tokens included).

A sequence's reward is the score at its last token, where transformers'
``...ForSequenceClassification`` reads it in an exported model. Rows with a margin column
(``--reward_data.margin_field``, TRL's ``margin``: how far the chosen reward should exceed the
rejected one, as Llama 2's reward models were trained) carry it to the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from titan.rl.preference_data import (
    _FILE_FLAGS,
    FilePreferenceSource,
    PreferenceDataConfig,
    PreferencePair,
    PreferenceSource,
    SyntheticPreferenceTask,
    open_rows,
)
from titan.train.data.chat import ChatTemplate, SFTExample, encode_chat
from titan.train.data.records import row_name
from titan.train.data.tokenizer import Tokenizer


@dataclass(kw_only=True)
class RewardDataConfig(PreferenceDataConfig):
    """``--reward_data.*``: the preference pairs a reward model learns to rank (the flags of
    ``--dpo_data.*``)."""

    SECTION: ClassVar[str] = "--reward_data"

    margin_field: str = "margin"
    """The column holding each pair's margin (a number), read when the rows have it: the loss
    becomes ``-log sigmoid(r_chosen - r_rejected - margin)`` (TRL's ``margin`` column)."""

    @classmethod
    def file_flags(cls) -> dict[str, object]:
        """The flags only a data file reads, and their defaults."""
        return {**_FILE_FLAGS, "margin_field": "margin"}

    def source(self, tokenizer: Tokenizer, *, held_out: bool = False) -> ScoredPairs:
        """The pairs, each side encoded as the reward model reads it (module docstring), with
        their margins when the rows have a margin column."""
        if self.resolved_format == "synthetic":
            return ScoredPairs(SyntheticPreferenceTask(self, tokenizer, held_out=held_out), tokenizer)
        dataset, template, flag = open_rows(self, tokenizer, held_out=held_out)
        margins = None
        if self.margin_field in dataset.column_names:
            margins = [_margin(value, index, flag) for index, value in enumerate(dataset[self.margin_field])]
        elif self.margin_field != "margin":
            raise ValueError(f"{flag}: rows have no {self.margin_field!r} column ({self.SECTION}.margin_field; "
                             f"columns: {', '.join(dataset.column_names)})")
        return ScoredPairs(FilePreferenceSource(dataset, self, tokenizer, template, flag=flag), tokenizer, margins)


def _margin(value: Any, index: int, flag: str) -> float:
    """A row's margin as a float; anything else fails naming the row."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{flag}: {row_name(index)}: the margin {value!r} is not a number")
    return float(value)


def encode_scored(prompt: Any, completion: Any, tokenizer: Tokenizer, template: ChatTemplate | None) -> SFTExample:
    """One side as the reward model reads it (module docstring), as an example the preference
    packer places: it feeds a sequence's ids but the last to the model (the last is only a
    label), so one extra token closes the sequence and every token of it is an input."""
    if isinstance(prompt, str) and isinstance(completion, str):
        ids = tokenizer.encode(prompt + completion)
    elif isinstance(prompt, list) and isinstance(completion, list):
        ids = [int(i) for i in encode_chat([*prompt, *completion], tokenizer, template=template,
                                           trained_from=len(prompt)).ids]
    else:
        raise ValueError("prompt and completions must be all strings or all lists of messages")
    if not ids:
        raise ValueError("the prompt and completion are empty: nothing to score")
    ids = [*ids, tokenizer.eos_id]
    return SFTExample(ids=np.asarray(ids, dtype=np.int64), targets=np.ones(len(ids), dtype=bool))


class ScoredPairs(PreferenceSource):
    """Preference pairs (a file's or the synthetic task's) with each side encoded by
    :func:`encode_scored`, and each pair's margin from ``margins`` (None: no margins)."""

    def __init__(self, pairs: Any, tokenizer: Tokenizer, margins: list[float] | None = None) -> None:
        self.pairs, self.tokenizer, self.margins = pairs, tokenizer, margins
        self.template = getattr(pairs, "template", None)

    @property
    def has_margins(self) -> bool:
        """Whether the pairs carry margins (the rows then carry a ``margin`` key)."""
        return self.margins is not None

    def __len__(self) -> int:
        return len(self.pairs)

    def example(self, index: int) -> PreferencePair:
        """Pair ``index``: its chosen and rejected sequences as the reward model reads them."""
        naming_row = getattr(self.pairs, "naming_row", None)
        if naming_row is None:
            return self._encode(index)
        with naming_row(index):
            return self._encode(index)

    def _encode(self, index: int) -> PreferencePair:
        prompt, chosen, rejected = self.pairs.raw_pair(index)
        sides = [encode_scored(prompt, side, self.tokenizer, self.template) for side in (chosen, rejected)]
        margin = None if self.margins is None else self.margins[int(index)]
        return PreferencePair(sides[0], sides[1], int(index), margin=margin)


__all__ = ["RewardDataConfig", "ScoredPairs", "encode_scored"]
