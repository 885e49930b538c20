"""Preference data for DPO: prompt/chosen/rejected rows, packed in pairs, resumable.

Rows follow TRL's preference datasets (``--dpo_data.*``):

- explicit prompt, text: ``{"prompt": str, "chosen": str, "rejected": str}``; each side is
  encoded as SFT encodes a prompt/completion pair (``[BOS] prompt completion EOS``, the
  completion and EOS trained);
- explicit prompt, conversational: ``prompt`` a list of messages, ``chosen`` and ``rejected``
  lists of (assistant) messages; each side is the conversation ``prompt + side`` rendered with
  the chat template, its own messages trained;
- implicit prompt: no prompt column, ``chosen`` and ``rejected`` whole conversations; the
  prompt is the messages they share from the start (TRL's ``extract_prompt``), each side the
  rest;
- ``synthetic``: the SFT synthetic task (``--dpo_data.synthetic_*``), its right answer chosen
  and a near miss (the last letter changed) rejected; no file needed.

A pair is placed whole: its chosen and its rejected sequence are two consecutive documents of
one row (document ``2k`` chosen, ``2k + 1`` rejected, in the ``document_ids`` SFT rows carry),
so a row's pairs are scored inside it under any microbatch, pipeline or context-parallel split.
``pair_index`` carries each pair's row index in the data on all its tokens (-1 on padding): the
key of its reference log-probs. Rows are filled as SFT fills them (greedy in a seeded order, or
one pair per row with ``--dpo_data.no_packing``); a pair longer than the row is dropped and
counted (cutting one side would compare a finished answer with an unfinished one).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from titan.train.data.chat import (
    ChatTemplate,
    SFTExample,
    encode_chat,
    encode_prompt_completion,
    parse_template_kwargs,
    resolve_chat_template,
)
from titan.train.data.loader import document_layout
from titan.train.data.records import RecordSplitsConfig, load_records, row_name
from titan.train.data.resumable import ResumableLoader, check_loader_args
from titan.train.data.sft import SFTBatches, SFTDataLoader, SFTPacker
from titan.train.data.sft_config import (
    SyntheticTaskConfig,
    check_template_kwargs,
    check_template_path,
)
from titan.train.data.sft_sources import SyntheticSFTTask
from titan.train.data.tokenizer import Tokenizer
from titan.train.loss import IGNORE_INDEX

logger = logging.getLogger("titan")


@dataclass(kw_only=True)
class PreferenceDataConfig(SyntheticTaskConfig, RecordSplitsConfig):
    """``--dpo_data.*``: the preference pairs (prompt, chosen, rejected) and how they become
    rows."""

    SECTION: ClassVar[str] = "--dpo_data"
    """The flags' section, for messages."""
    FORMATS: ClassVar[tuple[str, ...]] = ("auto", "preference", "synthetic")
    """The formats this data reads (the second: its file format)."""
    LABELLED: ClassVar[bool] = False
    """Examples carry a desirable/undesirable label (KTO), batches a ``desirable`` key."""

    format: Literal["auto", "preference", "synthetic"] = "auto"
    """"preference": rows with ``chosen`` and ``rejected`` (and ``prompt``, unless both sides
    are whole conversations sharing it; see the module docstring). "synthetic": the built-in
    task (``--dpo_data.synthetic_*``). "auto": synthetic without --dpo_data.path, else
    preference."""
    path: str | None = None
    """JSONL or Parquet file, directory or glob, or a Hugging Face Hub dataset name
    (``org/name``, see --dpo_data.subset and --dpo_data.split)."""
    eval_path: str | None = None
    """Held-out pairs in the same layout (its --dpo_data.eval_split), scored by ``titan dpo
    --validation.enable``: their loss and reward accuracy against the same reference. The
    synthetic format holds out its own strings (--dpo_data.synthetic_eval_examples)."""
    prompt_field: str = "prompt"
    """The column holding the prompt (absent: an implicit prompt)."""
    chosen_field: str = "chosen"
    """The column holding the preferred completion."""
    rejected_field: str = "rejected"
    """The column holding the dispreferred completion."""
    chat_template: Literal["auto", "tokenizer", "builtin"] = "auto"
    """Conversational rows: "tokenizer" renders the tokenizer's Jinja chat template, "builtin"
    titan's simple one, "auto" the tokenizer's when its files carry one, else builtin."""
    chat_template_kwargs: str | None = None
    """Extra variables for the tokenizer's chat template, a JSON object (TRL's
    ``chat_template_kwargs``)."""
    chat_template_path: str | None = None
    """A chat template in place of the tokenizer's: a Jinja file, or a tokenizer folder that
    ships one."""
    packing: bool = True
    """Pack several whole pairs per row (with document boundaries); off: one pair per row."""
    shuffle: bool = True
    """Visit the pairs in a fresh seeded order every epoch."""
    cache_dir: str | None = None
    """Where ``datasets`` caches the parsed files (default: its own cache)."""

    def __post_init__(self) -> None:
        section = self.SECTION
        if self.format not in self.FORMATS:
            raise ValueError(f"{section}.format must be one of {', '.join(self.FORMATS)}, got {self.format!r}")
        reads_files = self.resolved_format != "synthetic"
        if reads_files and not self.path:
            raise ValueError(f"{section}.format {self.resolved_format} reads files: set {section}.path to a JSONL or "
                             "Parquet file, directory, glob or Hub dataset")
        if not reads_files:
            for flag in ("path", "eval_path"):
                if getattr(self, flag):
                    raise ValueError(f"{section}.{flag} {getattr(self, flag)!r} is not read by {section}.format "
                                     f"synthetic: drop it or set {section}.format {self.FORMATS[1]}")
            given = [f"{section}.{name}" for name, default in self.file_flags().items() if getattr(self, name) != default]
            if given:
                raise ValueError(f"{', '.join(given)} describe data files, and {section}.format synthetic reads "
                                 "none: drop them")
        for flag in self.file_flags():
            if flag.endswith("_field") and not getattr(self, flag):
                raise ValueError(f"{section}.{flag} is empty; name the column to read")
        if self.chat_template not in ("auto", "tokenizer", "builtin"):
            raise ValueError(f"{section}.chat_template must be auto, tokenizer or builtin, got {self.chat_template!r}")
        check_template_kwargs(self.chat_template_kwargs, section, self.chat_template,
                              renders_chats=reads_files, fmt=self.resolved_format)
        check_template_path(self.chat_template_path, section, self.chat_template,
                            renders_chats=reads_files, fmt=self.resolved_format)
        self.check_synthetic_task(section)
        self.check_record_splits(section, reads_files=reads_files)

    @classmethod
    def file_flags(cls) -> dict[str, object]:
        """The flags only a data file reads, and their defaults."""
        return dict(_FILE_FLAGS)

    def source(self, tokenizer: Tokenizer, *, held_out: bool = False) -> PreferenceSource:
        """The examples these flags describe (``held_out``: the held-out ones)."""
        return preference_pairs(self, tokenizer, held_out=held_out)

    @property
    def resolved_format(self) -> str:
        """``synthetic`` for ``auto`` without a path, ``preference`` for ``auto`` with one."""
        if self.format == "auto":
            return "preference" if self.path else "synthetic"
        return self.format


_FILE_FLAGS = {"prompt_field": "prompt", "chosen_field": "chosen",
               "rejected_field": "rejected", "chat_template": "auto", "chat_template_kwargs": None,
               "chat_template_path": None}
"""The flags only a preference file reads, and their defaults."""


@dataclass
class PreferencePair:
    """One pair, tokenized: the ``chosen`` and ``rejected`` sequences (each an
    :class:`SFTExample`: the prompt untrained, the completion trained) and its ``index`` in
    the data. ``len(pair) - 1`` is the row positions it takes (each side shifted by one), so
    the SFT packer places a pair as it places an example."""

    chosen: SFTExample
    rejected: SFTExample
    index: int
    label: bool | None = None
    """KTO's examples: whether the first sequence is desirable (None for preference pairs)."""
    margin: float | None = None
    """A reward model's pairs: how far the chosen reward should exceed the rejected one (the
    rows' margin column; None without one)."""

    def __len__(self) -> int:
        return len(self.chosen) - 1 + len(self.rejected) - 1 + 1

    @property
    def sides(self) -> tuple[SFTExample, SFTExample]:
        """(chosen, rejected), in the order they are placed in a row."""
        return self.chosen, self.rejected


def near_miss(answer: str) -> str:
    """The synthetic task's rejected answer: ``answer`` with its last letter moved one letter on
    (z wraps to a), so it differs from the right answer in exactly one place."""
    last = answer[-1]
    return answer[:-1] + ("a" if last == "z" else chr(ord(last) + 1))


class PreferenceSource:
    """Map-style pairs: ``len(source)``, ``example(i)`` (a :class:`PreferencePair`, tokenized on
    access), as an SFT source serves examples to the packer."""

    def __len__(self) -> int:
        raise NotImplementedError

    def example(self, index: int) -> PreferencePair:
        """Pair ``index``, tokenized."""
        raise NotImplementedError


class SyntheticPreferenceTask(PreferenceSource):
    """The SFT synthetic task as preference pairs: prompt "sort: cab\\n", chosen "abc",
    rejected its :func:`near_miss` ("abd")."""

    def __init__(self, cfg: PreferenceDataConfig, tokenizer: Tokenizer, *, held_out: bool = False) -> None:
        self.tokenizer = tokenizer
        task = SyntheticSFTTask(_as_sft_task(cfg), tokenizer)
        self.pairs = task.eval_pairs if held_out else task.train_pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def example(self, index: int) -> PreferencePair:
        """Pair ``index``: the right answer chosen, the near miss rejected."""
        prompt, chosen, rejected = self.raw_pair(index)
        return PreferencePair(self.encode(prompt, chosen), self.encode(prompt, rejected), index)

    def raw_pair(self, index: int) -> tuple[str, str, str]:
        """(prompt, chosen, rejected) of pair ``index``, as text."""
        prompt, answer = self.pairs[index]
        return prompt, answer, near_miss(answer)

    def encode(self, prompt: str, completion: str) -> SFTExample:
        """One side, as SFT encodes a prompt/completion pair."""
        return encode_prompt_completion(prompt, completion, self.tokenizer)


def _as_sft_task(cfg: PreferenceDataConfig):
    """An SFT data config of the same synthetic task (what ``SyntheticSFTTask`` reads)."""
    from titan.train.data.sft_config import SFTDataConfig

    return SFTDataConfig(**cfg.synthetic_task_fields())


def split_shared_prompt(chosen: Sequence[dict], rejected: Sequence[dict]) -> tuple[list, list, list]:
    """(prompt, chosen rest, rejected rest) of two whole conversations: the prompt is the
    messages they share from the start (TRL's implicit prompt)."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    return list(chosen[:shared]), list(chosen[shared:]), list(rejected[shared:])


class FilePreferenceSource(PreferenceSource):
    """The rows of a preference file (or Hub dataset), encoded as the module docstring says."""

    def __init__(self, dataset, cfg: PreferenceDataConfig, tokenizer: Tokenizer, template: ChatTemplate | None,
                 *, flag: str | None = None) -> None:
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        flag = flag or f"{cfg.SECTION}.path"
        self.where = f"{flag} {(cfg.eval_path if flag.endswith('eval_path') else cfg.path)!r}"
        columns = dataset.column_names
        missing = [f"{name!r} ({cfg.SECTION}.{flag})" for flag, name in
                   (("chosen_field", cfg.chosen_field), ("rejected_field", cfg.rejected_field)) if name not in columns]
        if missing:
            raise ValueError(f"{self.where}: rows have no {' or '.join(missing)} column (columns: "
                             f"{', '.join(columns) or 'none'}); preference rows hold a chosen and a rejected "
                             "completion: fix the file or name the columns")
        self.has_prompt = cfg.prompt_field in columns
        if not self.has_prompt and cfg.prompt_field != "prompt":
            raise ValueError(f"{self.where}: rows have no {cfg.prompt_field!r} column ({cfg.SECTION}.prompt_field; "
                             f"columns: {', '.join(columns)})")
        keep = [cfg.prompt_field] * self.has_prompt + [cfg.chosen_field, cfg.rejected_field]
        self.dataset = dataset.select_columns(keep)
        if len(self.dataset):
            first = self.dataset[0]
            refuse_template_flags_for_text(cfg, first[cfg.chosen_field], self.where)

    def __len__(self) -> int:
        return len(self.dataset)

    def example(self, index: int) -> PreferencePair:
        """Row ``index`` encoded; a malformed row fails naming its index and what it needs."""
        with self.naming_row(index):
            prompt, chosen, rejected = self.raw_pair(index)
            sides = [self.encode(prompt, side) for side in (chosen, rejected)]
        return PreferencePair(sides[0], sides[1], int(index))

    @contextlib.contextmanager
    def naming_row(self, index: int):
        """A ValueError inside names the row and what preference rows hold."""
        cfg = self.cfg
        try:
            yield
        except ValueError as e:
            raise ValueError(f"{self.where}: {row_name(index)}: {e}; preference rows hold {cfg.prompt_field!r}, "
                             f"{cfg.chosen_field!r} and {cfg.rejected_field!r}: all strings, or all lists of "
                             "{role, content} messages") from None

    def raw_pair(self, index: int) -> tuple[Any, Any, Any]:
        """(prompt, chosen, rejected) of row ``index`` as the file holds them (an implicit prompt
        split off the two conversations)."""
        cfg = self.cfg
        row = self.dataset[int(index)]
        prompt = row[cfg.prompt_field] if self.has_prompt else None
        chosen, rejected = row[cfg.chosen_field], row[cfg.rejected_field]
        if prompt is None:
            if not isinstance(chosen, list) or not isinstance(rejected, list):
                raise ValueError("without a prompt column, chosen and rejected must be whole conversations "
                                 "(lists of messages) that share the prompt")
            prompt, chosen, rejected = split_shared_prompt(chosen, rejected)
            if not prompt:
                raise ValueError("chosen and rejected share no first message, so no prompt")
        return prompt, chosen, rejected

    def encode(self, prompt, completion) -> SFTExample:
        """One side (:func:`encode_completion`)."""
        return encode_completion(prompt, completion, self.tokenizer, self.template)


def refuse_template_flags_for_text(cfg: PreferenceDataConfig, completion: Any, where: str) -> None:
    """Rows of text (a string ``completion``) are rendered by no chat template: the flags that
    set one are refused, not ignored."""
    if not isinstance(completion, str):
        return
    for option, what in (("chat_template_kwargs", "sets chat template variables"),
                         ("chat_template_path", "sets a chat template")):
        if getattr(cfg, option):
            raise ValueError(f"{cfg.SECTION}.{option} {what}, and the rows of {where} are text, rendered by no "
                             "template: drop it")


def encode_completion(prompt, completion, tokenizer: Tokenizer, template: ChatTemplate | None) -> SFTExample:
    """A prompt and one completion: text as SFT encodes a prompt/completion pair, or the
    conversation prompt + completion rendered with ``template``, the completion's turns trained."""
    if isinstance(prompt, str) and isinstance(completion, str):
        return encode_prompt_completion(prompt, completion, tokenizer)
    if isinstance(prompt, list) and isinstance(completion, list):
        return encode_chat([*prompt, *completion], tokenizer, template=template, trained_from=len(prompt))
    raise ValueError("prompt and completions must be all strings or all lists of messages")


def build_preference_source(cfg: PreferenceDataConfig, tokenizer: Tokenizer, *, held_out: bool = False
                            ) -> PreferenceSource:
    """The pairs ``cfg`` describes (``held_out``: its held-out pairs): ``cfg.source``, which a
    data config that extends this one (KTO's) overrides."""
    return cfg.source(tokenizer, held_out=held_out)


def preference_pairs(cfg: PreferenceDataConfig, tokenizer: Tokenizer, *, held_out: bool = False) -> PreferenceSource:
    """The preference pairs of ``cfg`` (the synthetic task's, or a file's)."""
    if cfg.resolved_format == "synthetic":
        return SyntheticPreferenceTask(cfg, tokenizer, held_out=held_out)
    dataset, template, flag = open_rows(cfg, tokenizer, held_out=held_out)
    return FilePreferenceSource(dataset, cfg, tokenizer, template, flag=flag)


def open_rows(cfg: PreferenceDataConfig, tokenizer: Tokenizer, *, held_out: bool = False):
    """(the rows as a ``datasets.Dataset``, the chat template, the flag naming them) of the
    data file ``cfg`` names (``held_out``: its eval_path)."""
    if held_out and not cfg.eval_path:
        raise ValueError(f"held-out examples need {cfg.SECTION}.eval_path")
    flag = f"{cfg.SECTION}.eval_path" if held_out else f"{cfg.SECTION}.path"
    dataset = load_records(cfg.eval_path if held_out else cfg.path, flag=flag, held_out=held_out,
                           split=cfg.eval_split if held_out else cfg.split, subset=cfg.subset, cache_dir=cfg.cache_dir)
    template = resolve_chat_template(
        cfg.chat_template, tokenizer, template_path=cfg.chat_template_path, section=cfg.SECTION,
        variables=parse_template_kwargs(cfg.chat_template_kwargs, f"{cfg.SECTION}.chat_template_kwargs"))
    return dataset, template, flag


class PreferencePacker(SFTPacker):
    """:class:`SFTPacker` over pairs: a pair is placed whole (its two sequences, chosen first,
    as two documents), and one that does not fit a row, or has a side without a trained token,
    is dropped and counted."""

    labelled = False
    """Rows carry ``desirable`` (1 on the tokens of an example labelled desirable): KTO's."""
    margins = False
    """Rows carry ``margin`` (each pair's margin on its tokens): a reward model's, when its
    data has a margin column."""

    def _prepare(self, pair: PreferencePair) -> PreferencePair | None:
        if len(pair) - 1 > self.seq_len:
            return None
        if any(len(side) < 2 or not side.targets[1:].any() for side in pair.sides):
            return None
        return pair

    def _nothing_fits(self) -> ValueError:
        # Not `self.dropped`: the search reads on into the next pass, so it counts some twice.
        return ValueError(f"none of the {self.num_examples} preference pairs fits in seq_len {self.seq_len} (chosen "
                          "and rejected together): raise --training.seq_len")

    def _row(self, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
        """A row of ``pairs`` end to end (each its chosen then its rejected sequence), then
        padding; ``pair_index`` names each token's pair (-1 on padding)."""
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        pair_index = np.full(self.seq_len, -1, dtype=np.int64)
        desirable = np.zeros(self.seq_len, dtype=np.float32)
        margin = np.zeros(self.seq_len, dtype=np.float32)
        starts = np.zeros(self.seq_len, dtype=bool)
        used = 0
        for pair in pairs:
            start = used
            for side in pair.sides:
                n = len(side) - 1
                input_ids[used : used + n] = side.ids[:-1]
                labels[used : used + n] = np.where(side.targets[1:], side.ids[1:], IGNORE_INDEX)
                pair_index[used : used + n] = pair.index
                starts[used] = True
                used += n
            desirable[start:used] = float(bool(pair.label))
            margin[start:used] = pair.margin or 0.0
        if used < self.seq_len:
            starts[used] = True  # the padding tail: its own segment
        positions, document_ids = document_layout(starts[None])
        document_ids[0, used:] = -1
        row = {"input_ids": input_ids, "labels": labels, "positions": positions[0],
               "document_ids": document_ids[0], "pair_index": pair_index}
        if self.labelled:
            row["desirable"] = desirable
        if self.margins:
            row["margin"] = margin
        return row


class PreferenceDataLoader(SFTDataLoader):
    """An endless, resumable loader of packed preference pairs for one data-parallel rank
    (:class:`SFTDataLoader`'s position and resume rules); ``dropped_examples`` counts the
    pairs left out."""

    KIND = "preference data loader"
    section = "--dpo_data"
    """The data flags' section, for messages."""

    def measured_against(self) -> dict[str, tuple[object, str]]:
        """The rows' length, the pairs, their order and packing."""
        return {
            "seq_len": (self.packer.seq_len, "--training.seq_len"),
            "num_examples": (self.num_examples, f"data ({self.section}.path, {self.section}.synthetic_*)"),
            "shuffle": (self.packer.shuffle, f"{self.section}.shuffle / {self.section}.no_shuffle"),
            "packing": (self.packer.packing, f"{self.section}.packing / {self.section}.no_packing"),
        }

    def check_compatible(self, state: dict[str, object]) -> None:
        """:class:`ResumableLoader`'s check (there are no older preference states to read)."""
        ResumableLoader.check_compatible(self, state)


def build_preference_dataloader(
    cfg: PreferenceDataConfig, tokenizer: Tokenizer, *, dp_rank: int, dp_world_size: int, local_batch_size: int,
    seq_len: int, seed: int,
) -> PreferenceDataLoader:
    """An endless loader of ``{"input_ids", "labels", "positions", "document_ids",
    "pair_index"}`` LongTensors ``[B, seq_len]`` for one data-parallel rank."""
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    source = build_preference_source(cfg, tokenizer)
    packer = PreferencePacker(source, seq_len=seq_len, pad_id=tokenizer.pad_id, packing=cfg.packing, overlong="drop",
                              shuffle=cfg.shuffle, seed=seed)
    packer.labelled = cfg.LABELLED
    packer.margins = bool(getattr(source, "has_margins", False))
    batches = SFTBatches(packer, local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    loader = PreferenceDataLoader(batches, dp_rank=dp_rank, dp_world_size=dp_world_size, num_examples=len(source))
    loader.section = cfg.SECTION
    return loader


def held_out_preference_batches(
    cfg: PreferenceDataConfig, tokenizer: Tokenizer, *, dp_rank: int, dp_world_size: int, local_batch_size: int,
    seq_len: int, seed: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over the held-out pairs in file order, packed as training packs them: this
    rank's rows of each global microbatch, the last filled up with padding rows, so every rank
    yields as many."""
    del seed  # one pass in file order
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    source = build_preference_source(cfg, tokenizer, held_out=True)
    packer = PreferencePacker(source, seq_len=seq_len, pad_id=tokenizer.pad_id, packing=cfg.packing, overlong="drop",
                              shuffle=False, seed=0)
    packer.labelled = cfg.LABELLED
    packer.margins = bool(getattr(source, "has_margins", False))
    packer.single_pass = True
    batches = SFTBatches(packer, local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    while not packer.exhausted:
        yield batches.next_batch()
    if packer.dropped:
        logger.warning("validation: %d of the %d held-out preference pairs do not fit --training.seq_len %d and are "
                       "left out", packer.dropped, packer.num_examples, seq_len)


__all__ = [
    "FilePreferenceSource",
    "PreferenceDataConfig",
    "PreferenceDataLoader",
    "PreferencePacker",
    "PreferencePair",
    "PreferenceSource",
    "SyntheticPreferenceTask",
    "build_preference_dataloader",
    "build_preference_source",
    "encode_completion",
    "held_out_preference_batches",
    "near_miss",
    "split_shared_prompt",
]
