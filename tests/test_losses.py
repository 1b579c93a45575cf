"""Pure math of the policy update against hand-computed values."""

import math

import pytest
import torch

from tasks.losses import (
    KL_ESTIMATORS, ClipSettings, MinibatchNorm, PolicyLossSettings, clip_objective, policy_loss, token_mean,
)


def test_k3_matches_hand_values():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.0])
    # lr = 0.5 → e^-0.5 − 1 + 0.5 = 0.1065307; lr = 0 → 0
    k3 = KL_ESTIMATORS["k3"](logp, ref)
    assert k3.tolist() == pytest.approx([math.exp(-0.5) - 0.5, 0.0], abs=1e-6)
    assert k3[0].item() == pytest.approx(0.1065307, abs=1e-6)


def test_k1_k2_values():
    logp, ref = torch.tensor([0.3]), torch.tensor([0.0])
    assert KL_ESTIMATORS["k1"](logp, ref).item() == pytest.approx(0.3)
    assert KL_ESTIMATORS["k2"](logp, ref).item() == pytest.approx(0.045)


def test_k3_plus_has_k3_value_and_k2_gradient():
    ref = torch.tensor([0.0, -1.0])
    a = torch.tensor([0.4, -1.7], requires_grad=True)
    b = torch.tensor([0.4, -1.7], requires_grad=True)
    plus = KL_ESTIMATORS["k3+"](a, ref)
    assert plus.detach().tolist() == pytest.approx(KL_ESTIMATORS["k3"](a.detach(), ref).tolist())
    plus.sum().backward()
    KL_ESTIMATORS["k2"](b, ref).sum().backward()
    assert a.grad.tolist() == pytest.approx(b.grad.tolist())  # d(½lr²)/dlogp = lr = [0.4, −0.7]
    assert a.grad.tolist() == pytest.approx([0.4, -0.7])


def test_clip_objective_hand_values():
    # ρ = e^(logp − old): [1.5, 0.5, 1.1, 0.5]; A = [1, −1, 2, 1]; ε = 0.2
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5]))
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    loss, low, high = clip_objective(logp, old, adv, ClipSettings(0.2, 0.2))
    # token 0: −min(1.5, 1.2) = −1.2 (clipped high); token 1: −min(−0.5, −0.8) = 0.8 (clipped low)
    # token 2: −min(2.2, 2.2) = −2.2; token 3: −min(0.5, 0.8) = −0.5 (ratio low but A > 0: not clipped)
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -2.2, -0.5], abs=1e-6)
    assert high.tolist() == [True, False, False, False]
    assert low.tolist() == [False, True, False, False]


def test_clip_higher_and_dual_clip():
    old = torch.zeros(2)
    logp = torch.log(torch.tensor([1.25, 5.0]))
    adv = torch.tensor([1.0, -1.0])
    loss, _, high = clip_objective(logp, old, adv, ClipSettings(0.2, 0.28, dual_clip=3.0))
    # token 0: ε_high = 0.28 → 1.25 is inside the band: −1.25; token 1: −min(−5, −1.2) = 5 → dual-clip caps at 3
    assert loss.tolist() == pytest.approx([-1.25, 3.0], abs=1e-6)
    assert high.tolist() == [False, False]


def test_token_mean_uses_minibatch_normalizer():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert token_mean(loss, mask, MinibatchNorm(tokens=4, sequences=2)).item() == pytest.approx(2.5)
    # a micro-batch of the first row alone, normalised by the minibatch's 4 tokens
    assert token_mean(loss[:1], mask[:1], MinibatchNorm(tokens=4, sequences=2)).item() == pytest.approx(1.5)


def _micro_losses(logp, old, ref, adv, mask, rows_per_micro, settings):
    norm = MinibatchNorm(tokens=float(mask.sum()), sequences=float(mask.shape[0]))
    total = 0.0
    for i in range(0, mask.shape[0], rows_per_micro):
        s = slice(i, i + rows_per_micro)
        loss, _ = policy_loss(logp[s], old[s], ref[s], adv[s], mask[s], norm, settings)
        loss.backward()
        total += float(loss.detach())
    return total


@pytest.mark.parametrize("rows_per_micro", [1, 2, 3])
def test_gradient_accumulation_leaves_loss_and_gradient_unchanged(rows_per_micro):
    torch.manual_seed(0)
    b, t = 6, 5
    base = torch.randn(b, t)
    old, ref, adv = base + 0.1 * torch.randn(b, t), base + 0.2 * torch.randn(b, t), torch.randn(b, t)
    mask = (torch.rand(b, t) > 0.3).float()
    settings = PolicyLossSettings()
    whole = base.clone().requires_grad_(True)
    full = _micro_losses(whole, old, ref, adv, mask, b, settings)
    split = base.clone().requires_grad_(True)
    accumulated = _micro_losses(split, old, ref, adv, mask, rows_per_micro, settings)
    assert accumulated == pytest.approx(full, rel=1e-5)
    assert torch.allclose(whole.grad, split.grad, atol=1e-6)
