"""Which loader a dataset config asks for, and the checks before any work: above every
loader, so that no loader imports another to dispatch (the package has no import cycle)."""

from __future__ import annotations

import os

from titan.train.data.config import DatasetConfig
from titan.train.data.loader import PackedDataLoader, build_packed_dataloader
from titan.train.data.sources import resolve_data_files
from titan.train.data.tokenized import build_tokenized_dataloader, check_tokenized_dataset
from titan.train.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerConfig


def build_dataloader(cfg: DatasetConfig, tokenizer: Tokenizer, **placement: int) -> PackedDataLoader:
    """The training loader of ``cfg`` for one rank: a corpus tokenized beforehand
    (``--dataset.name tokenized``: each rank reads only its own rows,
    `build_tokenized_dataloader`) or raw documents tokenized and packed on the fly
    (`build_packed_dataloader`, which documents the batches and their resumable state).
    ``placement``: the keywords both take (``dp_rank``, ``dp_world_size``,
    ``local_batch_size``, ``seq_len``, ``seed``)."""
    build = build_tokenized_dataloader if cfg.name == "tokenized" else build_packed_dataloader
    return build(cfg, tokenizer, **placement)


def validate_data_config(dataset: DatasetConfig, tokenizer: TokenizerConfig | None = None) -> None:
    """Checks that need the filesystem, run before any work starts.

    `__post_init__` cannot do these (a recipe may be built on a machine that
    lacks the files); the trainer calls this first thing on the machine that
    trains. Raises FileNotFoundError / ValueError naming the flag to fix.
    """
    if dataset.is_local:
        resolve_data_files(dataset.name, dataset.path)
    if tokenizer is not None and tokenizer.kind == "hf":
        _check_tokenizer_path(tokenizer.path)
    if dataset.name == "tokenized":
        check_tokenized_dataset(dataset, tokenizer)
    if tokenizer is not None and tokenizer.kind == "byte" and dataset.name == "synthetic":
        # Byte vocab is known without building anything; hf vocabularies are
        # checked when the loader is built with the real tokenizer.
        room = ByteTokenizer.vocab_size - len(ByteTokenizer().special_ids)
        if dataset.synthetic_symbols > room:
            raise ValueError(
                f"--dataset.synthetic_symbols {dataset.synthetic_symbols} exceeds the {room} "
                "non-special ids of the byte tokenizer; lower it or use --tokenizer.kind hf"
            )


def _check_tokenizer_path(path: str) -> None:
    """The tokenizer file (or a directory holding tokenizer.json) exists."""
    target = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(target):
        raise FileNotFoundError(
            f"--tokenizer.path {path!r}: no tokenizer file at {target}; fix the path, or name the model's Hub "
            "id (--tokenizer.path org/name) to read its tokenizer from the Hugging Face Hub"
        )


__all__ = ["build_dataloader", "validate_data_config"]
