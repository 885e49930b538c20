"""The summed cross-entropy, whole and chunked: equal values and gradients, and the chunked
form never keeps a float32 [tokens, vocab] tensor for backward."""

import pytest
import torch
from titan.train.loss import IGNORE_INDEX, cross_entropy_sum


def _inputs(dtype: torch.dtype):
    torch.manual_seed(0)
    logits = torch.randn(2, 40, 96, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 96, (2, 40))
    labels[0, :7] = IGNORE_INDEX  # a padded head: ignored positions inside a chunk
    labels[1, -30:] = IGNORE_INDEX  # a chunk with no valid label at all
    return logits, labels


def _loss_and_grad(logits, labels, chunk_tokens):
    logits.grad = None
    loss = cross_entropy_sum(logits, labels, chunk_tokens=chunk_tokens)
    loss.backward()
    return loss.detach(), logits.grad.clone()


@pytest.mark.parametrize("chunk_tokens", [1, 16, 24, 79, 80, 1000])
def test_chunked_equals_whole_with_its_gradient(chunk_tokens):
    logits, labels = _inputs(torch.float32)
    whole, whole_grad = _loss_and_grad(logits, labels, 0)
    chunked, chunked_grad = _loss_and_grad(logits, labels, chunk_tokens)
    # A sum over 80 positions regrouped into chunks: float32 reassociation only (~1e-7 relative
    # per addition); the gradient of each position does not depend on the grouping at all.
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=0, atol=0)
    # A hand computation: log-sum-exp minus the target logit, over valid positions.
    flat, target = logits.detach().flatten(0, 1).double(), labels.flatten()
    valid = target != IGNORE_INDEX
    by_hand = (flat.logsumexp(-1) - flat.gather(1, target.clamp(min=0)[:, None])[:, 0])[valid].sum()
    torch.testing.assert_close(whole.double(), by_hand, rtol=1e-6, atol=0)


def _saved_for_backward(logits, labels, chunk_tokens) -> list[tuple[tuple[int, ...], torch.dtype]]:
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cross_entropy_sum(logits, labels, chunk_tokens=chunk_tokens)
    return saved


def test_chunked_keeps_no_float32_logits_for_backward():
    logits, labels = _inputs(torch.bfloat16)
    whole = _saved_for_backward(logits, labels, 0)
    chunked = _saved_for_backward(logits, labels, 16)
    # Whole: the float32 copy / log-softmax of all 80 positions is kept for backward ...
    assert ((80, 96), torch.float32) in whole
    # ... chunked: only the bf16 chunks of the logits (views, no new memory) and their labels.
    assert all(dtype != torch.float32 for _, dtype in chunked), chunked
    assert max(shape[0] for shape, _ in chunked) == 16


def test_bf16_logits_chunked_equal_whole():
    logits, labels = _inputs(torch.bfloat16)
    whole, whole_grad = _loss_and_grad(logits, labels, 0)
    chunked, chunked_grad = _loss_and_grad(logits, labels, 16)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)  # both sum in float32
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=0, atol=0)


def test_negative_chunk_size_is_refused_by_flag_name():
    from titan.train.config import TrainingConfig

    with pytest.raises(ValueError, match="--training.loss_chunk_tokens must be >= 0"):
        TrainingConfig(loss_chunk_tokens=-1)


@pytest.mark.parametrize("chunk_tokens", [0, 24])
def test_compiled_loss_equals_eager_with_its_gradient_and_really_compiles(chunk_tokens):
    """`--compile.components loss`: the fused cross-entropy gives the eager value and gradient
    (float32 reassociation only), whole and chunked, and dynamo really captured a graph."""
    from torch._dynamo.utils import counters

    logits, labels = _inputs(torch.float32)
    eager, eager_grad = _loss_and_grad(logits, labels, chunk_tokens)
    counters.clear()
    logits.grad = None
    compiled = cross_entropy_sum(logits, labels, chunk_tokens=chunk_tokens, compiled=True)
    compiled.backward()
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    assert compiled.detach() == pytest.approx(eager.item(), rel=1e-6)
    torch.testing.assert_close(logits.grad, eager_grad, rtol=1e-5, atol=1e-7)


def test_dft_weighs_each_tokens_nll_by_its_detached_probability_by_hand():
    """DFT's value is sum_t p_t (-log p_t) over valid labels, and its gradient w.r.t. the logits
    is p_t times NLL's (the weight is detached): checked against a hand computation, whole,
    chunked and compiled; an unknown loss type names the flag."""
    logits, labels = _inputs(torch.float32)
    flat, target = logits.detach().flatten(0, 1).double(), labels.flatten()
    valid = target != IGNORE_INDEX
    nll = flat.logsumexp(-1) - flat.gather(1, target.clamp(min=0)[:, None])[:, 0]
    prob = torch.exp(-nll)
    loss = cross_entropy_sum(logits, labels, loss_type="dft")
    torch.testing.assert_close(loss.double(), (prob * nll)[valid].sum(), rtol=1e-6, atol=0)
    loss.backward()
    dft_grad = logits.grad.clone()
    logits.grad = None
    cross_entropy_sum(logits, labels).backward()
    weights = torch.where(valid, prob, 0.0).float().view(2, 40, 1)
    torch.testing.assert_close(dft_grad, logits.grad * weights, rtol=1e-5, atol=1e-8)
    for chunk_tokens, compiled in ((24, False), (0, True), (24, True)):
        logits.grad = None
        other = cross_entropy_sum(logits, labels, loss_type="dft", chunk_tokens=chunk_tokens, compiled=compiled)
        other.backward()
        assert other.item() == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(logits.grad, dft_grad, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="--training.loss_type must be one of nll, dft"):
        cross_entropy_sum(logits, labels, loss_type="focal")
