"""titan.train.data: tokenizers, corpora, packing and the resumable loader.

The trainer needs only `TokenizerConfig.build()`, `DatasetConfig`,
`validate_data_config` and `build_dataloader` (docs/contracts.md).

Names are imported from their modules on first use (PEP 562), so that importing one piece
(the tokenizer, say) does not import every loader.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "build_dataloader": "build",
    "build_packed_dataloader": "loader",
    "build_sft_dataloader": "sft",
    "build_source": "loader",
    "build_tokenized_dataloader": "tokenized",
    "ByteTokenizer": "tokenizer",
    "ChatTemplate": "chat",
    "DatasetConfig": "config",
    "DocumentPacker": "packing",
    "DocumentSource": "sources",
    "encode_chat": "chat",
    "encode_chat_prompt": "chat",
    "encode_prompt": "chat",
    "encode_prompt_completion": "chat",
    "HFDatasetSource": "sources",
    "HFTokenizer": "tokenizer",
    "markov_entropy_floor_nats": "synthetic",
    "PackedDataLoader": "loader",
    "ShardedStream": "streaming",
    "SFTDataConfig": "sft_config",
    "SFTDataLoader": "sft",
    "SFTExample": "chat",
    "stdlib_files": "sources",
    "StdlibSource": "sources",
    "StreamingDataLoader": "loader",
    "StreamPacker": "streaming",
    "synthetic_corpus": "loader",
    "synthetic_eval_pairs": "sft_sources",
    "SyntheticCorpus": "synthetic",
    "SyntheticSFTTask": "sft_sources",
    "SyntheticTaskConfig": "sft_config",
    "SyntheticSource": "sources",
    "TextSource": "sources",
    "tokenize_corpus": "corpus_writer",
    "TokenizedCorpus": "tokenized",
    "Tokenizer": "tokenizer",
    "TokenizerConfig": "tokenizer",
    "validate_data_config": "build",
    "validate_sft_data_config": "sft_config",
}
"""Public name -> the module of this package that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import ``name`` from its module the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
