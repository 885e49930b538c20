"""KTO's data: unpaired completions labelled desirable or not, each with a mismatched twin.

Rows (``--kto_data.*``) follow TRL's KTO datasets:

- ``unpaired``: ``{"prompt", "completion", "label"}`` (text, or lists of messages), ``label``
  true for a desirable completion;
- ``preference``: paired rows as ``titan dpo`` reads them; each becomes two examples, the chosen
  completion desirable and the rejected one not (TRL's ``unpair_preference_dataset``);
- ``synthetic``: the synthetic task's right answers (desirable) and near misses (not).

KTO's reference point is the policy's KL from the reference, estimated on prompts paired with
completions written for other prompts. So each example is placed with a twin: its own prompt
followed by the completion of the example two places on (``(i + 2) mod N``: for unpaired
preference rows that is the next row's completion of the same kind, never its own prompt's).
The two are packed as a pair is for DPO (documents ``2k`` and ``2k + 1`` of one row), and the
rows carry ``desirable`` (1 on the tokens of a desirable example).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from titan.rl.preference_data import (
    _FILE_FLAGS,
    FilePreferenceSource,
    PreferenceDataConfig,
    PreferencePair,
    PreferenceSource,
    SyntheticPreferenceTask,
    encode_completion,
    open_rows,
    refuse_template_flags_for_text,
)
from titan.train.data.records import row_name
from titan.train.data.tokenizer import Tokenizer

KL_SHIFT = 2
"""Example ``i``'s twin takes the completion of example ``(i + KL_SHIFT) mod N``."""


@dataclass(kw_only=True)
class KTODataConfig(PreferenceDataConfig):
    """``--kto_data.*``: KTO's labelled completions (unpaired rows, or preference pairs
    unpaired) and how they become rows."""

    SECTION: ClassVar[str] = "--kto_data"
    FORMATS: ClassVar[tuple[str, ...]] = ("auto", "unpaired", "preference", "synthetic")
    LABELLED: ClassVar[bool] = True

    format: Literal["auto", "unpaired", "preference", "synthetic"] = "auto"
    """"unpaired": rows with ``prompt``, ``completion`` and a boolean ``label``; "preference":
    rows with ``chosen`` and ``rejected`` (and ``prompt``, or an implicit one), each row two
    examples; "synthetic": the built-in task. "auto": synthetic without --kto_data.path, else
    unpaired when the rows have the label column, preference otherwise."""
    completion_field: str = "completion"
    """unpaired: the column holding the completion."""
    label_field: str = "label"
    """unpaired: the column holding whether the completion is desirable (a boolean)."""

    @property
    def resolved_format(self) -> str:
        """``synthetic`` for ``auto`` without a path; with one, ``auto`` until the columns tell."""
        if self.format == "auto" and not self.path:
            return "synthetic"
        return self.format

    @classmethod
    def file_flags(cls) -> dict[str, object]:
        """The flags only a data file reads, and their defaults."""
        return {**_FILE_FLAGS, "completion_field": "completion", "label_field": "label"}

    def source(self, tokenizer: Tokenizer, *, held_out: bool = False) -> KTOSource:
        """KTO's examples (:func:`build_kto_source`)."""
        return build_kto_source(self, tokenizer, held_out=held_out)


class KTOSource(PreferenceSource):
    """Example ``i`` of a labelled source: its sequence and its twin (module docstring) as a
    :class:`PreferencePair` with ``label`` set. ``raw(i)`` gives (prompt, completion, label) as
    the data holds them, ``encode(prompt, completion)`` one sequence, ``naming(i)`` a context in
    which a ValueError names the row."""

    def __init__(self, count: int, raw, encode, naming) -> None:
        if count < 1:
            raise ValueError("the KTO data has no examples")
        self.count, self.raw, self.encode, self.naming = count, raw, encode, naming

    def __len__(self) -> int:
        return self.count

    def example(self, index: int) -> PreferencePair:
        """Example ``index`` and its mismatched twin, encoded."""
        with self.naming(index):
            prompt, completion, label = self.raw(index)
            _, other, _ = self.raw((index + KL_SHIFT) % self.count)
            return PreferencePair(self.encode(prompt, completion), self.encode(prompt, other), index, label=label)


def _unpaired(pairs: Any):
    """``raw`` of preference pairs read two examples to a pair: chosen (desirable), rejected."""
    def raw(index: int) -> tuple[Any, Any, bool]:
        prompt, chosen, rejected = pairs.raw_pair(index // 2)
        return (prompt, chosen, True) if index % 2 == 0 else (prompt, rejected, False)

    return raw


class UnpairedRows:
    """The rows of an unpaired file: (prompt, completion, label) per row, checked."""

    def __init__(self, dataset, cfg: KTODataConfig, where: str) -> None:
        missing = [f"{name!r} ({cfg.SECTION}.{flag})" for flag, name in (
            ("prompt_field", cfg.prompt_field), ("completion_field", cfg.completion_field),
            ("label_field", cfg.label_field)) if name not in dataset.column_names]
        if missing:
            raise ValueError(f"{where}: rows have no {' or '.join(missing)} column (columns: "
                             f"{', '.join(dataset.column_names) or 'none'}); unpaired rows hold a prompt, a "
                             "completion and a boolean label: fix the file or name the columns")
        self.cfg, self.where = cfg, where
        self.dataset = dataset.select_columns([cfg.prompt_field, cfg.completion_field, cfg.label_field])
        if len(self.dataset):
            refuse_template_flags_for_text(cfg, self.dataset[0][cfg.completion_field], where)

    def __len__(self) -> int:
        return len(self.dataset)

    def raw(self, index: int) -> tuple[Any, Any, bool]:
        """(prompt, completion, label) of row ``index``."""
        row = self.dataset[int(index)]
        label = row[self.cfg.label_field]
        if not isinstance(label, bool):
            raise ValueError(f"{self.cfg.label_field!r} is {label!r}, not true or false")
        return row[self.cfg.prompt_field], row[self.cfg.completion_field], label


def build_kto_source(cfg: KTODataConfig, tokenizer: Tokenizer, *, held_out: bool = False) -> KTOSource:
    """KTO's examples ``cfg`` describes (``held_out``: its held-out ones)."""
    if cfg.resolved_format == "synthetic":
        task = SyntheticPreferenceTask(cfg, tokenizer, held_out=held_out)
        return KTOSource(2 * len(task), _unpaired(task), task.encode, _no_context)
    dataset, template, flag = open_rows(cfg, tokenizer, held_out=held_out)
    fmt = cfg.resolved_format
    if fmt == "auto":
        fmt = "unpaired" if cfg.label_field in dataset.column_names else "preference"
    _refuse_unread_columns(cfg, fmt)
    if fmt == "preference":
        pairs = FilePreferenceSource(dataset, cfg, tokenizer, template, flag=flag)
        return KTOSource(2 * len(pairs), _unpaired(pairs), pairs.encode, lambda i: pairs.naming_row(i // 2))
    where = f"{flag} {(cfg.eval_path if held_out else cfg.path)!r}"
    rows = UnpairedRows(dataset, cfg, where)
    return KTOSource(len(rows), rows.raw, functools.partial(encode_completion, tokenizer=tokenizer, template=template),
                     functools.partial(_naming, where, cfg=cfg))


_READ_BY = {"unpaired": ("completion_field", "label_field"), "preference": ("chosen_field", "rejected_field")}
"""The column flags only one file format reads."""


def _refuse_unread_columns(cfg: KTODataConfig, fmt: str) -> None:
    """A column flag of the other file format is refused, not ignored."""
    for other, flags in _READ_BY.items():
        for flag in flags:
            if other != fmt and getattr(cfg, flag) != KTODataConfig.file_flags()[flag]:
                raise ValueError(f"{cfg.SECTION}.{flag} {getattr(cfg, flag)!r} is read by {cfg.SECTION}.format {other}, "
                                 f"and these rows are {fmt}: drop it")


@contextlib.contextmanager
def _naming(where: str, index: int, *, cfg: KTODataConfig):
    """A context in which a ValueError names unpaired row ``index``."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"{where}: {row_name(index)}: {e}; unpaired rows hold {cfg.prompt_field!r} and "
                         f"{cfg.completion_field!r} (both strings, or both lists of messages) and a boolean "
                         f"{cfg.label_field!r}") from None


def _no_context(index: int) -> contextlib.AbstractContextManager:
    """No row to name (the synthetic task)."""
    return contextlib.nullcontext()


__all__ = ["KL_SHIFT", "KTODataConfig", "KTOSource", "UnpairedRows", "build_kto_source"]
