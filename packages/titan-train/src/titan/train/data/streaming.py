"""`--dataset.streaming`: train on a dataset too large to download first (the Hub's
``allenai/c4`` is ~300 GB of JSON), reading it as `datasets` streams it.

A streamed dataset is a list of shards (its files), each read front to back; nothing is
indexable, so the map-style packer's position (a document index) does not exist. The stream
packer's position is instead ``(epoch, shard, row, offset)``: the shard's place in this
epoch's shard order, the row inside that shard, the token offset inside that row's document.
That is exact, and it is cheap to restore: resuming re-opens one shard and skips its first
``row`` rows, so the cost is bounded by one shard, never by how far the run got.

Shuffling permutes the order of the shards, seeded by ``(seed, epoch)``; the rows of a shard
keep their order (a shuffle buffer would make the position inexact: rows held in the buffer
at a save would be lost or repeated on resume). As with map-style sources, every
data-parallel rank reads the whole stream and keeps its own rows of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from titan.train.data.packing import DocumentPacker
from titan.train.data.tokenizer import Tokenizer

__all__ = ["ShardedStream", "StreamPacker"]

logger = logging.getLogger(__name__)


class ShardedStream:
    """A streamed `datasets.IterableDataset` read shard by shard: ``rows(shard, start)`` yields
    the texts of one shard from row ``start`` on, ``tokens(text)`` tokenizes one.

    ``describe_error`` turns an exception raised while reading into a one-line problem (or None
    to let it through): local files name the file and line that `datasets` failed on.
    """

    def __init__(
        self,
        dataset,
        tokenizer: Tokenizer | None,
        text_field: str,
        *,
        describe_error: Callable[[BaseException], str | None] | None = None,
        flag: str = "--dataset.name",
        field_flag: str = "--dataset.text_field",
    ) -> None:
        _check_text_column(dataset, text_field, field_flag)
        self.dataset = dataset.select_columns([text_field])
        self.tokenizer, self.text_field = tokenizer, text_field
        self.num_shards = int(dataset.n_shards)
        self.describe_error, self.flag, self.field_flag = describe_error, flag, field_flag

    def rows(self, shard: int, start: int) -> Iterator[str]:
        """The texts of shard ``shard`` from its row ``start`` on (None reads as empty)."""
        part = self.dataset.shard(num_shards=self.num_shards, index=shard, contiguous=True)
        if start:
            part = part.skip(start)  # reads and drops the rows: bounded by one shard
        try:
            for record in part:
                yield _text_of(record[self.text_field], self.field_flag, self.text_field)
        except (ValueError, OSError, RuntimeError) as err:
            problem = self.describe_error(err) if self.describe_error else None
            if problem is None:
                raise
            raise ValueError(f"{self.flag}: {problem}") from err

    def tokens(self, text: str) -> np.ndarray:
        """Token ids (int64) of one document, without BOS/EOS."""
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)


def _check_text_column(dataset, text_field: str, field_flag: str) -> None:
    """``text_field`` is a column, and a text one, wherever `datasets` knows the schema before
    reading (otherwise the first row is checked by `_text_of`)."""
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(
            f"{field_flag} {text_field!r} is not a column of the dataset; available columns: "
            f"{', '.join(columns)}"
        )
    feature = (dataset.features or {}).get(text_field)
    dtype = getattr(feature, "dtype", None)
    if feature is not None and dtype not in ("string", "large_string"):
        raise ValueError(
            f"{field_flag} {text_field!r} holds {dtype or type(feature).__name__} values, not text: "
            "pretraining reads one string per row; pick a text column (conversations train with `titan sft`)"
        )


def _text_of(value: Any, field_flag: str, text_field: str) -> str:
    """One row's text; a value of another type is refused rather than trained on as its repr."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(
            f"{field_flag} {text_field!r} holds {type(value).__name__} values, not text: pretraining "
            "reads one string per row; pick a text column"
        )
    return value


class StreamPacker(DocumentPacker):
    """`DocumentPacker` over a `ShardedStream`: the same framing, windows, ``fill`` and
    ``skip``, with the position ``(epoch, shard, row, offset)`` (see the module docstring).

    Epoch e reads the shards in a permutation seeded by (seed, e) when ``shuffle``, else in
    order; every rank holds one packer over the same stream, as with map-style sources.
    """

    def __init__(self, stream: ShardedStream, *, bos_id: int, eos_id: int, shuffle: bool, seed: int) -> None:
        if stream.num_shards < 1:
            raise ValueError("the streamed dataset has no shards (files); check --dataset.name, "
                             "--dataset.subset and --dataset.split")
        self.source = stream
        self.num_shards = stream.num_shards
        self.bos_id, self.eos_id = bos_id, eos_id
        self.shuffle, self.seed = shuffle, seed
        self.epoch = self.shard = self.row = self.offset = 0
        self._doc: tuple[tuple[int, int, int], np.ndarray] | None = None  # (position, framed ids)
        self._reader: tuple[tuple[int, int, int], Iterator[str]] | None = None  # (next row's position, rows)
        self._epochs_without_text = 0  # epochs ended since the last non-empty document
        if shuffle and self.num_shards == 1:
            logger.warning("--dataset.streaming with one shard: documents are read in file order every "
                           "epoch (streaming shuffles the order of shards, not the rows inside one)")

    def _position(self) -> tuple[int, int, int]:
        return self.epoch, self.shard, self.row

    def _current_document(self) -> np.ndarray:
        """Framed ids of the row under the position, read from the stream on first use (moving
        the position past shards that have ended)."""
        if self._doc is None or self._doc[0] != self._position():
            text = self._read_row()
            ids = self.source.tokens(text)
            if len(ids):
                self._epochs_without_text = 0
            self._doc = (self._position(), self._frame(ids))
        return self._doc[1]

    def _read_row(self) -> str:
        """The text at the position; a shard that has ended moves the position to the next
        shard (and epoch), and a whole epoch of shards without a row is an error."""
        barren = 0  # shards in a row that ended before yielding anything
        while True:
            if self._reader is None or self._reader[0] != self._position():
                shard_index = int(self._shard_order()[self.shard])
                self._reader = (self._position(), self.source.rows(shard_index, self.row))
            try:
                text = next(self._reader[1])
            except StopIteration:
                barren = barren + 1 if self.row == 0 else 0
                if barren > self.num_shards:
                    raise ValueError("the streamed dataset has no documents; check --dataset.name, "
                                     "--dataset.subset and --dataset.split") from None
                self._next_shard()
                continue
            self._reader = ((self.epoch, self.shard, self.row + 1), self._reader[1])
            return text

    def _next_shard(self) -> None:
        """Move to the start of the next shard, wrapping into the next epoch."""
        self.shard, self.row, self.offset = self.shard + 1, 0, 0
        if self.shard == self.num_shards:
            self.shard = 0
            self.epoch += 1
            self._epochs_without_text += 1
            if self._epochs_without_text > 1:  # a whole epoch read, every document empty
                raise ValueError("every document is empty after tokenization; check --dataset.name "
                                 "and --dataset.text_field")

    def _shard_order(self) -> np.ndarray:
        """This epoch's order of shards (seeded by (seed, epoch) alone: one order on every rank)."""
        order = np.arange(self.num_shards, dtype=np.int64)
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
        return order

    def _advance_document(self) -> None:
        """Move to the next row of this shard (a shard's end is found when reading it)."""
        self.offset = 0
        self.row += 1

    def _check_not_all_empty(self, empty_run: int) -> None:
        """Checked per epoch instead (`_next_shard`): a stream's length is unknown."""

    def state_dict(self) -> dict[str, int]:
        """The stream position: plain ints."""
        return {"epoch": self.epoch, "shard": self.shard, "row": self.row, "offset": self.offset,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to a saved position; the next ``fill`` re-opens its shard and continues exactly."""
        self.epoch, self.shard, self.row, self.offset = (
            int(state["epoch"]), int(state["shard"]), int(state["row"]), int(state["offset"]))
        self.seed = int(state["seed"])  # the data order is part of the run being resumed
        self._doc = self._reader = None
        self._epochs_without_text = 0
