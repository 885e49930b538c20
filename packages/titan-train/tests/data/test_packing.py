"""Packing: separators, window shapes, label shift, skip == fill, one global order, linear cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from titan.train.data import ByteTokenizer, DocumentPacker
from titan.train.data.loader import PackedBatches, PackedDataLoader

TEXTS = ["alpha", "", "beta gamma", "δέλτα", "epsilon zeta eta theta iota kappa lambda mu", "nu"]


def _packer(source, *, shuffle=False, seed=0):
    tok = source.tokenizer
    return DocumentPacker(source, bos_id=tok.bos_id, eos_id=tok.eos_id, shuffle=shuffle, seed=seed)


def _loader(source, *, batch=2, seq_len=7, shuffle=False, rank=0, world=1, seed=0):
    """The loader as `build_dataloader` wires it: one packer over the whole corpus per rank."""
    packer = _packer(source, shuffle=shuffle, seed=seed)
    return PackedDataLoader(
        PackedBatches(packer, batch, seq_len, dp_rank=rank, dp_world_size=world),
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


@pytest.mark.parametrize("shuffle", [False, True])
def test_skip_advances_like_fill(list_source, shuffle):
    source = list_source(TEXTS)
    filled, skipped = (_packer(source, shuffle=shuffle, seed=1) for _ in range(2))
    whole = np.empty(200, dtype=np.int64)  # several epochs of the tiny corpus
    filled.fill(whole)
    skipped.skip(17)
    head = np.empty(23, dtype=np.int64)
    skipped.fill(head)
    np.testing.assert_array_equal(head, whole[17:40])
    skipped.skip(111)  # across epoch boundaries
    tail = np.empty(49, dtype=np.int64)
    skipped.fill(tail)
    np.testing.assert_array_equal(tail, whole[151:])
    assert skipped.state_dict() == filled.state_dict()


def test_all_empty_documents_raise(list_source):
    with pytest.raises(ValueError, match="every document"):
        next(_loader(list_source(["", ""])))


def test_empty_corpus_raises(list_source):
    with pytest.raises(ValueError, match="the dataset has no documents"):
        _packer(list_source([]))


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranks_split_one_global_stream(list_source, shuffle):
    """Every rank reads the same (seeded) order; fetch k's rows of ranks 0..world-1, stacked,
    are the next world x B windows of the single-process stream, and after each fetch every
    rank's packer stands at the same position."""
    texts = [f"<doc {i:03d}>" for i in range(23)]
    world, batch, seq_len, fetches = 3, 2, 10, 9
    single = _stream(
        _loader(list_source(texts), shuffle=shuffle, seed=5, batch=world * batch, seq_len=seq_len),
        fetches,
    )
    ranks = [
        _loader(
            list_source(texts),
            rank=r,
            world=world,
            shuffle=shuffle,
            seed=5,
            batch=batch,
            seq_len=seq_len,
        )
        for r in range(world)
    ]
    stacked = []
    for _ in range(fetches):
        for loader in ranks:
            stacked += _stream(loader, 1)
        assert len({str(loader.packer.state_dict()) for loader in ranks}) == 1
    assert stacked == single


def test_shuffle_reorders_each_epoch(list_source):
    texts = [f"{i:02d}" for i in range(20)]
    stream = _stream(_loader(list_source(texts), shuffle=True, batch=1, seq_len=79), 2)
    epochs = [ByteTokenizer().decode(stream[i * 80 : (i + 1) * 80]) for i in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]


def test_shuffle_is_determined_by_seed_and_epoch(list_source):
    """The order of each epoch is a function of (seed, epoch) only: the same seed replays it,
    another seed changes it, and a packer placed at an epoch start (as a resume does)
    continues with that epoch's order."""
    texts = [f"{i:02d}" for i in range(20)]  # 4 tokens a document: an epoch is 80 tokens

    def tokens(packer, n):
        out = np.empty(n, dtype=np.int64)
        packer.fill(out)
        return out

    three_epochs = tokens(_packer(list_source(texts), shuffle=True, seed=7), 240)
    np.testing.assert_array_equal(
        tokens(_packer(list_source(texts), shuffle=True, seed=7), 240), three_epochs
    )
    assert not np.array_equal(
        tokens(_packer(list_source(texts), shuffle=True, seed=8), 240), three_epochs
    )
    resumed = _packer(list_source(texts), shuffle=True, seed=0)
    resumed.load_state_dict({"epoch": 2, "cursor": 0, "offset": 0, "seed": 7})  # saved seed wins
    np.testing.assert_array_equal(tokens(resumed, 80), three_epochs[160:])
