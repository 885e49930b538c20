"""`clip_grad_norm_` edge cases: `max_norm <= 0` disables clipping but still reports the norm."""

import pytest
import torch
from titan.dist import clip_grad_norm_


def _params_with_grads() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p) * 10  # a norm far above any max_norm used below
    return params


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
@pytest.mark.parametrize("foreach", [None, False])
def test_non_positive_max_norm_leaves_gradients_untouched(max_norm, foreach):
    params = _params_with_grads()
    before = [p.grad.clone() for p in params]
    # Hand-computed: the 2-norm of all gradients as one vector.
    expected = torch.cat([g.flatten() for g in before]).norm()
    norm = clip_grad_norm_(params, max_norm, foreach=foreach)
    torch.testing.assert_close(norm, expected)
    for p, g in zip(params, before, strict=True):
        assert torch.equal(p.grad, g)


def test_positive_max_norm_still_clips():
    params = _params_with_grads()
    before = torch.cat([p.grad.flatten() for p in params]).norm()
    norm = clip_grad_norm_(params, 1.0)
    after = torch.cat([p.grad.flatten() for p in params]).norm()
    torch.testing.assert_close(norm, before)
    assert before > 10 and after == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_empty_local_shards_add_nothing_to_the_norm(norm_type):
    """A rank's shard of a small parameter can be empty under FSDP's uneven split: it adds
    nothing to the norm (whose infinity form has no value on an empty tensor by itself)."""
    from titan.dist.reduce import total_norm

    grads = [torch.empty(0), torch.tensor([3.0, -4.0]), torch.zeros(0, 5), torch.tensor([[1.0, -12.0]])]
    whole = torch.cat([g.flatten() for g in grads])
    assert float(total_norm(grads, None, norm_type)) == pytest.approx(float(whole.norm(norm_type)))
    assert float(total_norm([torch.empty(0)], None, norm_type)) == 0.0
