"""Document masking: a packed row attends like its documents run one by one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from titan.models.common.attention import (
    ScaledDotProductAttention,
    document_causal_mask,
    document_segments,
    varlen_document_attention,
)

LENGTHS = (5, 7, 4)  # three documents packed into one row of 16


def _packed_row(vocab: int, seed: int = 0):
    """Token ids [1, 16] of three documents, their per-document positions and ids."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    return docs, torch.cat(docs)[None], positions, document_ids


def test_mask_by_hand():
    ids = torch.tensor([[0, 0, 1, 1, 1]])
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(document_causal_mask(ids), expected[None, None])


def test_segments_by_hand():
    ids = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    assert document_segments(ids).tolist() == [0, 2, 4, 5, 8]


def test_packed_logits_equal_each_document_alone(make_tiny):
    model = make_tiny(seed=2)
    docs, row, positions, document_ids = _packed_row(model.args.vocab_size)
    packed = model(row, positions, document_ids)[0]
    start = 0
    for doc in docs:
        alone = model(doc[None])[0]
        torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=1e-5, rtol=1e-5)
        start += len(doc)
    # The masking is what makes them equal: without it the later documents differ.
    unmasked = model(row, positions)[0]
    assert not torch.allclose(unmasked[LENGTHS[0] :], packed[LENGTHS[0] :], atol=1e-3)


def test_masking_holds_in_every_row_and_gradients_stay_in_the_document(make_tiny):
    model = make_tiny(seed=3)
    vocab = model.args.vocab_size
    rows = [_packed_row(vocab, seed) for seed in (4, 5)]
    tokens = torch.cat([r[1] for r in rows])
    positions = torch.cat([r[2] for r in rows])
    document_ids = torch.cat([r[3] for r in rows])
    logits = model(tokens, positions, document_ids)
    for b, (docs, *_) in enumerate(rows):
        torch.testing.assert_close(logits[b, -LENGTHS[-1] :], model(docs[-1][None])[0])
    # The last document's outputs send no gradient into the earlier documents' inputs.
    h = model.tok_embeddings(tokens).detach().requires_grad_(True)
    model.tok_embeddings = None
    out = model(h, positions, document_ids)
    out[:, -LENGTHS[-1] :].sum().backward()
    assert h.grad[:, : sum(LENGTHS[:-1])].abs().max() == 0
    assert h.grad[:, -LENGTHS[-1] :].abs().max() > 0


def test_without_document_ids_stays_on_the_is_causal_path(monkeypatch, make_tiny):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("is_causal", False), kwargs.get("attn_mask") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model = make_tiny()
    model(torch.zeros(1, 8, dtype=torch.long))
    assert calls and all(c == (True, False) for c in calls)
    calls.clear()
    model(torch.zeros(1, 8, dtype=torch.long), document_ids=torch.zeros(1, 8, dtype=torch.long))
    assert calls and all(c == (False, True) for c in calls)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
    """A per-segment SDPA loop with varlen_attn's calling convention ([T, H, Dh])."""
    assert window_size == (-1, 0) and max_q == max_k
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        seg = [t[a:b].transpose(0, 1)[None] for t in (q, k, v)]
        out[a:b] = F.scaled_dot_product_attention(*seg, is_causal=True, enable_gqa=enable_gqa)[
            0
        ].transpose(0, 1)
    return out


def test_varlen_layout_equals_the_mask_path():
    # Checks the flattening, cu_seqlens and reshaping around the CUDA varlen kernel on CPU,
    # with a reference kernel standing in for FlashAttention.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 16, 8), torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    ids = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    got = varlen_document_attention(q, k, v, ids, kernel=_reference_varlen)
    torch.testing.assert_close(got, ScaledDotProductAttention()(q, k, v, document_ids=ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashAttention varlen)")
def test_varlen_kernel_on_cuda_matches_mask():
    torch.manual_seed(0)
    shape_q, shape_kv = (2, 8, 64, 64), (2, 4, 64, 64)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ids = torch.cat([torch.zeros(2, 20), torch.ones(2, 30), torch.full((2, 14), 2)], 1).cuda()
    got = ScaledDotProductAttention()(q, k, v, document_ids=ids)
    mask = document_causal_mask(ids)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
