"""Packing: separators, window shapes, label shift, sharding, linear cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from titan.train.data import ByteTokenizer, DocumentPacker, shard_documents
from titan.train.data.loader import PackedDataLoader, _PackedBatches

TEXTS = ["alpha", "", "beta gamma", "δέλτα", "epsilon zeta eta theta iota kappa lambda mu", "nu"]


def _loader(source, *, batch=2, seq_len=7, shuffle=False, rank=0, world=1, seed=0):
    tok = source.tokenizer
    packer = DocumentPacker(
        source,
        shard_documents(len(source), rank, world),
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
    )
    return PackedDataLoader(
        _PackedBatches(packer, batch, seq_len),
        dp_rank=rank,
        dp_world_size=world,
        num_documents=len(source),
    )


def _stream(loader, batches):
    """Concatenate the yielded windows back into the token stream."""
    out = []
    for _ in range(batches):
        b = next(loader)
        for inp, lab in zip(b["input_ids"].tolist(), b["labels"].tolist(), strict=True):
            out.extend(inp + lab[-1:])
    return out


def test_windows_round_trip_documents_with_separators(list_source):
    tok = ByteTokenizer()
    loader = _loader(list_source(TEXTS))
    expected = []
    while len(expected) < 10 * 2 * 8:  # several epochs' worth of the tiny corpus
        for text in TEXTS:
            if text:  # empty documents are skipped, not framed
                expected += tok.encode(text, bos=True, eos=True)
    got = _stream(loader, 10)
    assert got == expected[: len(got)]


def test_shapes_dtypes_and_label_shift(list_source):
    batch = next(_loader(list_source(TEXTS), batch=3, seq_len=5))
    x, y = batch["input_ids"], batch["labels"]
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert x.is_contiguous() and y.is_contiguous()
    assert (y != -100).all()  # packing leaves no padding


def test_shared_bos_eos_is_not_doubled(list_source):
    class Shared(ByteTokenizer):
        bos_id = 257

    tok = Shared()
    got = _stream(_loader(list_source(["ab", "c"], tok), batch=1, seq_len=6), 1)
    assert got == [97, 98, 257, 99, 257, 97, 98]


def test_each_document_tokenized_once_per_epoch(list_source):
    # A document far longer than a window must not be re-tokenized per window
    # (that would make packing quadratic in document length).
    source = list_source(["x" * 50_000, "y"])
    loader = _loader(source, batch=4, seq_len=63)
    total = _stream(loader, 200)  # 51,200 tokens: just over one epoch
    assert len(total) == 200 * 4 * 64
    assert source.calls == 3  # doc 0, doc 1, then doc 0 of epoch 1


def test_skip_advances_like_fill(list_source):
    source = list_source(TEXTS)

    def make():
        return DocumentPacker(source, np.arange(len(source)), bos_id=source.tokenizer.bos_id,
                              eos_id=source.tokenizer.eos_id, shuffle=True, seed=1)

    filled, skipped = make(), make()
    whole = np.empty(40, dtype=np.int64)
    filled.fill(whole)
    skipped.skip(17)
    rest = np.empty(23, dtype=np.int64)
    skipped.fill(rest)
    np.testing.assert_array_equal(rest, whole[17:])
    assert skipped.state_dict() == filled.state_dict()


def test_all_empty_documents_raise(list_source):
    with pytest.raises(ValueError, match="every document"):
        next(_loader(list_source(["", ""])))


def test_shards_are_disjoint_and_cover_the_corpus(list_source):
    texts = [f"<doc {i:03d}>" for i in range(23)]
    seen = []
    for rank in range(3):
        loader = _loader(
            list_source(texts), rank=rank, world=3, shuffle=True, seed=5, batch=1, seq_len=10
        )
        n_docs = len(shard_documents(23, rank, 3))
        stream = _stream(loader, n_docs)  # each doc is 11 tokens: one window == one doc
        docs = ByteTokenizer().decode(stream).split(">")[:-1]
        assert len(docs) == n_docs == len(set(docs))
        seen.append(set(docs))
    assert not (seen[0] & seen[1]) and not (seen[0] & seen[2]) and not (seen[1] & seen[2])
    assert len(seen[0] | seen[1] | seen[2]) == 23


def test_shuffle_reorders_each_epoch(list_source):
    texts = [f"{i:02d}" for i in range(20)]
    stream = _stream(_loader(list_source(texts), shuffle=True, batch=1, seq_len=79), 2)
    epochs = [ByteTokenizer().decode(stream[i * 80 : (i + 1) * 80]) for i in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]


def test_more_ranks_than_documents():
    with pytest.raises(ValueError, match="fewer than the 4 data parallel ranks"):
        shard_documents(3, 3, 4)


def test_shard_indices():
    np.testing.assert_array_equal(shard_documents(10, 1, 4), [1, 5, 9])
