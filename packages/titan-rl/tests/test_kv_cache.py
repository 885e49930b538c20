"""KV-cache inference through the training modules equals the full-sequence forward."""

from __future__ import annotations

import pytest
import torch
from titan.models.common.kv_cache import KVCache
from titan.models.llama3 import build_llama3

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_llama3("debugmodel_tiny", vocab_size=VOCAB, max_seq_len=64)  # 4 heads, 2 kv heads
    m.init_weights(seed=1)
    return m.eval()


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        valid[row, width - len(p):] = True
    return ids, valid


def build_family(family: str):
    """A tiny model of each titan family (Qwen3: QK norm, decoupled head_dim; MoE FFNs)."""
    if family == "llama3":
        from titan.models.llama3 import build_llama3 as build
    elif family == "qwen3":
        from titan.models.qwen3 import build_qwen3 as build
    elif family == "deepseek_v3":  # MLA: the cache holds latents, not per-head K/V
        from titan.models.deepseek_v3 import build_deepseek_v3 as build
    else:
        from titan.models.qwen3_moe import build_qwen3_moe as build
    m = build("debugmodel_tiny", vocab_size=VOCAB, max_seq_len=64)
    m.init_weights(seed=1)
    return m.eval()


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
@torch.no_grad()
def test_prefill_and_decode_equal_full_forward(family):
    """Left-padded batched prefill of prompts of different lengths, then decode one token at a
    time: every real position's logits equal those of the prompt's own full forward."""
    model = build_family(family)
    g = torch.Generator().manual_seed(5)
    lengths, new = (5, 11, 1, 8), 7
    seqs = [torch.randint(0, VOCAB, (n + new,), generator=g) for n in lengths]
    refs = [model(s[None])[0] for s in seqs]  # the trainer's path, one row each
    prompts = [s[:n] for s, n in zip(seqs, lengths, strict=True)]
    ids, valid = left_pad(prompts)
    width = ids.shape[1]
    cache = KVCache.for_model(model, batch_size=len(seqs), max_len=width + new)
    cache.mark_valid(valid)
    out = model(ids, kv_cache=cache)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(out[row, width - n:], refs[row][:n], rtol=0, atol=1e-5)
    for step in range(new):
        token = torch.stack([s[n + step] for s, n in zip(seqs, lengths, strict=True)])[:, None]
        out = model(token, kv_cache=cache)
        assert out.shape == (len(seqs), 1, VOCAB)
        for row, n in enumerate(lengths):
            torch.testing.assert_close(out[row, 0], refs[row][n + step], rtol=0, atol=1e-5)
    assert cache.length == width + new
    assert cache.next_position.tolist() == [n + new for n in lengths]


@torch.no_grad()
def test_padding_is_not_attended(model):
    """Changing the padding tokens changes nothing; dropping the mask would (the check can
    fail)."""
    prompts = [torch.tensor([3, 4, 5]), torch.tensor([7, 8, 9, 10, 11, 12])]
    ids, valid = left_pad(prompts)
    outs = []
    for pad in (0, 99):
        cache = KVCache.for_model(model, batch_size=2, max_len=ids.shape[1])
        cache.mark_valid(valid)
        outs.append(model(ids.masked_fill(~valid, pad), kv_cache=cache)[0, -1])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    cache = KVCache.for_model(model, batch_size=2, max_len=ids.shape[1])  # no padding mask
    unmasked = model(ids, kv_cache=cache)[0, -1]
    assert (unmasked - outs[0]).abs().max() > 1e-3


@torch.no_grad()
def test_repeated_cache_decodes_like_the_original(model):
    """A prompt prefilled once and copied for a group decodes like separate prefills."""
    prompt = torch.tensor([[1, 2, 3, 4]])
    cache = KVCache.for_model(model, batch_size=1, max_len=6)
    model(prompt, kv_cache=cache)
    group = cache.repeat_interleave(3)
    out = model(torch.tensor([[5], [6], [7]]), kv_cache=group)
    for row, token in enumerate((5, 6, 7)):
        ref = model(torch.tensor([[1, 2, 3, 4, token]]))[0, -1]
        torch.testing.assert_close(out[row, 0], ref, rtol=0, atol=1e-5)


def test_cache_overflow_and_document_ids_are_rejected(model):
    cache = KVCache.for_model(model, batch_size=1, max_len=2)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache)
    cache = KVCache.for_model(model, batch_size=1, max_len=4)
    with pytest.raises(ValueError, match="document_ids"):
        model(torch.tensor([[1, 2]]), document_ids=torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cached_decode_on_cuda_matches_cpu_full_forward(model):
    import copy

    cuda = copy.deepcopy(model).cuda()
    seqs = [torch.randint(0, VOCAB, (n + 4,), generator=torch.Generator().manual_seed(n)) for n in (3, 9)]
    ids, valid = left_pad([s[:-4] for s in seqs])
    cache = KVCache.for_model(cuda, batch_size=2, max_len=ids.shape[1] + 4)
    cache.mark_valid(valid.cuda())
    cuda(ids.cuda(), kv_cache=cache)
    for step in range(4):
        token = torch.stack([s[len(s) - 4 + step] for s in seqs])[:, None].cuda()
        out = cuda(token, kv_cache=cache).cpu()
        for row, s in enumerate(seqs):
            ref = model(s[None])[0, len(s) - 4 + step]
            torch.testing.assert_close(out[row, 0], ref, rtol=1e-4, atol=1e-4)
