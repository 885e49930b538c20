"""The synthetic corpus and its entropy floor."""

from __future__ import annotations

import math

import numpy as np
import pytest
from titan.train.data import (
    ByteTokenizer,
    DatasetConfig,
    build_dataloader,
    markov_entropy_floor_nats,
    synthetic_corpus,
)


class SharedSeparatorTokenizer(ByteTokenizer):
    """Byte tokenizer whose BOS is its EOS (like tokenizers without a BOS)."""

    bos_id = 257


def _floor_by_summation(n, k, m, bos_separator=True, max_len=20_000):
    """The floor from the definition: sum over the geometric length law of
    each document's exact cost, divided by the expected predictions."""
    p = 1.0 / m
    lengths = np.arange(1, max_len + 1)
    prob = p * (1 - p) ** (lengths - 1)
    step = 0.0 if p == 1 else math.log(k) - math.log(1 - p)  # m == 1: never continues
    cost = math.log(n) + (lengths - 1) * step - math.log(p)
    predictions = lengths + (2 if bos_separator else 1)
    return float((prob * cost).sum() / (prob * predictions).sum())


@pytest.mark.parametrize("n,k,m", [(256, 4, 256), (16, 1, 5), (40, 40, 2), (8, 3, 1)])
def test_floor_formula_matches_definition(n, k, m):
    for bos_separator in (True, False):
        expected = _floor_by_summation(n, k, m, bos_separator)
        got = markov_entropy_floor_nats(n, k, m, bos_separator=bos_separator)
        assert got == pytest.approx(expected, rel=1e-9)


def test_floor_tends_to_markov_entropy_for_long_documents():
    assert markov_entropy_floor_nats(64, 5, 10**7) == pytest.approx(math.log(5), rel=1e-5)


def test_documents_follow_the_successor_table():
    corpus = synthetic_corpus(
        DatasetConfig(synthetic_symbols=20, synthetic_successors=3), ByteTokenizer()
    )
    table = corpus.successor_table
    assert table.shape == (20, 3)
    assert all(len(set(row)) == 3 for row in table.tolist())
    for i in range(50):
        walk = corpus.symbols(i)
        assert len(walk) >= 1
        for a, b in zip(walk[:-1], walk[1:], strict=True):
            assert b in table[a]
    # Random access is deterministic and order independent.
    np.testing.assert_array_equal(corpus.tokens(7), corpus.tokens(7))


def test_mean_length_matches_config():
    cfg = DatasetConfig(synthetic_documents=4000, synthetic_mean_length=12)
    corpus = synthetic_corpus(cfg, ByteTokenizer())
    lengths = [len(corpus.symbols(i)) for i in range(len(corpus))]
    assert np.mean(lengths) == pytest.approx(12, rel=0.05)


def _empirical_loss(loader, corpus, tokenizer, batches):
    """Mean oracle cross-entropy over what the loader yields (the exact
    conditional probabilities of the generator act as the model)."""
    total, count = 0.0, 0
    for _ in range(batches):
        batch = next(loader)
        for prev, nxt in zip(
            batch["input_ids"].flatten().tolist(), batch["labels"].flatten().tolist(), strict=True
        ):
            logp = corpus.next_token_logprob(
                prev, nxt, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id
            )
            assert math.isfinite(logp), (prev, nxt)
            total -= logp
            count += 1
    return total / count


@pytest.mark.parametrize(
    "tokenizer", [ByteTokenizer(), SharedSeparatorTokenizer()], ids=["bos", "shared"]
)
def test_floor_matches_oracle_on_loader_output(tokenizer):
    cfg = DatasetConfig(
        synthetic_symbols=32,
        synthetic_successors=3,
        synthetic_mean_length=16,
        synthetic_documents=5000,
    )
    loader = build_dataloader(
        cfg, tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=8, seq_len=64, seed=0
    )
    corpus = synthetic_corpus(cfg, tokenizer)
    empirical = _empirical_loss(loader, corpus, tokenizer, batches=80)  # ~41k predictions
    floor = corpus.entropy_floor_nats(bos_separator=tokenizer.bos_id != tokenizer.eos_id)
    assert empirical == pytest.approx(floor, rel=0.015)


def test_symbols_avoid_special_ids():
    tok = ByteTokenizer()
    corpus = synthetic_corpus(DatasetConfig(synthetic_symbols=256, synthetic_successors=2), tok)
    assert not set(corpus.symbol_ids.tolist()) & tok.special_ids


def test_too_many_symbols_for_vocab():
    with pytest.raises(ValueError, match="--dataset.synthetic_symbols 300"):
        synthetic_corpus(DatasetConfig(synthetic_symbols=300), ByteTokenizer())
