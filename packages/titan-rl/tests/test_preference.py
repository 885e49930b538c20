"""DPO and its variants against values and gradients computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from titan.rl.preference import preference_loss, sequence_logprobs

# One example: the policy raised the chosen completion by 0.5 nats over the reference and
# lowered the rejected one by 0.2: the log-ratio margin h is 0.7; beta 0.1 makes it 0.07.
POLICY_C, POLICY_R, REF_C, REF_R = -1.0, -2.0, -1.5, -1.8


def loss_of(loss_type, **kw):
    policy = torch.tensor([POLICY_C, POLICY_R], requires_grad=True)
    losses, rewards = preference_loss(policy[:1], policy[1:], torch.tensor([REF_C]), torch.tensor([REF_R]),
                                      beta=0.1, loss_type=loss_type, **kw)
    losses.sum().backward()
    return losses.item(), policy.grad.tolist(), rewards


def softplus(x):
    return math.log1p(math.exp(x))


def test_dpo_sigmoid_by_hand_with_its_gradient_and_implicit_rewards():
    value, grad, rewards = loss_of("sigmoid")
    assert value == pytest.approx(softplus(-0.07))  # -log sigmoid(0.07)
    # d/dlog pi(c) = -beta sigmoid(-beta h); the rejected one's the opposite
    s = 1 / (1 + math.exp(0.07))
    assert grad == pytest.approx([-0.1 * s, 0.1 * s])
    assert rewards["chosen_rewards"].item() == pytest.approx(0.05)
    assert rewards["rejected_rewards"].item() == pytest.approx(-0.02)


def test_label_smoothing_ipo_hinge_and_robust_by_hand():
    assert loss_of("sigmoid", label_smoothing=0.1)[0] == pytest.approx(0.9 * softplus(-0.07) + 0.1 * softplus(0.07))
    assert loss_of("robust", label_smoothing=0.1)[0] == pytest.approx(
        (0.9 * softplus(-0.07) - 0.1 * softplus(0.07)) / 0.8)
    assert loss_of("hinge")[0] == pytest.approx(0.93)
    value, grad, _ = loss_of("ipo")
    assert value == pytest.approx((0.7 - 5.0) ** 2)
    assert grad == pytest.approx([2 * (0.7 - 5.0), -2 * (0.7 - 5.0)])


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_the_other_trl_losses_by_hand():
    # log-ratios: chosen lc = 0.5, rejected lr = -0.2, margin h = 0.7; beta 0.1
    z = 0.07
    eps = 1e-3  # EXO's own smoothing when none is given
    assert loss_of("exo_pair")[0] == pytest.approx(
        sigmoid(z) * (-softplus(-z) - math.log(1 - eps)) + sigmoid(-z) * (-softplus(z) - math.log(eps)))
    assert loss_of("exo_pair", label_smoothing=0.2)[0] == pytest.approx(
        sigmoid(z) * (-softplus(-z) - math.log(0.8)) + sigmoid(-z) * (-softplus(z) - math.log(0.2)))
    assert loss_of("nca_pair")[0] == pytest.approx(softplus(-0.05) + 0.5 * softplus(0.05) + 0.5 * softplus(-0.02))
    value, grad, _ = loss_of("sppo_hard")
    assert value == pytest.approx((0.5 - 5) ** 2 + (-0.2 + 5) ** 2)
    assert grad == pytest.approx([2 * (0.5 - 5), 2 * (-0.2 + 5)])
    assert loss_of("apo_zero")[0] == pytest.approx(1 - sigmoid(0.05) + sigmoid(-0.02))
    value, grad, _ = loss_of("apo_down")
    assert value == pytest.approx(sigmoid(0.05) + 1 - sigmoid(0.07))
    # d/dlog pi(r) = beta sigmoid'(beta h): only the margin term reads the rejected side
    assert grad[1] == pytest.approx(0.1 * sigmoid(0.07) * (1 - sigmoid(0.07)))
    weight = sigmoid(z / 0.05)
    assert loss_of("discopop")[0] == pytest.approx(softplus(-z) * (1 - weight) + math.exp(-z) * weight)
    assert loss_of("discopop", discopop_tau=1.0)[0] == pytest.approx(
        softplus(-z) * (1 - sigmoid(z)) + math.exp(-z) * sigmoid(z))


def test_reference_free_simpo_and_orpo_by_hand():
    # mean log-probs: chosen -1.0, rejected -2.0 (the references are ignored)
    z = 0.1 * 1.0 - 0.5
    value, grad, rewards = loss_of("simpo")
    assert value == pytest.approx(softplus(-z))
    assert grad == pytest.approx([-0.1 * sigmoid(-z), 0.1 * sigmoid(-z)])
    assert rewards["chosen_rewards"].item() == pytest.approx(-0.1)  # beta x the policy's own log-prob
    assert loss_of("simpo", simpo_gamma=0.0, label_smoothing=0.1)[0] == pytest.approx(
        0.9 * softplus(-0.1) + 0.1 * softplus(0.1))
    log_odds = (-1.0 - math.log(1 - math.exp(-1.0))) - (-2.0 - math.log(1 - math.exp(-2.0)))
    value, grad, _ = loss_of("orpo")
    assert value == pytest.approx(0.1 * softplus(-log_odds))
    # d log odds / dm = 1 / (1 - exp(m)); the loss's slope in log odds is -beta sigmoid(-log odds)
    slope = -0.1 * sigmoid(-log_odds)
    assert grad == pytest.approx([slope / (1 - math.exp(-1.0)), -slope / (1 - math.exp(-2.0))])


def test_sequence_logprobs_sum_or_average_the_completion_tokens():
    token = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert sequence_logprobs(token, mask).tolist() == [-6.0, -1.0]
    assert sequence_logprobs(token, mask, mean=True).tolist() == [-2.0, -0.5]


@pytest.mark.parametrize("kwargs, needle", [
    (dict(loss_type="kto"), "the DPO loss_type must be one of sigmoid, robust, hinge, ipo, exo_pair"),
    (dict(loss_type="hinge", label_smoothing=0.1), "label_smoothing is read by sigmoid, robust, exo_pair"),
    (dict(beta=0.0), "the DPO beta must be > 0"),
    (dict(label_smoothing=0.5), r"the DPO label_smoothing must be in \[0, 0.5\)"),
])
def test_bad_settings_name_the_flag(kwargs, needle):
    one = torch.zeros(1)
    with pytest.raises(ValueError, match=needle):
        preference_loss(one, one, one, one, **kwargs)


def test_kto_by_hand_each_side_of_the_reference_point():
    from titan.rl.preference import kto_loss

    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    reference = torch.tensor([-1.5, -1.8])  # log-ratios 0.5 (desirable) and -0.2 (undesirable)
    kl = torch.tensor(0.1)
    losses, rewards = kto_loss(policy, reference, torch.tensor([True, False]), kl, beta=0.1,
                               desirable_weight=1.0, undesirable_weight=1.5)
    assert losses.tolist() == pytest.approx([1 - sigmoid(0.1 * (0.5 - 0.1)), 1.5 * (1 - sigmoid(0.1 * (0.1 + 0.2)))])
    assert rewards.tolist() == pytest.approx([0.05, -0.02])
    losses.sum().backward()
    # d/dr of 1 - sigmoid(beta (r - kl)) is -beta s(1 - s): the desirable log-prob rises; the
    # undesirable's loss rises with r, so its gradient is positive (the log-prob falls)
    s_d, s_u = sigmoid(0.04), sigmoid(0.03)
    assert policy.grad.tolist() == pytest.approx([-0.1 * s_d * (1 - s_d), 1.5 * 0.1 * s_u * (1 - s_u)])
    # APO-zero, unpaired: no reference point (kl unread)
    apo, _ = kto_loss(policy.detach(), reference, torch.tensor([True, False]), torch.tensor(9.0), beta=0.1,
                      undesirable_weight=1.5, loss_type="apo_zero_unpaired")
    assert apo.tolist() == pytest.approx([1 - sigmoid(0.05), 1.5 * sigmoid(-0.02)])
    with pytest.raises(ValueError, match="KTO weights"):
        kto_loss(policy, reference, torch.tensor([True, False]), kl, undesirable_weight=0.0)
