"""`--dataset.*`: which documents the loader reads (the up-front checks that need the
filesystem are `titan.train.data.build.validate_data_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan.train.data.sources import LOCAL_FORMATS

__all__ = [
    "DatasetConfig",
    "BUILTIN_DATASETS",
    "MIX_BLOCK",
    "mix_block_counts",
    "parse_mix",
]

# Names that need no download; anything else is a Hugging Face hub name.
BUILTIN_DATASETS = ("synthetic", "stdlib", "tokenized")

# Windows per mixture block: each block holds every corpus's share of windows exactly.
MIX_BLOCK = 1000


@dataclass(kw_only=True)
class DatasetConfig:
    """`--dataset.*`: the corpus the training stream is packed from."""

    name: str = "synthetic"
    """"synthetic" (Markov chain with a known loss floor), "stdlib" (Python's own
    source files), "text" | "json" | "parquet" (local files at --dataset.path),
    "tokenized" (a corpus folder written by `titan data tokenize`, at --dataset.path, or
    several with --dataset.mix), or a Hugging Face hub dataset name (downloaded through
    `datasets`)."""
    path: str | None = None
    """Local file, directory or glob for "text", "json" and "parquet"; the corpus folder for
    "tokenized"."""
    mix: str | None = None
    """For "tokenized": several corpus folders with weights, `PATH:WEIGHT,PATH:WEIGHT` (e.g.
    `web:0.7,code:0.3`); windows are drawn from each in proportion, in a seeded order."""
    text_field: str = "text"
    """Column holding each document's text (json, parquet, hub datasets)."""
    split: str = "train"
    """Dataset split to read (local files always form the "train" split)."""
    subset: str | None = None
    """Hub dataset configuration name (e.g. "en" for c4)."""
    text_sample_by: Literal["line", "paragraph", "document"] = "line"
    """For "text": one document per line (as `datasets` does; blank lines are
    skipped), per blank-line-separated paragraph, or per whole file."""
    streaming: bool = False
    """Read a hub dataset (or local files) as `datasets` streams it, shard by shard, instead of
    downloading and converting all of it first: for corpora larger than the disk (the Hub's
    allenai/c4 is ~300 GB). Shuffling then permutes the shards, not the documents inside one;
    resuming re-reads at most one shard. The built-in corpora (synthetic, stdlib, tokenized)
    download nothing and are read as training goes either way, so a recipe's streaming
    setting carries over to them unchanged."""
    shuffle: bool = True
    """Visit documents in a fresh seeded order every epoch."""
    cache_dir: str | None = None
    """Where `datasets` caches prepared data (default: its own cache)."""
    synthetic_symbols: int = 256
    """Synthetic: number of distinct symbols (at most the tokenizer's non-special ids)."""
    synthetic_successors: int = 4
    """Synthetic: successors per symbol; the per-token entropy is log(this) nats."""
    synthetic_documents: int = 100_000
    """Synthetic: number of documents before the stream repeats (generated lazily)."""
    synthetic_mean_length: int = 256
    """Synthetic: mean document length in symbols (lengths are geometric)."""
    synthetic_seed: int = 0
    """Synthetic: seed of the corpus itself (the successor table and every document)."""

    def __post_init__(self) -> None:
        self._check_source()
        self._check_synthetic()

    def _check_source(self) -> None:
        """The name/path combination makes sense."""
        if not self.name:
            raise ValueError(
                "--dataset.name is empty; use synthetic, stdlib, text, json, parquet, tokenized "
                "or a hub name"
            )
        if self.name in LOCAL_FORMATS and not self.path:
            raise ValueError(
                f"--dataset.name {self.name} reads local files: set --dataset.path to a file, "
                "directory or glob"
            )
        if self.name == "tokenized":
            self._check_tokenized()
        elif self.mix:
            raise ValueError(
                f"--dataset.mix is only read with --dataset.name tokenized, got {self.name!r}; "
                "set --dataset.name tokenized or drop the mix"
            )
        elif self.name not in LOCAL_FORMATS and self.path:
            raise ValueError(
                f"--dataset.path is only read for local files, but --dataset.name is {self.name!r}; "
                "set --dataset.name to text, json or parquet, or drop the path"
            )
        if not self.text_field:
            raise ValueError("--dataset.text_field is empty; name the column holding the text")
        if not self.split:
            raise ValueError("--dataset.split is empty; use e.g. train")
        if self.text_sample_by not in ("line", "paragraph", "document"):
            raise ValueError(
                f"--dataset.text_sample_by must be line, paragraph or document, got {self.text_sample_by!r}"
            )

    def check_unread_fields(self) -> None:
        """Raise ValueError naming a field the named source would not read (a split of a built-in
        corpus, a subset of local files, ...). Not part of `__post_init__`: a recipe's or a job
        file's value is a default the user may switch the source under (the CLI refuses such
        fields only where the command line gives them; `titan data tokenize` calls this)."""
        if self.subset is not None and not self.is_hub:
            raise ValueError(
                f"--dataset.subset {self.subset!r} names a configuration of a hub dataset (or a folder laid out "
                f"as one); --dataset.name {self.name} has none: drop it"
            )
        if self.split != "train" and not self.is_hub:
            where = ("local files form one split, train: point --dataset.path at the held-out files, or name a "
                     "folder laid out in splits as --dataset.name FOLDER" if self.is_local
                     else "it has no splits: name held-out data with --dataset.name/--dataset.path")
            raise ValueError(f"--dataset.split {self.split!r} is not read for --dataset.name {self.name}: {where}")
        if self.text_field != "text" and self.name in (*BUILTIN_DATASETS, "text"):
            raise ValueError(
                f"--dataset.text_field {self.text_field!r} names a column of json, parquet or hub rows; "
                f"--dataset.name {self.name} has none: drop it"
            )
        if self.text_sample_by != "line" and self.name != "text":
            raise ValueError(
                f"--dataset.text_sample_by {self.text_sample_by} splits plain text files into documents; "
                f"--dataset.name {self.name} is read by row: drop it"
            )

    def _check_tokenized(self) -> None:
        """Exactly one of a corpus path or a mixture, and a mixture that parses."""
        if bool(self.path) == bool(self.mix):
            raise ValueError(
                "--dataset.name tokenized reads a corpus folder written by `titan data tokenize`: "
                "set either --dataset.path CORPUS or --dataset.mix CORPUS:WEIGHT,... (not both)"
            )
        if self.mix:
            mix_block_counts([w for _, w in parse_mix(self.mix)])

    def _check_synthetic(self) -> None:
        """Synthetic corpus parameters are in range (checked whatever the name,
        since they are plain numbers and a bad one is a typo either way)."""
        for flag, value in (
            ("synthetic_symbols", self.synthetic_symbols),
            ("synthetic_successors", self.synthetic_successors),
            ("synthetic_documents", self.synthetic_documents),
            ("synthetic_mean_length", self.synthetic_mean_length),
        ):
            if value < 1:
                raise ValueError(f"--dataset.{flag} must be >= 1, got {value}")
        if self.synthetic_successors > self.synthetic_symbols:
            raise ValueError(
                f"--dataset.synthetic_successors {self.synthetic_successors} exceeds "
                f"--dataset.synthetic_symbols {self.synthetic_symbols}; a symbol's successors are "
                "distinct symbols, so lower the first or raise the second"
            )

    @property
    def is_local(self) -> bool:
        """Whether this reads local files through `datasets`."""
        return self.name in LOCAL_FORMATS

    @property
    def streams(self) -> bool:
        """Whether `datasets` streams this corpus (``--dataset.streaming`` on a hub dataset or
        local files; the built-in corpora are read lazily anyway)."""
        return self.streaming and self.name not in BUILTIN_DATASETS

    @property
    def is_hub(self) -> bool:
        """Whether this is a Hugging Face hub dataset name."""
        return self.name not in LOCAL_FORMATS and self.name not in BUILTIN_DATASETS


def parse_mix(text: str) -> list[tuple[str, float]]:
    """`PATH:WEIGHT,PATH:WEIGHT` -> [(path, weight)] (a path may itself hold ':')."""
    parts = []
    for item in text.split(","):
        path, sep, weight = item.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = float("nan")
        if not sep or not path or not value > 0:
            raise ValueError(
                f"--dataset.mix {text!r}: {item.strip()!r} is not PATH:WEIGHT with a weight > 0; "
                "write e.g. --dataset.mix web:0.7,code:0.3"
            )
        parts.append((path, value))
    return parts


def mix_block_counts(weights: list[float], block: int = MIX_BLOCK) -> list[int]:
    """Windows of each corpus per block of `block` windows: the weights scaled to `block`,
    rounded by largest remainder (so they sum to `block` exactly)."""
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [int(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    if min(counts) == 0:
        raise ValueError(
            f"--dataset.mix weights {weights}: a share below 1/{block} of the windows rounds to "
            "none; raise that weight or drop the corpus"
        )
    return counts
