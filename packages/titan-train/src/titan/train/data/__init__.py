"""titan.train.data: tokenizers, corpora, packing and the resumable loader.

The trainer needs only `TokenizerConfig.build()`, `DatasetConfig`,
`validate_data_config` and `build_dataloader` (docs/contracts.md).
"""

from titan.train.data.build import build_dataloader, validate_data_config
from titan.train.data.config import DatasetConfig
from titan.train.data.loader import (
    PackedDataLoader,
    build_packed_dataloader,
    build_source,
    synthetic_corpus,
)
from titan.train.data.packing import DocumentPacker
from titan.train.data.sft import (
    ChatTemplate,
    SFTDataConfig,
    SFTDataLoader,
    SFTExample,
    SyntheticSFTTask,
    build_sft_dataloader,
    encode_chat,
    encode_chat_prompt,
    encode_prompt,
    encode_prompt_completion,
    synthetic_eval_pairs,
    validate_sft_data_config,
)
from titan.train.data.sources import (
    DocumentSource,
    HFDatasetSource,
    StdlibSource,
    SyntheticSource,
    TextSource,
    stdlib_files,
)
from titan.train.data.synthetic import SyntheticCorpus, markov_entropy_floor_nats
from titan.train.data.tokenized import (
    TokenizedCorpus,
    build_tokenized_dataloader,
    tokenize_corpus,
)
from titan.train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig

__all__ = [
    "ByteTokenizer",
    "ChatTemplate",
    "DatasetConfig",
    "DocumentPacker",
    "DocumentSource",
    "HFDatasetSource",
    "HFTokenizer",
    "PackedDataLoader",
    "SFTDataConfig",
    "SFTDataLoader",
    "SFTExample",
    "StdlibSource",
    "SyntheticCorpus",
    "SyntheticSFTTask",
    "SyntheticSource",
    "TextSource",
    "TokenizedCorpus",
    "Tokenizer",
    "TokenizerConfig",
    "build_dataloader",
    "build_packed_dataloader",
    "build_sft_dataloader",
    "build_source",
    "build_tokenized_dataloader",
    "encode_chat",
    "encode_chat_prompt",
    "encode_prompt",
    "encode_prompt_completion",
    "markov_entropy_floor_nats",
    "stdlib_files",
    "synthetic_corpus",
    "synthetic_eval_pairs",
    "tokenize_corpus",
    "validate_data_config",
    "validate_sft_data_config",
]
