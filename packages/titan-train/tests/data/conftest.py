"""Shared fixtures for the data tests: tiny tokenizers and in-memory sources."""

from __future__ import annotations

import pytest
from titan.train.data import ByteTokenizer, TextSource


class ListSource(TextSource):
    """Documents from a Python list; counts tokenizations (to catch re-work)."""

    def __init__(self, texts, tokenizer=None):
        super().__init__(tokenizer or ByteTokenizer())
        self.texts = list(texts)
        self.calls = 0

    def __len__(self):
        return len(self.texts)

    def text(self, index):
        self.calls += 1
        return self.texts[index]


@pytest.fixture
def list_source():
    """Factory: `list_source(texts, tokenizer=None) -> ListSource`."""
    return ListSource


TRAIN_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "all that glitters is not gold",
    "the early bird catches the worm",
] * 4


@pytest.fixture
def hf_tokenizer_file(tmp_path):
    """A real tokenizer.json: a tiny byte-level BPE trained here, with <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXTS, trainer=trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path
