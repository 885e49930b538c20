"""Pre-tokenized corpora: written once by `titan data tokenize`, memory-mapped at training time.

A corpus is a folder::

    manifest.json          format, version, dtype, tokenizer (kind + sha256 of its file),
                           source, counts, and the shard list
    tokens-00000.bin       the shard's token ids, documents end to end (no BOS/EOS), as raw
                           uint16 (vocabulary <= 65536) or uint32, read with `np.memmap`
    index-00000.npy        int64 [documents + 1]: where each document starts in the shard
                           (the last entry is the shard's token count)

Documents are stored unframed and in source order, empty ones included, so a corpus holds
exactly the documents the on-the-fly loader reads from the same text. Training frames them
(`BOS ids EOS`) with the run's tokenizer and packs them into the same global stream of
windows of seq_len + 1 tokens: epoch e visits the documents in the permutation seeded by
(seed, e) (documents, not windows, are shuffled, as on the fly), empty ones skipped. The
difference is the cost: a rank finds any stream position by binary search over the
epoch's cumulative document lengths, so it skips the other ranks' rows in O(1) tokens and
copies only its own; nothing is tokenized at training time. The lengths along an epoch's
order are summed once per epoch (O(documents), 16 bytes each, like the order itself).

A mixture (`--dataset.mix a:0.7,b:0.3`) interleaves windows: the global window stream is cut
into blocks of `MIX_BLOCK` windows, each holding a fixed number of windows of every corpus
(its weight, rounded) in an order seeded by (seed, block). Window w of the mixture is window
k of its corpus' own stream, where k counts that corpus' windows before w; both follow from
w alone, so the position stays one number and resumes under any layout.

Writing (`titan.train.data.corpus_writer.tokenize_corpus`, also importable from here) is
atomic and resumable; the format's names and the tokenizer fingerprint are in
`titan.train.data.corpus_format`. This module reads corpora and streams them to the loader.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from titan.train.data.config import DatasetConfig, mix_block_counts, parse_mix
from titan.train.data.corpus_format import (
    FORMAT,
    FORMAT_VERSION,
    INCOMPLETE_SUFFIX,
    MANIFEST,
    describe_fingerprint,
    fingerprint_of,
    same_tokenizer,
    tokenizer_fingerprint,
)
from titan.train.data.corpus_writer import tokenize_corpus
from titan.train.data.loader import PackedBatches, PackedDataLoader
from titan.train.data.resumable import check_loader_args
from titan.train.data.tokenizer import Tokenizer, TokenizerConfig

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CorpusStream",
    "TokenizedCorpus",
    "TokenizedPacker",
    "build_tokenized_dataloader",
    "check_corpus_tokenizer",
    "check_tokenized_dataset",
    "read_manifest",
    "tokenize_corpus",
    "tokenizer_fingerprint",
]

# ---- reading ------------------------------------------------------------------------------


class TokenizedCorpus:
    """A corpus folder, checked and memory-mapped: `num_documents` documents, `document(i)`
    their ids (a view, no copy). Opening reads the manifest and the document index
    (O(documents)); token shards are only mapped."""

    def __init__(self, path: str | os.PathLike, *, flag: str = "--dataset.path") -> None:
        self.path = Path(path)
        self.flag = flag
        self.manifest = read_manifest(self.path, flag=flag)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.corpus_id = hashlib.sha256((self.path / MANIFEST).read_bytes()).hexdigest()[:16]
        self._tokens = []
        starts, lengths, shard_of = [], [], []
        for i, shard in enumerate(self.manifest["shards"]):
            tokens, offsets = self._open_shard(shard)
            self._tokens.append(tokens)
            starts.append(offsets[:-1])
            lengths.append(np.diff(offsets))
            shard_of.append(np.full(len(offsets) - 1, i, dtype=np.int32))
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.shard_of = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.num_documents = len(self.lengths)

    def _open_shard(self, shard: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Map one shard's tokens and load its index, checking they agree with the manifest."""
        tokens_file, index_file = self.path / shard["tokens"], self.path / shard["index"]
        n_tokens, n_docs = int(shard["num_tokens"]), int(shard["num_documents"])
        bad = self._corrupt
        if not tokens_file.is_file() or not index_file.is_file():
            raise bad(f"{tokens_file.name} or {index_file.name} is missing")
        if tokens_file.stat().st_size != n_tokens * self.dtype.itemsize:
            raise bad(f"{tokens_file.name} holds {tokens_file.stat().st_size} bytes, the manifest "
                      f"says {n_tokens} {self.dtype.name} tokens")
        try:
            offsets = np.load(index_file)
        except (OSError, ValueError) as e:
            raise bad(f"{index_file.name} is not a numpy array ({e})") from None
        if (offsets.shape != (n_docs + 1,) or offsets[0] != 0 or offsets[-1] != n_tokens
                or np.any(np.diff(offsets) < 0)):
            raise bad(f"{index_file.name} does not describe {n_docs} documents of {n_tokens} tokens")
        # A plain ndarray view of the map: slicing a np.memmap object costs several times more.
        tokens = (np.memmap(tokens_file, dtype=self.dtype, mode="r", shape=(n_tokens,))
                  .view(np.ndarray) if n_tokens else np.zeros(0, self.dtype))
        return tokens, offsets.astype(np.int64, copy=False)

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(
            f"{self.flag} {self.path} is a damaged tokenized corpus ({why}); run "
            "`titan data tokenize` again into a new folder"
        )

    def ids(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """Ids lo..hi-1 of document `doc` (a view into the memory map)."""
        start = self.starts[doc]
        return self._tokens[self.shard_of[doc]][start + lo : start + hi]

    def document(self, doc: int) -> np.ndarray:
        """All ids of document `doc`, unframed."""
        return self.ids(doc, 0, int(self.lengths[doc]))

    def check_tokenizer(self, tokenizer: Tokenizer | TokenizerConfig) -> None:
        """Refuse a run whose tokenizer is not the one the corpus was written with."""
        check_corpus_tokenizer(self.path, self.manifest, tokenizer, self.flag)


def read_manifest(path: Path, *, flag: str = "--dataset.path") -> dict[str, Any]:
    """The checked manifest of corpus folder `path` (ValueError/FileNotFoundError naming `flag`)."""
    file = path / MANIFEST
    if not file.is_file():
        incomplete = path.with_name(path.name + INCOMPLETE_SUFFIX).exists()
        hint = ("an interrupted `titan data tokenize` left it unfinished; rerun the same command "
                "to finish it") if incomplete else "point it at a folder written by `titan data tokenize`"
        raise FileNotFoundError(f"{flag} {path}: no tokenized corpus there ({MANIFEST} missing); {hint}")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path}: {MANIFEST} is not valid JSON ({e}); tokenize again") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{flag} {path}: not a {FORMAT} corpus of version {FORMAT_VERSION} (format "
            f"{manifest.get('format')!r}, version {manifest.get('version')!r}); tokenize it again "
            "with this titan"
        )
    if manifest.get("dtype") not in ("uint16", "uint32") or not isinstance(manifest.get("shards"), list):
        raise ValueError(f"{flag} {path}: {MANIFEST} lacks a valid dtype or shard list; tokenize again")
    return manifest


def check_corpus_tokenizer(path, manifest, tokenizer, flag: str = "--dataset.path") -> None:
    """ValueError (one line, naming the flags) when `tokenizer` differs from the corpus'."""
    theirs, ours = manifest.get("tokenizer", {}), fingerprint_of(tokenizer)
    if not same_tokenizer(theirs, ours):
        raise ValueError(
            f"{flag} {path} was tokenized with the {describe_fingerprint(theirs)} tokenizer, but this run's "
            f"--tokenizer.kind/--tokenizer.path give {describe_fingerprint(ours)}; train with the corpus' "
            "tokenizer, or run `titan data tokenize` again with this one"
        )


def _corpora(cfg: DatasetConfig) -> list[tuple[str, str, float]]:
    """(flag, path, weight) of every corpus the config names."""
    if cfg.mix:
        return [("--dataset.mix", path, weight) for path, weight in parse_mix(cfg.mix)]
    return [("--dataset.path", cfg.path, 1.0)]


def check_tokenized_dataset(cfg: DatasetConfig, tokenizer: TokenizerConfig | None) -> None:
    """The cheap up-front checks (run before any process group or model): every corpus has a
    valid manifest and, given `tokenizer`, was written with it."""
    for flag, path, _ in _corpora(cfg):
        manifest = read_manifest(Path(path), flag=flag)
        if tokenizer is not None:
            check_corpus_tokenizer(Path(path), manifest, tokenizer, flag)


# ---- the stream ---------------------------------------------------------------------------


class CorpusStream:
    """One corpus as the endless stream of framed documents the on-the-fly packer makes:
    epoch e in the order seeded by (seed, e) (index order without `shuffle`), each document
    `BOS ids EOS` (`ids EOS` when BOS == EOS), empty ones skipped. Random access: `read(pos,
    out)` costs a binary search plus the copy, whatever `pos`."""

    def __init__(
        self, corpus: TokenizedCorpus, *, bos_id: int, eos_id: int, shuffle: bool, seed: int
    ) -> None:
        self.corpus, self.bos_id, self.eos_id = corpus, bos_id, eos_id
        self.shuffle, self.seed = shuffle, seed
        self.head = 1 if bos_id != eos_id else 0
        lengths = corpus.lengths
        self.framed = np.where(lengths > 0, lengths + self.head + 1, 0)
        self.epoch_tokens = int(self.framed.sum())
        if self.epoch_tokens == 0:
            raise ValueError(
                f"{corpus.flag} {corpus.path} has no tokens (every document is empty); "
                "check the text field it was tokenized from"
            )
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, order, cum)

    def reseed(self, seed: int) -> None:
        """Use another seed (a resumed run keeps the saved one)."""
        if seed != self.seed:
            self.seed, self._epoch = seed, None

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch's document order and the cumulative framed lengths along it (cached)."""
        if self._epoch is None or (self.shuffle and self._epoch[0] != epoch):
            order = np.arange(self.corpus.num_documents, dtype=np.int64)
            if self.shuffle:
                # The same permutation as DocumentPacker's, so the streams agree token for token.
                order = np.random.default_rng([self.seed, epoch]).permutation(order)
            cum = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.framed[order], out=cum[1:])
            self._epoch = (epoch, order, cum)
        return self._epoch[1], self._epoch[2]

    def read(self, pos: int, out: np.ndarray, starts: np.ndarray | None = None) -> None:
        """Write stream tokens pos .. pos+len(out)-1 into `out`; mark in `starts` (already
        False) the first token of every document that begins inside."""
        epoch, q = divmod(pos, self.epoch_tokens)
        done, n = 0, len(out)
        while done < n:
            order, cum = self._order(epoch)
            cursor = int(np.searchsorted(cum, q, side="right")) - 1  # a non-empty document
            while done < n and cursor < len(order):
                doc = int(order[cursor])
                off = q - int(cum[cursor])
                take = min(int(self.framed[doc]) - off, n - done)
                if take > 0:
                    self._copy(doc, off, off + take, out[done : done + take])
                    if starts is not None and off == 0:
                        starts[done] = True
                    done, q = done + take, q + take
                if done < n:
                    cursor += 1
            epoch, q = epoch + 1, 0

    def _copy(self, doc: int, a: int, b: int, dest: np.ndarray) -> None:
        """Framed tokens a..b-1 of document `doc` into `dest`."""
        n, i = int(self.corpus.lengths[doc]), 0
        if a < self.head:
            dest[0], i = self.bos_id, 1
        lo, hi = max(a, self.head) - self.head, min(b, self.head + n) - self.head
        if hi > lo:
            dest[i : i + hi - lo] = self.corpus.ids(doc, lo, hi)
            i += hi - lo
        if b > self.head + n:
            dest[i] = self.eos_id


class TokenizedPacker:
    """`DocumentPacker`'s interface (`fill`, `skip`, `state_dict`, `shuffle`, `seed`) over
    one or several pre-tokenized corpora, so `PackedBatches` and `PackedDataLoader` cut and
    resume its stream exactly as they do the on-the-fly one. The position is one token count
    into the global stream; `skip` is O(1) and `fill` costs the tokens it copies.

    The stream is a sequence of windows of `window` tokens; window w comes from corpus c at
    its own window k (`locate`): with one corpus, c = 0 and k = w, so the stream is the
    corpus stream itself.
    """

    def __init__(
        self, streams: list[CorpusStream], block_counts: list[int], *, window: int,
        shuffle: bool, seed: int, corpus_id: str,
    ) -> None:
        self.streams, self.window = streams, window
        self.block_counts = block_counts
        self.block = sum(block_counts)
        self.shuffle, self.seed, self.corpus_id = shuffle, seed, corpus_id
        self.position = 0
        self._pattern: tuple[int, np.ndarray, np.ndarray] | None = None

    def locate(self, w: int) -> tuple[int, int]:
        """(corpus, that corpus' window index) of global window `w`."""
        if len(self.streams) == 1:
            return 0, w
        block, j = divmod(w, self.block)
        pattern, before = self._block(block)
        c = int(pattern[j])
        return c, block * self.block_counts[c] + int(before[j, c])

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block's corpus sequence (seeded by (seed, block)) and the per-corpus counts before
        each of its windows."""
        if self._pattern is None or self._pattern[0] != block:
            pattern = np.repeat(np.arange(len(self.block_counts)), self.block_counts)
            # A third seed word keeps this stream apart from the epochs' (seed, epoch) orders.
            pattern = np.random.default_rng([self.seed, block, 1]).permutation(pattern)
            onehot = np.eye(len(self.block_counts), dtype=np.int64)[pattern]
            before = np.zeros((len(pattern) + 1, len(self.block_counts)), dtype=np.int64)
            np.cumsum(onehot, axis=0, out=before[1:])
            self._pattern = (block, pattern, before)
        return self._pattern[1], self._pattern[2]

    def skip(self, n: int) -> None:
        """Advance past `n` tokens (other ranks' rows) without reading them."""
        self.position += n

    def fill(self, out: np.ndarray, starts: np.ndarray | None = None) -> None:
        """The next len(out) tokens into `out` (and document starts into `starts`)."""
        if starts is not None:
            starts[:] = False
        if len(self.streams) == 1:  # the corpus' own stream: one read, no window bookkeeping
            self.streams[0].read(self.position, out, starts)
            self.position += len(out)
            return
        done = 0
        while done < len(out):
            w, j = divmod(self.position, self.window)
            c, k = self.locate(w)
            take = min(self.window - j, len(out) - done)
            piece = None if starts is None else starts[done : done + take]
            self.streams[c].read(k * self.window + j, out[done : done + take], piece)
            done += take
            self.position += take

    @property
    def epoch(self) -> int | None:
        """Passes completed over the corpus (0 during the first); None for a mixture, whose
        stream draws from each corpus without end."""
        if len(self.streams) > 1:
            return None
        return self.position // self.streams[0].epoch_tokens

    def state_dict(self) -> dict[str, Any]:
        """The position (tokens into the global stream), the seed, and which corpora (and
        weights) it counts in."""
        return {"tokens": self.position, "seed": self.seed, "corpus": self.corpus_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Jump to a saved position of the same corpora."""
        if state.get("corpus") != self.corpus_id:
            raise ValueError(
                "cannot resume the data loader: the checkpoint's position is in "
                f"{'another data stream' if state.get('corpus') else 'an on-the-fly stream'} "
                f"(corpus {state.get('corpus')!r}, this run {self.corpus_id!r}); resume with the "
                "same --dataset.name/--dataset.path/--dataset.mix, or restart the data stream with "
                "--checkpoint.exclude_from_loading dataloader"
            )
        self.position = int(state["tokens"])
        self.seed = int(state["seed"])  # the saved seed wins, as on the fly
        for stream in self.streams:
            stream.reseed(self.seed)
        self._pattern = None


def build_tokenized_dataloader(
    cfg: DatasetConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
) -> PackedDataLoader:
    """`build_dataloader` for `--dataset.name tokenized`: the same batches, state format and
    resume guarantees, read from memory-mapped corpora (see the module docstring)."""
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    corpora = _corpora(cfg)
    streams, ids = [], []
    for flag, path, _ in corpora:
        corpus = TokenizedCorpus(path, flag=flag)
        corpus.check_tokenizer(tokenizer)
        streams.append(CorpusStream(corpus, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                    shuffle=cfg.shuffle, seed=seed))
        ids.append(corpus.corpus_id)
    counts = mix_block_counts([w for _, _, w in corpora])
    corpus_id = ",".join(f"{i}*{n}" for i, n in zip(ids, counts, strict=True))
    packer = TokenizedPacker(streams, counts, window=seq_len + 1, shuffle=cfg.shuffle, seed=seed,
                             corpus_id=corpus_id)
    batches = PackedBatches(
        packer, local_batch_size, seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    return PackedDataLoader(
        batches, dp_rank=dp_rank, dp_world_size=dp_world_size,
        num_documents=sum(s.corpus.num_documents for s in streams),
    )
