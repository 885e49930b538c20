"""Packing documents into fixed windows, with a resumable position; and
`best_fit_decreasing`, the bin packing of whole sequences into rows (SFT's ``bfd`` packing,
RL's padding-free rows).

Each document becomes ``BOS tokens EOS`` (just ``tokens EOS`` when the
tokenizer's BOS and EOS are one token, so separators are never doubled);
documents are laid end to end and cut into windows of seq_len + 1 tokens.
Windows do not overlap, so every window is a distinct sample; the one
prediction across a window boundary is lost, which keeps samples
independent of each other (and of the batch they land in).

`fill` can also mark where documents start inside the window (`starts`), which
is how the loader derives per-document positions and document ids for
document-masked attention; the marks follow from the position alone, so they
add nothing to the saved state.

The whole position is three ints: the epoch, the cursor into this epoch's
document order, and the token offset into that document. Restoring it only
re-tokenizes one document, whatever the corpus size.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
from titan.train.data.sources import DocumentSource

__all__ = ["DocumentPacker", "best_fit_decreasing"]

# Documents announced to the source at a time (`DocumentSource.prefetch`), so a source that
# reads in blocks (datasets' Arrow tables) pays one read per block, not one per document.
PREFETCH_DOCUMENTS = 256


class DocumentPacker:
    """Turns a corpus into one endless stream of framed document tokens.

    Epoch e visits every document of `source` in a permutation seeded by
    (seed, e) when `shuffle`, else in index order. The loader gives every
    data-parallel rank the same packer, so all ranks read the same global
    stream and each keeps its own rows of it (`fill` its rows, `skip` the
    others'). Empty documents are skipped entirely (no lone BOS/EOS pairs
    from blank lines or empty files).
    """

    def __init__(
        self, source: DocumentSource, *, bos_id: int, eos_id: int, shuffle: bool, seed: int
    ) -> None:
        self.source = source
        self.num_documents = len(source)
        if self.num_documents == 0:  # else the first fill fails with a bare IndexError
            raise ValueError(
                "the dataset has no documents; check --dataset.name, --dataset.path, "
                "--dataset.subset and --dataset.split"
            )
        self.bos_id, self.eos_id = bos_id, eos_id
        self.shuffle, self.seed = shuffle, seed
        self.epoch = self.cursor = self.offset = 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order) cache
        self._doc: tuple[tuple[int, int], np.ndarray] | None = None  # ((epoch, cursor), ids)
        self._prefetched: tuple[int, int] | None = None  # (epoch, block) announced to source

    @property
    def bos_separator(self) -> bool:
        """Whether documents start with their own BOS (False if BOS == EOS)."""
        return self.bos_id != self.eos_id

    def fill(self, out: np.ndarray, starts: np.ndarray | None = None) -> None:
        """Write the next len(out) stream tokens into the 1-D array `out`.

        With `starts` (a bool array as long as `out`), also mark True each
        token that is the first of its framed document (its BOS, or first
        token when BOS == EOS) and False every other one; a document already
        entered before this fill is not marked. Cost is linear in len(out)
        plus the tokenization of the documents entered, each tokenized once
        per epoch.
        """
        if starts is not None:
            starts[:] = False
        self._consume(len(out), out, starts)

    def skip(self, n: int) -> None:
        """Advance past the next `n` stream tokens (those of other ranks' rows)
        without copying them, exactly as `fill` would; the documents entered are
        still tokenized."""
        self._consume(n, None)

    def _consume(self, n: int, out: np.ndarray | None, starts: np.ndarray | None = None) -> None:
        """Advance by `n` tokens, copying them into `out` (and marking document starts in
        `starts`) unless it is None."""
        pos, empty_run = 0, 0
        while pos < n:
            doc = self._current_document()
            take = min(len(doc) - self.offset, n - pos)
            if out is not None:
                out[pos : pos + take] = doc[self.offset : self.offset + take]
            if starts is not None and take > 0 and self.offset == 0:
                starts[pos] = True
            pos += take
            self.offset += take
            if self.offset >= len(doc):
                empty_run = empty_run + 1 if len(doc) == 0 else 0
                self._check_not_all_empty(empty_run)
                self._advance_document()

    def _current_document(self) -> np.ndarray:
        """Framed ids of the document under the cursor (cached until it is left)."""
        key = (self.epoch, self.cursor)
        if self._doc is None or self._doc[0] != key:
            order = self._epoch_order()
            block = self.cursor // PREFETCH_DOCUMENTS
            if self._prefetched != (self.epoch, block):
                start = block * PREFETCH_DOCUMENTS
                self.source.prefetch(order[start : start + PREFETCH_DOCUMENTS])
                self._prefetched = (self.epoch, block)
            doc_index = int(order[self.cursor])
            self._doc = (key, self._frame(self.source.tokens(doc_index)))
        return self._doc[1]

    def _frame(self, ids: np.ndarray) -> np.ndarray:
        """`BOS ids EOS` (or `ids EOS` with a shared BOS/EOS); empty stays empty."""
        if len(ids) == 0:
            return ids
        head = [self.bos_id] if self.bos_separator else []
        return np.concatenate([np.asarray(head, np.int64), ids.astype(np.int64), [self.eos_id]])

    def _epoch_order(self) -> np.ndarray:
        """This epoch's document order (one permutation computed per epoch)."""
        if self._order is None or self._order[0] != self.epoch:
            order = np.arange(self.num_documents, dtype=np.int64)
            if self.shuffle:
                # Seeded by (seed, epoch) alone: one order for every rank. numpy pads a short
                # seed with zeros, so this is the former (seed, epoch, rank=0) order exactly and
                # saved positions stay valid.
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            self._order = (self.epoch, order)
        return self._order[1]

    def _advance_document(self) -> None:
        """Move to the next document, wrapping into the next epoch."""
        self.offset = 0
        self.cursor += 1
        if self.cursor == self.num_documents:
            self.cursor = 0
            self.epoch += 1

    def _check_not_all_empty(self, empty_run: int) -> None:
        """Fail instead of looping forever when every document is empty."""
        if empty_run > self.num_documents:
            raise ValueError(
                "every document is empty after tokenization; "
                "check --dataset.path and --dataset.text_field"
            )

    def state_dict(self) -> dict[str, int]:
        """The stream position: plain ints."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "offset": self.offset,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to a saved position; the next `fill` continues from it exactly."""
        self.epoch, self.cursor, self.offset = (
            int(state["epoch"]),
            int(state["cursor"]),
            int(state["offset"]),
        )
        # The saved seed wins: the data order is part of the run being resumed.
        self.seed = int(state["seed"])
        self._order = self._doc = self._prefetched = None


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths``, each bin's lengths summing to at most ``capacity``:
    the longest item first, each into the bin it fills best (the least room left that still
    takes it; the earliest such bin), a new bin when none does. Bins in the order they were
    opened, indices in the order they were placed. Every length must be at most ``capacity``."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted: the best fit is the first that takes it
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"an item of length {n} does not fit a bin of {capacity}")
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - n, len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - n, b))
    return bins
