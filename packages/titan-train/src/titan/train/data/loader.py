"""The resumable, data-parallel training loader over raw documents (`build_packed_dataloader`;
`titan.train.data.build.build_dataloader` picks it or the pre-tokenized one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from titan.train.data.config import BUILTIN_DATASETS, DatasetConfig
from titan.train.data.packing import DocumentPacker
from titan.train.data.resumable import RESTART_HINT, ResumableLoader, check_loader_args
from titan.train.data.sources import (
    LOCAL_FORMATS,
    DocumentSource,
    HFDatasetSource,
    StdlibSource,
    SyntheticSource,
    load_local_files,
    resolve_data_files,
    why_unreadable,
)
from titan.train.data.streaming import ShardedStream, StreamPacker
from titan.train.data.synthetic import SyntheticCorpus
from titan.train.data.tokenizer import Tokenizer
from torch.utils.data import IterableDataset

__all__ = [
    "PackedBatches",
    "PackedDataLoader",
    "StreamingDataLoader",
    "load_hf_dataset",
    "build_packed_dataloader",
    "build_source",
    "document_layout",
    "synthetic_corpus",
]

def synthetic_corpus(cfg: DatasetConfig, tokenizer: Tokenizer) -> SyntheticCorpus:
    """The synthetic corpus `cfg` describes, its symbols mapped to `tokenizer`'s
    non-special ids (lowest first). Also how a trainer gets the loss floor."""
    symbol_ids = _non_special_ids(tokenizer, cfg.synthetic_symbols)
    return SyntheticCorpus(
        n_symbols=cfg.synthetic_symbols,
        successors=cfg.synthetic_successors,
        n_documents=cfg.synthetic_documents,
        mean_length=cfg.synthetic_mean_length,
        symbol_ids=symbol_ids,
        seed=cfg.synthetic_seed,
    )


def _non_special_ids(tokenizer: Tokenizer, count: int) -> list[int]:
    """The first `count` ids that are not BOS/EOS/PAD (fewer if the vocab is short)."""
    specials = tokenizer.special_ids
    wanted = count + len(specials)  # never need to look further than this
    return [i for i in range(min(wanted, tokenizer.vocab_size)) if i not in specials][:count]


def build_source(cfg: DatasetConfig, tokenizer: Tokenizer) -> DocumentSource:
    """The map-style document source `cfg` names."""
    if cfg.name == "synthetic":
        return SyntheticSource(synthetic_corpus(cfg, tokenizer))
    if cfg.name == "stdlib":
        return StdlibSource(tokenizer)
    return HFDatasetSource(load_hf_dataset(cfg), tokenizer, cfg.text_field)


def build_stream(cfg: DatasetConfig, tokenizer: Tokenizer | None, *, flag: str | None = None,
                 field_flag: str = "--dataset.text_field") -> ShardedStream:
    """The shard-by-shard stream `cfg` names (``--dataset.streaming``); its errors name
    ``flag`` (default: the dataset's path or name flag) and ``field_flag``."""
    describe = None
    if cfg.is_local:
        files = resolve_data_files(cfg.name, cfg.path)
        describe = lambda err: why_unreadable(cfg.name, files, err)  # noqa: E731 - names the file and line
    flag = flag or ("--dataset.path" if cfg.is_local else "--dataset.name")
    return ShardedStream(load_hf_dataset(cfg), tokenizer, cfg.text_field, describe_error=describe, flag=flag,
                         field_flag=field_flag)


def load_hf_dataset(cfg: DatasetConfig):
    """Local files (text/json/parquet) or a hub dataset: a map-style ``Dataset``, or with
    ``--dataset.streaming`` an ``IterableDataset`` that reads as it goes (nothing downloaded
    or converted beforehand)."""
    import datasets  # deferred: importing it costs ~1 s, synthetic runs never need it

    if cfg.is_local:
        files = resolve_data_files(cfg.name, cfg.path)  # raises before datasets does any work
        extra = {"sample_by": cfg.text_sample_by} if cfg.name == "text" else {}
        return load_local_files(cfg.name, files, flag="--dataset.path", split=cfg.split,
                                cache_dir=cfg.cache_dir, streaming=cfg.streams, **extra)
    try:
        return datasets.load_dataset(cfg.name, cfg.subset, split=cfg.split, cache_dir=cfg.cache_dir,
                                     streaming=cfg.streams)
    except ConnectionError as err:  # offline, or no route to the Hub: name the flag and the ways out
        raise ValueError(
            f"--dataset.name {cfg.name!r} is not built in ({', '.join(BUILTIN_DATASETS)}) nor a "
            f"local format ({', '.join(LOCAL_FORMATS)}), so it is read from the Hugging Face Hub, "
            f"which could not be reached ({err}); download it beforehand into the `datasets` cache "
            "(--dataset.cache_dir), or use --dataset.name text|json|parquet with --dataset.path"
        ) from err


def document_layout(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token (positions, document_ids), both int64 [B, S], from the document-start marks
    `starts` [B, S] (bool) of packed rows.

    Every row begins a new segment, whether or not a document starts there: a document cut by
    the window boundary continues in the next row as a fresh sample, with positions from 0 and
    its own id. Attention cannot reach its earlier part in the previous row anyway, so its
    true offsets would describe context the model never sees; restarting keeps every position
    below seq_len (inside the RoPE cache however long the document) and makes the fragment
    look exactly like a document that starts there. Ids count documents along the row from 0.
    """
    starts = starts.copy()
    starts[:, 0] = True
    document_ids = np.cumsum(starts, axis=1, dtype=np.int64) - 1
    index = np.arange(starts.shape[1], dtype=np.int64)
    last_start = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return index - last_start, document_ids


class PackedBatches(IterableDataset):
    """One data-parallel rank's batches [B, seq_len + 1] cut from the global
    stream, split into inputs and labels, with the inputs' per-document
    `positions` and `document_ids` (see `document_layout`).

    Each fetch consumes one global microbatch: dp_world_size x B consecutive
    windows of the stream, of which rank r keeps rows r*B .. (r+1)*B - 1. So
    the data of a step depends only on the global batch size, not on how it
    is split over ranks and accumulation steps: one process accumulating
    k microbatches sees exactly the rows that k data-parallel ranks see.

    After every fetch each rank's packer stands at the same place, the end of
    that global microbatch, so the position (and `windows`, the count of
    windows consumed by all ranks together) is global, not per rank.
    Batches are produced on demand (no prefetch), so the position is always
    exactly "after the last batch handed out".
    """

    def __init__(
        self,
        packer: DocumentPacker,
        batch_size: int,
        seq_len: int,
        *,
        dp_rank: int = 0,
        dp_world_size: int = 1,
    ) -> None:
        self.packer, self.batch_size, self.seq_len = packer, batch_size, seq_len
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.windows = 0  # windows of seq_len + 1 tokens consumed globally (all ranks' rows)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> dict[str, torch.Tensor]:
        """Fill one batch of windows and shift it into (input_ids, labels)."""
        window = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        starts = np.empty(window.shape, dtype=bool)
        rank_tokens = window.size
        self.packer.skip(self.dp_rank * rank_tokens)  # the rows of lower ranks
        # This rank's rows are consecutive in the stream: one fill writes them all.
        self.packer.fill(window.reshape(-1), starts.reshape(-1))
        self.packer.skip((self.dp_world_size - 1 - self.dp_rank) * rank_tokens)
        tokens = torch.from_numpy(window)
        positions, document_ids = document_layout(starts[:, :-1])
        self.windows += self.dp_world_size * self.batch_size
        # Packing leaves no padding, so every label is a real target (no -100). The label of a
        # document's last token (EOS) is the next document's first token: kept, as in
        # unmasked packing, so the loss is the same whether or not attention is masked.
        return {
            "input_ids": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "positions": torch.from_numpy(positions),
            "document_ids": torch.from_numpy(document_ids),
        }


class PackedDataLoader(ResumableLoader):
    """An endless `torch.utils.data.DataLoader` of packed batches, resumable.

    Iterate it (`for batch in loader`, or `next(loader)`); every iterator
    draws from the same position. `state_dict()` is one global record, the
    same on every rank after every fetch (each fetch consumes a whole global
    microbatch on every rank): the position in the global stream, in windows
    of seq_len + 1 tokens. It resumes under any data-parallel degree, local
    batch size or accumulation count: the next fetch takes the next
    dp_world_size x B windows, so a resumed run reads exactly the windows an
    uninterrupted one would. Only seq_len (window boundaries), the corpus and
    shuffling must match (`ResumableLoader` checks them).
    """

    # 2: a position in the one global stream, no longer in a per-rank document shard, still
    # stored once per dp rank; 3: one global record, the same on every rank, counted in
    # windows of seq_len + 1 tokens.
    STATE_VERSION = 3

    def __init__(
        self, dataset: PackedBatches, *, dp_rank: int, dp_world_size: int, num_documents: int
    ) -> None:
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size)
        self.num_documents = num_documents

    @property
    def packer(self) -> DocumentPacker:
        """The packer behind this loader (its position is the loader's state)."""
        return self.dataset.packer

    @property
    def epoch(self) -> int | None:
        """Passes the stream has completed over its corpus (0 during the first); None where it
        has no end (a mixture of corpora)."""
        return self.packer.epoch

    def position(self) -> dict[str, Any]:
        """The packer's (epoch, cursor, offset, seed) — or a pre-tokenized stream's token
        count — and the `windows` consumed globally."""
        return {**self.packer.state_dict(), "windows": self.dataset.windows}

    def restore(self, state: dict[str, Any]) -> None:
        """Put the packer and the window count where the saved loader stood."""
        self.packer.load_state_dict(state)
        self.dataset.windows = int(state["windows"])

    def measured_against(self) -> dict[str, tuple[Any, str]]:
        """Window boundaries, the corpus and its order."""
        return {
            "seq_len": (self.dataset.seq_len, "--training.seq_len (windows are seq_len + 1 tokens)"),
            "num_documents": (self.num_documents, "dataset (--dataset.name/--dataset.path, --dataset.synthetic_*)"),
            "shuffle": (self.packer.shuffle, "--dataset.shuffle / --dataset.no_shuffle"),
        }

    def saved_version(self, state: dict[str, Any]) -> Any:
        """Versions <= 2 stored one entry per rank ({"dp_rank_<r>": {...}}) without a version."""
        version = state.get("version")
        if version is None and any(str(key).startswith("dp_rank_") for key in state):
            return 2
        return version

    def version_error(self, version: Any) -> str:
        """Names the older layout when the state is one."""
        older = isinstance(version, int) and version < self.STATE_VERSION
        writer = "an older titan-train (one entry per data-parallel rank)" if older else "another titan-train"
        return (f"data loader state version {version} is not {self.STATE_VERSION}: it was written by {writer}, "
                f"which this one cannot resume; {RESTART_HINT}, or resume with the titan-train that wrote it")


class StreamingDataLoader(PackedDataLoader):
    """`PackedDataLoader` over a streamed dataset (``--dataset.streaming``): the same batches
    and global, data-parallel-independent position, counted in ``(epoch, shard, row, offset)``
    (`titan.train.data.streaming`) and measured against the number of shards, since a
    stream's number of documents is unknown until it has been read."""

    def __init__(self, dataset: PackedBatches, *, dp_rank: int, dp_world_size: int) -> None:
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, num_documents=-1)

    def measured_against(self) -> dict[str, tuple[Any, str]]:
        """Window boundaries, the stream's shards and their order."""
        return {
            "seq_len": (self.dataset.seq_len, "--training.seq_len (windows are seq_len + 1 tokens)"),
            "num_shards": (self.packer.num_shards, "dataset (--dataset.name/--dataset.path/--dataset.streaming)"),
            "shuffle": (self.packer.shuffle, "--dataset.shuffle / --dataset.no_shuffle"),
        }


def build_packed_dataloader(
    cfg: DatasetConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
) -> PackedDataLoader:
    """An endless loader of `{"input_ids", "labels", "positions", "document_ids"}`
    LongTensors [B, S] for one rank (the last two describe the packed documents, for
    `--training.document_mask`; see `document_layout`).

    Every document is framed with BOS/EOS and packed, in one seeded order
    shared by all ranks (`seed` reorders each epoch when --dataset.shuffle),
    into one global stream of windows of seq_len + 1, shifted by one. Each
    fetch takes dp_world_size x B windows and hands this rank its B rows
    (see `PackedBatches`): ranks never share a sample, and a step's global
    batch is the same whatever the data-parallel degree, which is what
    makes a data-parallel run equal to one process with gradient
    accumulation. The price: every rank tokenizes the whole stream, not
    1 / dp_world_size of it (`--dataset.name tokenized` reads a corpus
    tokenized beforehand, each rank only its own rows: `titan.train.data.tokenized`). The saved position is global (see
    `PackedDataLoader`), so a checkpoint resumes under any data-parallel
    degree and batch split, given the same seq_len, corpus and shuffling.
    """
    if cfg.name == "tokenized":
        raise ValueError("--dataset.name tokenized is read by build_tokenized_dataloader (build_dataloader picks it)")
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    if cfg.streams:
        stream = build_stream(cfg, tokenizer)
        stream_packer = StreamPacker(
            stream, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, shuffle=cfg.shuffle, seed=seed
        )
        batches = PackedBatches(stream_packer, local_batch_size, seq_len, dp_rank=dp_rank,
                                dp_world_size=dp_world_size)
        return StreamingDataLoader(batches, dp_rank=dp_rank, dp_world_size=dp_world_size)
    source = build_source(cfg, tokenizer)
    packer = DocumentPacker(
        source, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, shuffle=cfg.shuffle, seed=seed
    )
    batches = PackedBatches(
        packer, local_batch_size, seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    return PackedDataLoader(
        batches, dp_rank=dp_rank, dp_world_size=dp_world_size, num_documents=len(source)
    )
