"""The loader's document boundaries: per-document `positions` and `document_ids`."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from titan.train.data import ByteTokenizer, DatasetConfig, DocumentPacker, build_dataloader
from titan.train.data.loader import PackedBatches, PackedDataLoader, document_layout

BOS, EOS = ByteTokenizer.bos_id, ByteTokenizer.eos_id


def _loader(source, *, batch, seq_len, rank=0, world=1):
    tok = source.tokenizer
    packer = DocumentPacker(source, bos_id=tok.bos_id, eos_id=tok.eos_id, shuffle=False, seed=0)
    return PackedDataLoader(
        PackedBatches(packer, batch, seq_len, dp_rank=rank, dp_world_size=world),
        dp_rank=rank,
        dp_world_size=world,
        num_documents=len(source),
    )


def test_layout_by_hand():
    starts = np.array([[0, 0, 1, 0, 1, 1], [1, 0, 0, 0, 0, 1]], dtype=bool)
    positions, document_ids = document_layout(starts)
    assert positions.tolist() == [[0, 1, 0, 1, 0, 0], [0, 1, 2, 3, 4, 0]]
    assert document_ids.tolist() == [[0, 0, 1, 1, 2, 3], [0, 0, 0, 0, 0, 1]]
    assert not starts[0, 0]  # the caller's marks are left alone


def test_tiny_corpus_by_hand(list_source):
    # Framed stream: [B a b E] [B c d e E] [B f E] [B a b E] ... (12 tokens an epoch);
    # windows of 6 tokens, inputs are their first 5.
    a, b, c, d, e, f = (ord(ch) for ch in "abcdef")
    loader = _loader(list_source(["ab", "cde", "", "f"]), batch=2, seq_len=5)
    first, second = next(loader), next(loader)
    assert first["input_ids"].tolist() == [[BOS, a, b, EOS, BOS], [d, e, EOS, BOS, f]]
    # Row 1 starts inside "cde": a fresh sample, positions from 0, its own id.
    assert first["positions"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert first["document_ids"].tolist() == [[0, 0, 0, 0, 1], [0, 0, 0, 1, 1]]
    assert second["input_ids"].tolist() == [[BOS, a, b, EOS, BOS], [d, e, EOS, BOS, f]]
    assert second["positions"].tolist() == first["positions"].tolist()
    for batch in (first, second):
        for key in ("positions", "document_ids"):
            t = batch[key]
            assert t.dtype == torch.long and t.shape == batch["input_ids"].shape


def test_shared_bos_eos_starts_documents_at_their_first_token(list_source):
    class Shared(ByteTokenizer):
        bos_id = 257

    loader = _loader(list_source(["ab", "c"], Shared()), batch=1, seq_len=6)
    batch = next(loader)
    assert batch["input_ids"].tolist() == [[97, 98, 257, 99, 257, 97]]
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2]]


def test_boundaries_follow_bos_on_a_real_corpus_and_ranks_agree():
    cfg = DatasetConfig(synthetic_documents=30, synthetic_mean_length=12, synthetic_symbols=50)
    tok = ByteTokenizer()

    def build(rank, world, batch):
        return build_dataloader(
            cfg, tok, dp_rank=rank, dp_world_size=world, local_batch_size=batch, seq_len=24,
            seed=1,
        )

    single = build(0, 1, 4)
    ranks = [build(r, 2, 2) for r in range(2)]
    for _ in range(5):
        whole = next(single)
        halves = [next(loader) for loader in ranks]
        for key in whole:
            assert torch.equal(whole[key], torch.cat([h[key] for h in halves])), key
        ids, pos, doc = whole["input_ids"], whole["positions"], whole["document_ids"]
        # Synthetic documents are framed BOS ... EOS: a new document exactly at each BOS.
        new_doc = ids == BOS
        new_doc[:, 0] = True
        assert torch.equal(pos == 0, new_doc)
        assert torch.equal(doc, new_doc.long().cumsum(1) - 1)
        assert torch.equal(pos[:, 1:][~new_doc[:, 1:]], pos[:, :-1][~new_doc[:, 1:]] + 1)


@pytest.mark.parametrize("n_before", [1, 3])
def test_resume_restores_the_layout_too(list_source, n_before):
    texts = ["alpha", "beta gamma", "delta epsilon zeta eta theta", "nu"]
    original = _loader(list_source(texts), batch=2, seq_len=7)
    for _ in range(n_before):
        next(original)
    buf = io.BytesIO()
    torch.save(original.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    expected = [next(original) for _ in range(3)]
    restored = _loader(list_source(texts), batch=2, seq_len=7)
    restored.load_state_dict(state)
    for want in expected:
        got = next(restored)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), key
