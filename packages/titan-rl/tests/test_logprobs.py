"""Token log-probs and entropy in chunks of positions (``--training.loss_chunk_tokens``):
equal to the one-piece values and gradients, checked by hand, and without float32
``[tokens, vocab]`` tensors kept for backward."""

from __future__ import annotations

import pytest
import torch
from titan.rl.logprobs import token_entropy, token_logprobs

B, S, V, CHUNK = 3, 27, 50, 16  # 81 positions: chunks of 16 with a ragged last one


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, S, V, generator=g) * 3).to(dtype)
    targets = torch.randint(0, V, (B, S), generator=g)
    return logits, targets


def _value_and_grad(fn, logits, chunk):
    leaf = logits.clone().requires_grad_()
    value = fn(leaf, chunk)
    weights = torch.linspace(-1, 1, value.numel()).view(value.shape)  # every position's gradient differs
    (value * weights).sum().backward()
    return value.detach(), leaf.grad


LOGPROBS = lambda logits, chunk: token_logprobs(logits, _inputs()[1], 0.7, chunk_tokens=chunk)  # noqa: E731
ENTROPY = lambda logits, chunk: token_entropy(logits, 0.7, chunk_tokens=chunk)  # noqa: E731


@pytest.mark.parametrize("fn", [LOGPROBS, ENTROPY], ids=["logprobs", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_equals_one_piece_values_and_gradients(fn, dtype):
    """Row-wise computations: a position's value and gradient do not depend on which chunk
    it is computed in, so they are equal bit for bit."""
    logits, _ = _inputs(dtype)
    whole, whole_grad = _value_and_grad(fn, logits, 0)
    chunked, chunked_grad = _value_and_grad(fn, logits, CHUNK)
    assert whole.shape == chunked.shape == (B, S) and whole.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=0, atol=0)


def test_values_by_hand():
    logits, targets = _inputs()
    scaled = logits.double() / 0.7
    logp = scaled - scaled.logsumexp(-1, keepdim=True)
    by_hand = logp.gather(-1, targets[..., None])[..., 0]
    entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(token_logprobs(logits, targets, 0.7, chunk_tokens=CHUNK).double(), by_hand,
                               rtol=1e-5, atol=1e-5)  # float32 softmax of values ~|10|: a few ulp of 10
    torch.testing.assert_close(token_entropy(logits, 0.7, chunk_tokens=CHUNK).double(), entropy, rtol=1e-5, atol=1e-5)


def _saved(fn, chunk):
    logits, _ = _inputs(torch.bfloat16)
    leaf = logits.clone().requires_grad_()
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(leaf, chunk)
    return saved


@pytest.mark.parametrize("fn", [LOGPROBS, ENTROPY], ids=["logprobs", "entropy"])
def test_chunked_keeps_no_float32_vocabulary_tensor_for_backward(fn):
    whole, chunked = _saved(fn, 0), _saved(fn, CHUNK)
    assert any(dtype == torch.float32 and shape[-1] == V for shape, dtype in whole), whole  # what chunking avoids
    assert not any(dtype == torch.float32 and len(shape) > 1 and shape[-1] == V for shape, dtype in chunked), chunked
    assert max(shape[0] for shape, _ in chunked if shape) <= CHUNK


def test_without_gradients_chunks_are_not_checkpointed():
    logits, targets = _inputs()
    with torch.no_grad():
        chunked = token_logprobs(logits, targets, chunk_tokens=CHUNK)
    torch.testing.assert_close(chunked, token_logprobs(logits, targets), rtol=0, atol=0)
