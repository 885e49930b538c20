"""Supervised fine-tuning data: examples, loss masks, packing with boundaries, the loader.

An SFT example is a token sequence plus a per-token *target* flag: which tokens the
model is trained to produce. With `--sft_data.train_on completion` (the default) those
are the completion (or every assistant turn) and the EOS that ends it; prompt, system
and user tokens are context only. Labels are shifted inside each example: its input is
`ids[:-1]`, its labels `ids[1:]` with -100 where the token is not a target, so no
prediction ever crosses from one example into the next.

Rows of `seq_len` positions are filled greedily with whole examples in a seeded order
(one example per row with `--sft_data.no_packing`); the rest of a row is padding
(`pad_id`, label -100). Every batch is a dict of LongTensors [B, S]:

- `input_ids`, `labels` (-100 = ignored: prompt tokens and padding);
- `positions`: 0, 1, ... restarting at every example (what RoPE should see);
- `document_ids`: 0, 1, 2, ... one id per example in the row, in order; the padding at
  the end of a row is one more segment with id -1 (positions again from 0), so an
  equality-plus-causal attention mask never lets a real token see padding and every
  padding token still sees itself (no empty softmax row), and an MoE layer, which reads a
  negative id as padding, leaves it out of its balancing counts and aux loss.

An example longer than `seq_len + 1` tokens (seq_len positions after the shift) is
dropped (`--sft_data.overlong drop`, the default: a cut-off completion would teach the
model to stop without EOS) or cut to its first seq_len + 1 tokens (`truncate`); either
way, and for examples left without any target, the loader counts them in
`dropped_examples`.

The loader mirrors the pretraining `PackedDataLoader`: one global stream of rows read
identically by every data-parallel rank, each fetch consuming dp_world_size x B rows of
which rank r keeps rows r*B .. (r+1)*B - 1, and one global position (epoch, next
example, rows, dropped) that resumes exactly under any data-parallel degree or batch
split.

The pieces live in their own modules: the flags in `titan.train.data.sft_config`, encoding
(prompt/completion, chat templates) in `titan.train.data.chat`, the example sources in
`titan.train.data.sft_sources`; this module packs rows and serves them. Its names are
importable from here too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from titan.train.data.chat import (
    ChatTemplate,
    SFTExample,
    encode_chat,
    encode_chat_prompt,
    encode_prompt,
    encode_prompt_completion,
)
from titan.train.data.loader import document_layout
from titan.train.data.packing import best_fit_decreasing
from titan.train.data.resumable import ResumableLoader, check_loader_args
from titan.train.data.sft_config import SFTDataConfig, SyntheticTaskConfig, validate_sft_data_config
from titan.train.data.sft_sources import (
    SFTSource,
    SyntheticSFTTask,
    build_sft_source,
    synthetic_eval_pairs,
)
from titan.train.data.tokenizer import Tokenizer
from titan.train.loss import IGNORE_INDEX
from torch.utils.data import IterableDataset

logger = logging.getLogger("titan")

# The SFT data's public names (defined in chat, sft_config and sft_sources): importable from
# here as before the split.
__all__ = [
    "SFTDataConfig",
    "SyntheticTaskConfig",
    "SFTDataLoader",
    "SFTExample",
    "ChatTemplate",
    "SyntheticSFTTask",
    "build_sft_dataloader",
    "build_sft_source",
    "held_out_sft_batches",
    "pack_row",
    "encode_chat",
    "encode_chat_prompt",
    "encode_prompt",
    "encode_prompt_completion",
    "synthetic_eval_pairs",
    "validate_sft_data_config",
]


def pack_row(examples: Sequence[SFTExample], *, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """One row of ``seq_len`` positions: ``examples`` end to end (they must fit: an example of
    n tokens takes n - 1 positions after the shift), then padding; the arrays of a batch row
    (module docstring)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    starts = np.zeros(seq_len, dtype=bool)
    used = 0
    for example in examples:
        n = len(example) - 1  # positions after the in-example shift
        if used + n > seq_len:
            raise ValueError(f"examples of {used + n} positions do not fit a row of {seq_len}")
        ids, targets = example.ids, example.targets
        input_ids[used : used + n] = ids[:-1]
        labels[used : used + n] = np.where(targets[1:], ids[1:], IGNORE_INDEX)
        starts[used] = True
        used += n
    if used < seq_len:
        starts[used] = True  # the padding tail: its own segment, positions from 0
    positions, document_ids = document_layout(starts[None])
    document_ids[0, used:] = -1  # padding (see the module docstring)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "positions": positions[0],
        "document_ids": document_ids[0],
    }


class SFTPacker:
    """Fills rows of `seq_len` positions with whole examples, in a seeded order.

    Epoch e visits the examples in a permutation seeded by (seed, e) (the same seeding as
    the pretraining `DocumentPacker`), else in index order. ``greedy`` packing: a row takes
    examples while they fit (one with packing off); the example that does not fit starts the
    next row. So the position between rows is (epoch, cursor of the next unplaced example)
    plus a count of dropped examples: plain ints. ``bfd`` (best-fit decreasing, TRL's default
    packing strategy): the order is cut into windows of ``window`` examples, each window's
    examples are packed by :func:`best_fit_decreasing` (far less padding: rows are filled
    with the short examples that fit the gaps), and the rows are emitted in the order the
    packing opened them; the position is (epoch, first example of the window, rows of it
    emitted, dropped before it), and a resumed packer rebuilds the window's rows.
    """

    def __init__(
        self,
        source: SFTSource,
        *,
        seq_len: int,
        pad_id: int,
        packing: bool,
        overlong: str,
        shuffle: bool,
        seed: int,
        strategy: str = "greedy",
        window: int = 1000,
    ) -> None:
        self.source, self.num_examples = source, len(source)
        if self.num_examples == 0:
            raise ValueError("the SFT dataset has no examples; check --sft_data.path")
        if strategy not in ("greedy", "bfd") or (strategy == "bfd" and not packing) or window < 1:
            raise ValueError(f"packing strategy {strategy!r} (packing {packing}, window {window}) is not one of "
                             "greedy, or bfd with packing and a window >= 1")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.packing, self.overlong, self.shuffle, self.seed = packing, overlong, shuffle, seed
        self.strategy, self.window = strategy, window
        self.epoch = self.cursor = self.dropped = 0
        self.emitted = 0  # bfd: rows of the current window already emitted
        self._window_rows: tuple[tuple[int, int], list[list[SFTExample]], int] | None = None
        self.single_pass = False  # held-out scoring: no example after the first epoch
        self._order: tuple[int, np.ndarray] | None = None
        self._pending: tuple[tuple[int, int], SFTExample | None] | None = None

    def next_row(self) -> dict[str, np.ndarray]:
        """The next row: `input_ids`, `labels`, `positions`, `document_ids`, each [seq_len].

        Positions and ids come from the pretraining loader's `document_layout`, given where
        each example (and the padding tail, a segment of its own) starts.
        """
        if self.strategy == "bfd":
            return self._row(self._next_bin())
        examples: list[SFTExample] = []
        used = 0
        while True:
            example = self._current_example()
            if example is None:  # a single pass is over: the rest of the row is padding
                break
            n = len(example) - 1  # positions after the in-example shift
            if used + n > self.seq_len or (examples and not self.packing):
                break
            examples.append(example)
            used += n
            self._advance()
        return self._row(examples)

    def _row(self, examples: Sequence[SFTExample]) -> dict[str, np.ndarray]:
        """A row of ``examples`` end to end (they fit), then padding."""
        return pack_row(examples, seq_len=self.seq_len, pad_id=self.pad_id)

    @property
    def exhausted(self) -> bool:
        """A single-pass packer has placed every example of its pass."""
        return self.single_pass and self.epoch > 0

    def _current_example(self) -> SFTExample | None:
        """The next example that can be placed, skipping (and counting) unusable ones; None
        once a single pass is over."""
        skipped_run = 0
        while True:
            if self.exhausted:
                return None
            key = (self.epoch, self.cursor)
            if self._pending is None or self._pending[0] != key:
                self._pending = (key, self._prepare(self.source.example(self._example_index())))
            example = self._pending[1]
            if example is not None:
                return example
            self.dropped += 1
            skipped_run += 1
            if skipped_run > self.num_examples:
                raise self._nothing_fits()
            self._advance()

    def _next_bin(self) -> list[SFTExample]:
        """bfd: the examples of the next row (none once a single pass is over), moving to the
        next window once this one's rows are all out."""
        empty_run = 0
        while not self.exhausted:
            _, rows, _ = self._window_plan()
            if self.emitted < len(rows):
                chosen = rows[self.emitted]
                self.emitted += 1
                if self.emitted == len(rows):
                    self._next_window()
                return chosen
            empty_run += self.window  # every example of the window was dropped
            if empty_run > self.num_examples:
                raise self._nothing_fits()
            self._next_window()
        return []

    def _window_plan(self) -> tuple[tuple[int, int], list[list[SFTExample]], int]:
        """bfd: the current window's rows (best-fit decreasing of its usable examples) and how
        many of its examples were dropped; built once per window."""
        key = (self.epoch, self.cursor)
        if self._window_rows is None or self._window_rows[0] != key:
            self._order_of_epoch()
            end = min(self.cursor + self.window, self.num_examples)
            prepared = [self._prepare(self.source.example(int(i))) for i in self._order[1][self.cursor : end]]
            usable = [e for e in prepared if e is not None]
            bins = best_fit_decreasing([len(e) - 1 for e in usable], self.seq_len)
            self._window_rows = (key, [[usable[i] for i in b] for b in bins], len(prepared) - len(usable))
        return self._window_rows

    def _next_window(self) -> None:
        """bfd: count the finished window's drops and move to the next window (the next epoch
        after the last)."""
        self.dropped += self._window_plan()[2]
        self.cursor = min(self.cursor + self.window, self.num_examples)
        self.emitted = 0
        if self.cursor == self.num_examples:
            self.cursor = 0
            self.epoch += 1

    def _nothing_fits(self) -> ValueError:
        """The error of a pass over every example that placed none."""
        # Not `self.dropped`: the search reads on into the next pass, so it counts some twice.
        return ValueError(f"none of the {self.num_examples} SFT examples fits in seq_len {self.seq_len} with a token "
                          "to train on; raise --training.seq_len or use --sft_data.overlong truncate")

    def _prepare(self, example: SFTExample) -> SFTExample | None:
        """Apply the overlong policy; None if the example cannot be used."""
        if len(example) - 1 > self.seq_len:
            if self.overlong == "drop":
                return None
            keep = self.seq_len + 1
            example = SFTExample(example.ids[:keep], example.targets[:keep])
        if len(example) < 2 or not example.targets[1:].any():
            return None
        return example

    def _example_index(self) -> int:
        """Index in the source of the example under the cursor, this epoch."""
        self._order_of_epoch()
        return int(self._order[1][self.cursor])

    def _order_of_epoch(self) -> None:
        """This epoch's order of the examples (seeded permutation when shuffling), cached."""
        if self._order is None or self._order[0] != self.epoch:
            order = np.arange(self.num_examples, dtype=np.int64)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            self._order = (self.epoch, order)

    def _advance(self) -> None:
        """Move past the example under the cursor, wrapping into the next epoch."""
        self.cursor += 1
        if self.cursor == self.num_examples:
            self.cursor = 0
            self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        """The position between rows: plain ints (bfd: the window's first example, and the
        rows of it emitted)."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dropped": self.dropped,
            "seed": self.seed,
            "emitted": self.emitted,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to a saved position; the next row is the one the saved packer would build."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.dropped, self.seed = int(state["dropped"]), int(state["seed"])
        self.emitted = int(state.get("emitted", 0))
        self._order = self._pending = self._window_rows = None


class SFTBatches(IterableDataset):
    """One data-parallel rank's SFT batches: each fetch builds the global microbatch
    (dp_world_size x B rows, in the one global order) and keeps rows r*B .. (r+1)*B - 1,
    as the pretraining `PackedBatches` does with windows."""

    def __init__(
        self, packer: SFTPacker, batch_size: int, *, dp_rank: int = 0, dp_world_size: int = 1
    ) -> None:
        self.packer, self.batch_size = packer, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.rows = 0  # rows consumed globally (all ranks)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> dict[str, torch.Tensor]:
        """Build the global microbatch, hand out this rank's rows."""
        rows = [self.packer.next_row() for _ in range(self.dp_world_size * self.batch_size)]
        self.rows += len(rows)
        mine = rows[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
        return {key: torch.from_numpy(np.stack([r[key] for r in mine])) for key in mine[0]}


def _packer(cfg: SFTDataConfig, source: SFTSource, tokenizer: Tokenizer, *, seq_len: int, shuffle: bool,
            seed: int) -> SFTPacker:
    """A packer of `source`'s examples with `cfg`'s packing and overlong policy."""
    return SFTPacker(source, seq_len=seq_len, pad_id=tokenizer.pad_id, packing=cfg.packing, overlong=cfg.overlong,
                     shuffle=shuffle, seed=seed, strategy=cfg.packing_strategy, window=cfg.packing_window)


def held_out_sft_batches(
    cfg: SFTDataConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over the held-out SFT examples (`build_sft_source(..., held_out=True)`), in
    file order, packed as training packs them: this rank's rows of each global microbatch,
    the last one filled up with padding rows (no labels), so every rank yields as many."""
    del seed  # one pass in file order: nothing to draw
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    packer = _packer(cfg, build_sft_source(cfg, tokenizer, held_out=True), tokenizer, seq_len=seq_len, shuffle=False,
                     seed=0)
    packer.single_pass = True
    batches = SFTBatches(packer, local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    while not packer.exhausted:
        yield batches.next_batch()
    if packer.dropped:  # they are not in the validation loss: say so once (the batches are read once)
        logger.warning("validation: %d of the %d held-out SFT examples do not fit --training.seq_len %d (or train "
                       "no token) and are left out (--sft_data.overlong truncate keeps their start)",
                       packer.dropped, packer.num_examples, seq_len)


class SFTDataLoader(ResumableLoader):
    """An endless, resumable `DataLoader` of SFT batches for one data-parallel rank.

    Iterate it or call `next(loader)`. `state_dict()` is one global record, the same on
    every rank after every fetch: (epoch, cursor, dropped, seed) of the packer and the
    global `rows` consumed, with what they are measured against (seq_len, num_examples,
    shuffle, packing; `ResumableLoader` checks them). It resumes under any data-parallel
    degree, local batch size or accumulation count. `epoch` counts completed passes over
    the data.
    """

    STATE_VERSION = 1
    KIND = "SFT data loader"

    def __init__(
        self, dataset: SFTBatches, *, dp_rank: int, dp_world_size: int, num_examples: int
    ) -> None:
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size)
        self.num_examples = num_examples

    @property
    def packer(self) -> SFTPacker:
        """The row builder behind this loader (its position is the loader's state)."""
        return self.dataset.packer

    @property
    def epoch(self) -> int:
        """Completed passes over the examples (the example under the cursor is in this one)."""
        return self.packer.epoch

    @property
    def dropped_examples(self) -> int:
        """Examples skipped so far: longer than seq_len + 1 (with overlong=drop) or without
        any target token. Counted each time an epoch visits them."""
        return self.packer.dropped

    def position(self) -> dict[str, Any]:
        """The packer's position between rows and the `rows` consumed globally."""
        return {**self.packer.state_dict(), "rows": self.dataset.rows}

    def restore(self, state: dict[str, Any]) -> None:
        """Put the packer and the row count where the saved loader stood."""
        self.packer.load_state_dict(state)
        self.dataset.rows = int(state["rows"])

    def measured_against(self) -> dict[str, tuple[Any, str]]:
        """The rows' length, the examples, their order and packing."""
        return {
            "seq_len": (self.packer.seq_len, "--training.seq_len"),
            "num_examples": (self.num_examples, "data (--sft_data.path, --sft_data.format, --sft_data.synthetic_*)"),
            "shuffle": (self.packer.shuffle, "--sft_data.shuffle / --sft_data.no_shuffle"),
            "packing": (self.packer.packing, "--sft_data.packing / --sft_data.no_packing"),
            "packing_strategy": (self.packer.strategy, "--sft_data.packing_strategy"),
            "packing_window": (self.packer.window, "--sft_data.packing_window"),
        }

    def check_compatible(self, state: dict[str, Any]) -> None:
        """As :class:`ResumableLoader`'s; a state saved before packing strategies existed was
        greedy (its window is not read)."""
        if "packing_strategy" not in state:
            state = {**state, "packing_strategy": "greedy", "packing_window": self.packer.window}
        super().check_compatible(state)


def build_sft_dataloader(
    cfg: SFTDataConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
) -> SFTDataLoader:
    """An endless loader of `{"input_ids", "labels", "positions", "document_ids"}`
    LongTensors [B, seq_len] for one data-parallel rank (see the module docstring)."""
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    source = build_sft_source(cfg, tokenizer)
    packer = _packer(cfg, source, tokenizer, seq_len=seq_len, shuffle=cfg.shuffle, seed=seed)
    batches = SFTBatches(packer, local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    return SFTDataLoader(
        batches, dp_rank=dp_rank, dp_world_size=dp_world_size, num_examples=len(source)
    )
