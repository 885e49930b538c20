"""CP attention on one process: each rank's chunks over the gathered keys equal the matching
rows of single-device causal attention (outputs and gradients), with and without document
masks and under GQA, and a rank computes only the keys its chunks can see."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from titan.dist.context_parallel import attend_local_chunks, shard_sequence, visible_keys
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

B, H, H_KV, S, DH = 2, 4, 2, 32, 8


def _inputs(seed: int = 0, *, mla: bool = False):
    """Query, key and value heads of GQA (2 query heads per K/V head), or MLA's shapes (a K/V
    head per query head, values narrower than keys)."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, v_dim = (H, DH // 2) if mla else (H_KV, DH)
    q = torch.randn(B, H, S, DH, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, kv_heads, S, DH, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, kv_heads, S, v_dim, generator=g, dtype=torch.float64, requires_grad=True)
    return q, k, v


def _documents() -> torch.Tensor:
    """Two rows of packed documents with boundaries inside and across the CP chunks."""
    return torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 20 + [1] * 12])


def _reference(q, k, v, document_ids=None):
    """Single-device causal attention (and within documents), the mask written out whole."""
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    if document_ids is not None:
        mask = (mask[None] & (document_ids[:, :, None] == document_ids[:, None, :])).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_every_rank_equals_its_rows_of_single_device_attention(cp_size, documents, mla):
    q, k, v = _inputs(mla=mla)
    document_ids = _documents() if documents else None
    expected = _reference(q, k, v, document_ids)
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp_size):
        local_q = shard_sequence(q, rank, cp_size, seq_dim=2)
        local_ids = shard_sequence(document_ids, rank, cp_size) if documents else None
        out = attend_local_chunks(local_q, k, v, rank, cp_size, document_ids=local_ids, key_document_ids=document_ids)
        local_expected = shard_sequence(expected, rank, cp_size, seq_dim=2)
        torch.testing.assert_close(out, local_expected, rtol=1e-12, atol=1e-12)
        # The sum over ranks of each rank's gradient is the single-device gradient (for K/V
        # what the all-gather's backward reduce-scatters).
        rank_grads = torch.autograd.grad(out, (q, k, v), shard_sequence(grad_out, rank, cp_size, seq_dim=2))
        grads = [a + b for a, b in zip(grads, rank_grads, strict=True)]
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


class SDPACalls(TorchFunctionMode):
    """Records the query and key lengths of every `scaled_dot_product_attention` call."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.shapes.append((args[0].shape[2], args[1].shape[2]))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("cp_size", [2, 4])
def test_a_rank_attends_only_to_the_keys_its_chunks_see(cp_size):
    """Each chunk of queries meets only its visible prefix of keys: (2 cp + 1) chunks of keys
    per rank in all, the same on every rank, not the 4 cp a mask over all the keys costs."""
    q, k, v = _inputs()
    chunk = S // (2 * cp_size)
    for rank in range(cp_size):
        local_q = shard_sequence(q, rank, cp_size, seq_dim=2).detach()
        with SDPACalls() as calls:
            attend_local_chunks(local_q, k.detach(), v.detach(), rank, cp_size)
        head, tail = rank, 2 * cp_size - 1 - rank
        assert calls.shapes == [(chunk, (head + 1) * chunk), (chunk, (tail + 1) * chunk)]
        assert visible_keys(head, chunk) + visible_keys(tail, chunk) == (2 * cp_size + 1) * chunk


def test_the_lower_right_mask_is_built_inside_a_dispatch_mode():
    """Selective AC's policy and the memory tracker run the forward under a dispatch mode, where
    the mask's tensor subclass cannot be created directly."""
    q, k, v = _inputs()
    local_q = shard_sequence(q, 1, 2, seq_dim=2)
    with FlopCounterMode(display=False):
        out = attend_local_chunks(local_q, k, v, 1, 2)
    torch.testing.assert_close(out, shard_sequence(_reference(q, k, v), 1, 2, seq_dim=2), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused kernels' lower-right mask)")
def test_cuda_chunks_match_the_mask_and_never_build_it():
    """On CUDA in bf16 the fused kernels take the lower-right mask: the output matches the
    whole-row boolean mask's, and the forward + backward peak stays below the [S / cp, S]
    mask the old form built (as a bf16 bias, what the memory-efficient kernel reads)."""
    seq, cp_size, heads, kv_heads, dh = 8192, 4, 8, 2, 64
    g = torch.Generator(device="cpu").manual_seed(0)
    q_all = torch.randn(1, heads, seq, dh, generator=g).cuda().bfloat16()
    k = torch.randn(1, kv_heads, seq, dh, generator=g).cuda().bfloat16().requires_grad_()
    v = torch.randn(1, kv_heads, seq, dh, generator=g).cuda().bfloat16().requires_grad_()
    rank = 1
    q = shard_sequence(q_all, rank, cp_size, seq_dim=2).requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attend_local_chunks(q, k, v, rank, cp_size)
    out.float().sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    mask_bytes = (seq // cp_size) * seq * 2
    assert peak < mask_bytes, (peak, mask_bytes)
    from titan.dist.context_parallel import shard_positions

    positions = shard_positions(seq, rank, cp_size, q.device)
    mask = positions[:, None] >= torch.arange(seq, device=q.device)[None, :]
    with torch.no_grad():
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(out.detach().float(), expected.float(), atol=2e-2, rtol=2e-2)


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, enable_gqa):
    """FlashAttention varlen's contract written out: segment i's queries over its keys, causal
    from the lower right (a query sees every key up to its own position counted from the end)."""
    assert window_size == (-1, 0)
    outs = []
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert 0 < qe - qs <= max_q and qe - qs <= ke - ks <= max_k  # no empty segment, keys end with queries
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(diagonal=(ke - ks) - (qe - qs))
        out = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                             v[ks:ke].transpose(0, 1), attn_mask=mask, enable_gqa=enable_gqa)
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("documents", [
    [[0] * 5 + [1] * 14 + [2] * 13, [0] * 20 + [1] * 12],
    [[0] * 8 + [1] * 8 + [2] * 16, [0] * 32],
    [list(range(32)), [5] * 3 + [6] * 29],
], ids=["inside_chunks", "at_chunk_bounds", "short_documents"])
@pytest.mark.parametrize("mla", [False, True], ids=["gqa", "mla"])
def test_varlen_chunks_equal_single_device_document_attention(cp_size, documents, mla):
    """CP's varlen path (CUDA in half precision: no mask built, each document's run of queries
    its own sequence over its document's keys) against single-device attention with the whole
    document mask, outputs and gradients, every rank and chunk, through a reference kernel
    with FlashAttention varlen's contract. Documents start inside chunks, exactly at their
    bounds, span several, or are one token long."""
    from titan.dist.context_parallel import chunk_ids, varlen_chunk_attention

    q, k, v = _inputs(seed=3, mla=mla)
    docs = torch.tensor(documents)
    expected = _reference(q, k, v, docs)
    grads = torch.autograd.grad(expected.sum(), (q, k, v))
    chunk = S // (2 * cp_size)
    for rank in range(cp_size):
        for index in chunk_ids(rank, cp_size):
            rows = slice(index * chunk, (index + 1) * chunk)
            out = varlen_chunk_attention(q[:, :, rows], k, v, index * chunk, docs[:, rows], docs,
                                         kernel=_reference_varlen)
            torch.testing.assert_close(out, expected[:, :, rows], rtol=1e-12, atol=1e-12)
    # Gradients: the chunks of every rank together cover every query once.
    outs = [varlen_chunk_attention(q[:, :, i * chunk:(i + 1) * chunk], k, v, i * chunk,
                                   docs[:, i * chunk:(i + 1) * chunk], docs, kernel=_reference_varlen)
            for i in range(2 * cp_size)]
    for got, want in zip(torch.autograd.grad(torch.cat(outs, dim=2).sum(), (q, k, v)), grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_attend_local_chunks_takes_the_varlen_path_where_the_kernel_runs(monkeypatch):
    """The dispatch: where `uses_varlen_chunks` (CUDA, half precision, the kernel shipped) the
    document chunks go through the varlen kernel, never through a boolean mask."""
    import titan.dist.context_parallel as cp_module

    q, k, v = _inputs(seed=4)
    docs = torch.tensor([[0] * 5 + [1] * 14 + [2] * 13, [0] * 20 + [1] * 12])
    calls = []

    def kernel(*args, **kwargs):
        calls.append(args[3])
        return _reference_varlen(*args, **kwargs)

    monkeypatch.setattr(cp_module, "uses_varlen_chunks", lambda q: True)
    monkeypatch.setattr(cp_module, "_varlen_kernel", lambda: kernel)
    local_q = shard_sequence(q, 1, 2, seq_dim=2)
    out = attend_local_chunks(local_q, k, v, 1, 2, document_ids=shard_sequence(docs, 1, 2, seq_dim=1),
                              key_document_ids=docs)
    assert len(calls) == 2  # both chunks
    torch.testing.assert_close(out, shard_sequence(_reference(q, k, v, docs), 1, 2, seq_dim=2), rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlashAttention varlen)")
def test_cuda_varlen_chunks_match_the_document_mask():
    """The real kernel keeps the contract the reference above writes out (queries shorter
    than their keys aligned to the lower right): every chunk of a 4-rank CP split in bf16
    against SDPA with the whole document mask."""
    from titan.dist.context_parallel import _varlen_kernel, chunk_ids, varlen_chunk_attention

    if _varlen_kernel() is None:
        pytest.skip("this torch has no varlen_attn with window_size / enable_gqa")
    seq, cp_size, heads, kv_heads, dh = 2048, 4, 8, 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, seq, dh, generator=g).cuda().bfloat16() for n in (heads, kv_heads, kv_heads))
    lengths = [[700, 100, 1, 1247], [2048]]
    docs = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths]).cuda()
    mask = (torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()[None]
            & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    chunk = seq // (2 * cp_size)
    for rank in range(cp_size):
        for index in chunk_ids(rank, cp_size):
            rows = slice(index * chunk, (index + 1) * chunk)
            out = varlen_chunk_attention(q[:, :, rows], k, v, index * chunk, docs[:, rows], docs)
            torch.testing.assert_close(out.float(), expected[:, :, rows].float(), atol=2e-2, rtol=2e-2)
