"""Pure math of the policy update against hand-computed values."""

import math

import pytest
import torch

from schemas.config import KLConfig, LossConfig
from schemas.requests import LossSettings
from tasks.algos.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    OBJECTIVES,
    MinibatchNorm,
    clip_objective,
    dcpo_bounds,
    policy_loss,
    token_mean,
    value_loss,
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
    loss, low, high = clip_objective(logp, old, adv, torch.ones(4), LossConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    # token 0: −min(1.5, 1.2) = −1.2 (clipped high); token 1: −min(−0.5, −0.8) = 0.8 (clipped low)
    # token 2: −min(2.2, 2.2) = −2.2; token 3: −min(0.5, 0.8) = −0.5 (ratio low but A > 0: not clipped)
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -2.2, -0.5], abs=1e-6)
    assert high.tolist() == [True, False, False, False]
    assert low.tolist() == [False, True, False, False]


def test_clip_higher_and_dual_clip():
    old = torch.zeros(2)
    logp = torch.log(torch.tensor([1.25, 5.0]))
    adv = torch.tensor([1.0, -1.0])
    loss, _, high = clip_objective(
        logp, old, adv, torch.ones(2), LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0)
    )
    # token 0: ε_high = 0.28 → 1.25 is inside the band: −1.25; token 1: −min(−5, −1.2) = 5 → dual-clip caps at 3
    assert loss.tolist() == pytest.approx([-1.25, 3.0], abs=1e-6)
    assert high.tolist() == [False, False]


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # Row 0: token log-ratios [0.2, 0.0, pad] → s = e^0.1 = 1.10517 > 1 + 4e-4 with A = 1 → ℓ = −1.0004 on
    # both tokens, clipped high. Row 1: log-ratios [−0.0001, −0.0001] → s = 0.99990 inside the band, A = −2
    # → ℓ = 2·0.99990 = 1.99980.
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, 0.0, 5.0], [-1e-4, -1e-4, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, -2.0, 0.0]])
    loss, low, high = OBJECTIVES["gspo"](logp, old, adv, mask, LossConfig(clip_eps_low=3e-4, clip_eps_high=4e-4))
    expected = [-1.0004, -1.0004, 0.0] + [2 * math.exp(-1e-4)] * 2 + [0.0]
    assert (loss * mask).flatten().tolist() == pytest.approx(expected, abs=1e-6)
    assert high[0, :2].tolist() == [True, True] and not low.any()
    # Mean over sequences (seq-mean-token-mean) of ℓ_i: (−1.0004 + 1.99980)/2.
    agg = AGGREGATIONS["seq-mean-token-mean"](loss, mask, MinibatchNorm(tokens=4, sequences=2))
    assert agg.item() == pytest.approx((-1.0004 + 2 * math.exp(-1e-4)) / 2, abs=1e-6)


def test_gspo_token_has_gspo_value_and_a_per_token_gradient():
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    settings = LossConfig(clip_eps_low=0.5, clip_eps_high=0.5)  # wide bounds: nothing clipped, so the gradient flows
    a = torch.tensor([[0.1, -0.2, 0.05]], requires_grad=True)
    b = torch.tensor([[0.1, -0.2, 0.05]], requires_grad=True)
    seq, _, _ = OBJECTIVES["gspo"](a, old, adv, mask, settings)
    tok, _, _ = OBJECTIVES["gspo_token"](b, old, adv, mask, settings)
    assert tok.flatten().tolist() == pytest.approx(seq.flatten().tolist(), abs=1e-6)
    (seq * mask).sum().backward()
    (tok * mask).sum().backward()
    s = math.exp((0.1 - 0.2 + 0.05) / 3)
    # gspo: ℓ = −s on each of 3 tokens, ds/dlogp_t = s/3 → grad −s per token; gspo_token: −s per token too,
    # since each token's term has d/dlogp_t = s·1 and there is one such term per token.
    assert a.grad.tolist()[0] == pytest.approx([-s] * 3, abs=1e-6)
    assert b.grad.tolist()[0] == pytest.approx([-s] * 3, abs=1e-6)
    # With token-level advantages the two differ: gspo_token weighs each token by its own A.
    adv2 = torch.tensor([[1.0, 2.0, 3.0]])
    c = torch.zeros(1, 3, requires_grad=True)
    (OBJECTIVES["gspo_token"](c, old, adv2, mask, settings)[0] * mask).sum().backward()
    assert c.grad.tolist()[0] == pytest.approx([-1.0, -2.0, -3.0], abs=1e-6)


def test_cispo_weights_every_tokens_gradient_by_the_truncated_ratio():
    # ρ = [1.0, 1.5, 0.5], A = [1, 1, −1], ε_low 0.2, ε_high 0.28 → ŵ = [1.0, 1.28, 0.8]; ℓ = −ŵ·A·log π_θ
    logp = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old = logp.detach() - torch.log(torch.tensor([1.0, 1.5, 0.5]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    settings = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    loss, low, high = OBJECTIVES["cispo"](logp, old, adv, torch.ones(3), settings)
    assert loss.tolist() == pytest.approx([1.0, 0.64, -1.6], abs=1e-6)  # −1·1·(−1), −1.28·1·(−0.5), −0.8·(−1)·(−2)
    assert high.tolist() == [False, True, False] and low.tolist() == [False, False, True]
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -1.28, 0.8], abs=1e-6)  # −ŵ·A: the truncated tokens keep theirs
    clipped = logp.detach().clone().requires_grad_(True)
    clip_objective(clipped, old, adv, torch.ones(3), settings)[0].sum().backward()
    assert clipped.grad[1] == 0  # PPO's clip drops the gradient of the token beyond 1 + ε_high


def test_gmpo_clips_each_log_ratio_and_takes_the_geometric_mean():
    # Row 0, A = 1: Δ = [0.6, −0.2, pad] → [0.4, −0.2] (0.6 clipped to ε_high) → ratio e^0.1, ℓ = −e^0.1.
    # Row 1, A = −1: Δ = [−0.6, 0.2, 0.5] → [−0.4, 0.2, 0.5] (−0.6 clipped to −ε_low) → e^(0.3/3) = e^0.1, ℓ = +e^0.1.
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.6, -0.2, 9.0], [-0.6, 0.2, 0.5]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, low, high = OBJECTIVES["gmpo"](logp, old, adv, mask, LossConfig(clip_eps_low=0.4, clip_eps_high=0.4))
    e = math.exp(0.1)
    assert torch.allclose(loss, torch.tensor([[-e, -e, -e], [e, e, e]]), atol=1e-6)
    assert high.tolist() == [[True, False, True], [False, False, False]]  # the pad's Δ too: masked by the caller
    assert low.tolist() == [[False, False, False], [True, False, False]]
    loss[:, 0].sum().backward()  # each row's ℓ once: the clipped tokens get no gradient, the others ℓ/n
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -e / 2, 0.0], [0.0, e / 3, e / 3]]), atol=1e-6)


def test_gmpo_matches_the_papers_product_form_in_a_loop():
    """ℓ_i = −A_i·(Π_t min(ρ_t, clip(ρ_t, e^−ε_low, e^ε_high)))^(1/|y_i|) for A_i > 0, max for A_i < 0 (the paper's
    |Π min(ρA, clip(ρ)A)|^(1/|y|)·sgn A), against the vectorised log-space form."""
    torch.manual_seed(3)
    b, t, eps_low, eps_high = 7, 6, 0.3, 0.4
    old, logp = torch.randn(b, t), torch.randn(b, t)
    adv = torch.randn(b, 1).expand(b, t).contiguous()  # one advantage per sequence, as GRPO's
    mask = (torch.rand(b, t) > 0.3).float()
    mask[:, 0] = 1.0
    loss, _, _ = OBJECTIVES["gmpo"](logp, old, adv, mask, LossConfig(clip_eps_low=eps_low, clip_eps_high=eps_high))
    for i in range(b):
        a, product, n = float(adv[i, 0]), 1.0, 0
        for j in range(t):
            if mask[i, j]:
                rho = math.exp(float(logp[i, j] - old[i, j]))
                bounded = min(max(rho, math.exp(-eps_low)), math.exp(eps_high))
                product *= min(rho, bounded) if a > 0 else max(rho, bounded)
                n += 1
        assert float(loss[i, 0]) == pytest.approx(-a * product ** (1 / n), rel=1e-5)


def test_dcpo_bounds_match_design_at_q_0_9_and_0_01():
    low, high = dcpo_bounds(torch.tensor([0.9, 0.01]), 0.16, 0.2, 3.0)
    # q = 0.9: low = ½ + ½·sqrt(1 − 0.64/0.9) = 0.768749, high = ½ + ½·sqrt(1 + 0.8/0.9) = 1.187212
    assert low[0].item() == pytest.approx(0.5 + 0.5 * math.sqrt(1 - 0.64 / 0.9), abs=1e-6)
    assert high[0].item() == pytest.approx(0.5 + 0.5 * math.sqrt(1 + 0.8 / 0.9), abs=1e-6)
    # … so the new probability may range over 0.69–1.07 (docs/algorithms.md)
    assert (0.9 * low[0]).item() == pytest.approx(0.69, abs=0.005) and (0.9 * high[0]).item() == pytest.approx(
        1.07, abs=0.005
    )
    # q = 0.01: 1 − 64 < 0 → low = ½; high = ½ + ½·sqrt(81) = 5 → probability 0.005–0.05
    assert low[1].item() == pytest.approx(0.5) and high[1].item() == pytest.approx(5.0)
    # The cap max(c, 10): q = 1e-4 would give 100.5
    assert dcpo_bounds(torch.tensor([1e-4]), 0.16, 0.2, 3.0)[1].item() == pytest.approx(10.0)


def test_dcpo_objective_uses_per_token_bounds():
    # q = 0.9 and 0.01 with ρ = 1.15 and 4.0, A = 1: both are inside their bounds (1.1872, 5) → ℓ = −ρ;
    # the same ρ under the symmetric 0.2 clip would be clipped at 1.2 for the second token.
    old = torch.log(torch.tensor([0.9, 0.01]))
    logp = old + torch.log(torch.tensor([1.15, 4.0]))
    loss, low, high = OBJECTIVES["dcpo"](
        logp, old, torch.ones(2), torch.ones(2), LossConfig(clip_eps_low=0.16, clip_eps_high=0.2, dual_clip=3.0)
    )
    assert loss.tolist() == pytest.approx([-1.15, -4.0], abs=1e-5) and not high.any()
    loss, _, high = OBJECTIVES["dcpo"](
        old + math.log(1.3),
        old,
        torch.ones(2),
        torch.ones(2),
        LossConfig(clip_eps_low=0.16, clip_eps_high=0.2, dual_clip=3.0),
    )
    assert loss[0].item() == pytest.approx(-(0.5 + 0.5 * math.sqrt(1 + 0.8 / 0.9)), abs=1e-5) and high.tolist() == [
        True,
        False,
    ]


def test_aggregations_hand_values():
    # ℓ rows [1, 2, 3] (3 tokens) and [4, pad, pad] (1 token); minibatch of 4 tokens and 2 sequences, L_max 5.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    norm = MinibatchNorm(tokens=4, sequences=2, max_len=5)
    expected = {
        "token-mean": 10 / 4,
        "seq-mean-token-mean": (2 + 4) / 2,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-sum-norm": 10 / (2 * 5),
        "only-token-mean": 2 + 4,
    }
    for name, value in expected.items():
        assert AGGREGATIONS[name](loss, mask, norm).item() == pytest.approx(value), name
    # a micro-batch of the first row alone, still normalised by the minibatch
    assert token_mean(loss[:1], mask[:1], norm).item() == pytest.approx(1.5)


def test_value_loss_is_clipped_around_the_old_values():
    # V_old = 0, ε_v = 0.2. Token 0: V = 1, R = 1 → plain 0, clipped (0.2 − 1)² = 0.64 → ½·0.64 = 0.32.
    # Token 1: V = 0.1, R = 0.5 → plain 0.16, clipped (0.1 − 0.5)² = 0.16 → 0.08.
    values = torch.tensor([[1.0, 0.1]])
    loss, clipped = value_loss(
        values,
        torch.zeros(1, 2),
        torch.tensor([[1.0, 0.5]]),
        torch.ones(1, 2),
        0.2,
        MinibatchNorm(tokens=2, sequences=1),
    )
    assert loss.item() == pytest.approx((0.32 + 0.08) / 2) and clipped.item() == 1.0


def test_entropy_bonus_lowers_the_loss_by_c_times_entropy():
    logp = torch.zeros(1, 2)
    mask, ent = torch.ones(1, 2), torch.tensor([[0.5, 1.5]])
    norm = MinibatchNorm(tokens=2, sequences=1)
    plain, _ = policy_loss(logp, logp, logp, torch.zeros(1, 2), mask, norm, LossSettings(kl=KLConfig(placement="none")))
    bonus, _ = policy_loss(
        logp,
        logp,
        logp,
        torch.zeros(1, 2),
        mask,
        norm,
        LossSettings(kl=KLConfig(placement="none"), loss=LossConfig(entropy_coef=0.1)),
        entropy=ent,
    )
    assert plain.item() == pytest.approx(0.0) and bonus.item() == pytest.approx(-0.1 * 1.0)


class TinyPolicy(torch.nn.Module):
    """Enough of a language model for the gradient test: embedding → linear → logits."""

    def __init__(self, vocab=7, dim=4):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)

    def forward(self, ids):
        logp_all = torch.log_softmax(self.out(self.emb(ids)), -1)
        return logp_all.gather(-1, ids.roll(-1, dims=1).unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _accumulate(model, ids, old, ref, adv, mask, rows_per_micro, settings):
    """Loss and gradient of one minibatch computed in micro-batches, as the trainer does."""
    model.zero_grad()
    norm = MinibatchNorm(
        tokens=float(mask.sum()), sequences=float((mask.sum(-1) > 0).sum()), max_len=float(mask.shape[1])
    )
    total = 0.0
    for i in range(0, mask.shape[0], rows_per_micro):
        s = slice(i, i + rows_per_micro)
        logp, ent = model(ids[s])
        loss, _ = policy_loss(logp, old[s], ref[s], adv[s], mask[s], norm, settings, entropy=ent)
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_gradient_accumulation_leaves_loss_and_gradient_unchanged(objective, aggregation):
    torch.manual_seed(1)
    b, t = 6, 5
    model = TinyPolicy()
    ids = torch.randint(0, 7, (b, t))
    with torch.no_grad():
        base, _ = model(ids)
    old, ref, adv = base + 0.1 * torch.randn(b, t), base + 0.2 * torch.randn(b, t), torch.randn(b, t)
    mask = (torch.rand(b, t) > 0.3).float()
    mask[2] = 0.0  # an overlong-filtered sequence
    settings = LossSettings(
        loss=LossConfig(
            objective=objective,
            aggregation=aggregation,
            clip_eps_low=0.2,
            clip_eps_high=0.28,
            dual_clip=3.0,
            entropy_coef=0.01,
        )
    )
    full, full_grad = _accumulate(model, ids, old, ref, adv, mask, b, settings)
    for rows in (1, 2, 4):
        acc, acc_grad = _accumulate(model, ids, old, ref, adv, mask, rows, settings)
        assert acc == pytest.approx(full, rel=1e-5, abs=1e-7)
        for g_full, g_acc in zip(full_grad, acc_grad):
            assert torch.allclose(g_full, g_acc, atol=1e-6), (objective, aggregation, rows)
        assert any(g.abs().sum() > 0 for g in acc_grad)


def test_adaptive_kl_controller_hand_values():
    from tasks.stages.kl_control import adapt_beta

    # KL 0.15 vs target 0.1: error 0.5 is clipped to 0.2; n/horizon = 512/10000 → β·(1 + 0.2·0.0512)
    assert adapt_beta(0.04, 0.15, 0.1, 512, 10_000) == pytest.approx(0.04 * 1.01024)
    # KL 0.09: error −0.1 → β·(1 − 0.1·0.0512)
    assert adapt_beta(0.04, 0.09, 0.1, 512, 10_000) == pytest.approx(0.04 * (1 - 0.00512))
    assert adapt_beta(0.04, 0.1, 0.1, 512, 10_000) == pytest.approx(0.04)


def test_truncated_importance_sampling_weights_the_policy_term_only():
    from tasks.algos.losses import tis_weights

    # π_old/π_sampler = e^{old − sampler}: 0.5 → e^0.5 = 1.6487; 1.0 → e^1 = 2.718, capped at 2; −0.5 → 0.6065.
    old, sampler = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.5, -2.0, -0.5]])
    w = tis_weights(old, sampler, 2.0)
    assert w.tolist()[0] == pytest.approx([math.exp(0.5), 2.0, math.exp(-0.5)], abs=1e-6)
    logp = torch.tensor([[-0.9, -1.1, -1.0]], requires_grad=True)
    adv, mask, ref = torch.tensor([[1.0, -1.0, 0.5]]), torch.ones(1, 3), torch.tensor([[-1.2, -1.2, -1.2]])
    norm = MinibatchNorm(tokens=3.0, sequences=1.0)
    s = LossSettings(kl_beta=0.1)
    weighted, _ = policy_loss(logp, old, ref, adv, mask, norm, s, token_weights=w)
    plain, _ = policy_loss(logp, old, ref, adv, mask, norm, s)
    pg, _, _ = clip_objective(logp, old, adv, mask, LossConfig())
    kl = 0.1 * KL_ESTIMATORS["k3"](logp, ref)
    # By hand: token-mean of w·ℓ_pg + β·k3 (the KL term is not reweighted).
    assert weighted.item() == pytest.approx(((w * pg + kl).sum() / 3).item(), abs=1e-6)
    assert plain.item() == pytest.approx(((pg + kl).sum() / 3).item(), abs=1e-6)
    assert tis_weights(old, old, 2.0).tolist() == [[1.0, 1.0, 1.0]]  # sampler = trainer: no correction
