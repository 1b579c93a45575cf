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
        LossSettings(kl=KLConfig(placement="none"), entropy_coef=0.1),  # the iteration's coefficient
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


# Clip-Cov and KL-Cov select tokens by their covariance within each micro-batch (as verl's, where a micro-batch is one
# GPU's share), so their update does depend on micro_batch_size; their tests below hold the micro-batch fixed.
PER_MICRO_BATCH = {"clip_cov", "kl_cov"}


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
@pytest.mark.parametrize("objective", sorted(set(OBJECTIVES) - PER_MICRO_BATCH))
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
        ),
        entropy_coef=0.01,
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
    from tasks.algos.losses import rollout_correction

    # π_old/π_sampler = e^{old − sampler}: 0.5 → e^0.5 = 1.6487; 1.0 → e^1 = 2.718, capped at 2; −0.5 → 0.6065.
    old, sampler = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.5, -2.0, -0.5]])
    token_is = LossConfig(rollout_is="token", rollout_is_threshold=2.0)
    w, sums = rollout_correction(old, sampler, torch.ones(1, 3), token_is)
    assert w.tolist()[0] == pytest.approx([math.exp(0.5), 2.0, math.exp(-0.5)], abs=1e-6)
    assert sums["rollout_is_capped_fraction"].item() == 1.0 and sums["rollout_rejected_fraction"].item() == 0.0
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
    same, _ = rollout_correction(old, old, torch.ones(1, 3), token_is)
    assert same.tolist() == [[1.0, 1.0, 1.0]]  # sampler = trainer: no correction


def test_sequence_is_geometric_rejection_and_the_veto_by_hand():
    from tasks.algos.losses import rollout_correction

    # Log ratios (old − sampler), row 0: [0.2, 0.3, pad]: Σ 0.5, mean 0.25; row 1: [−0.1] × 3: Σ −0.3, mean −0.1;
    # row 2: [0.0, −10.0, 0.0]: a token the trainer finds e^−10 as likely as the sampler did.
    log_ratio = torch.tensor([[0.2, 0.3, 0.0], [-0.1, -0.1, -0.1], [0.0, -10.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    sampler = torch.full((3, 3), -2.0)
    old = sampler + log_ratio
    seq_is = LossConfig(rollout_is="sequence", rollout_is_threshold=1.5)
    w, _ = rollout_correction(old, sampler, mask, seq_is)
    assert w[0, :2].tolist() == pytest.approx([1.5, 1.5]) and w[0, 2] == 0.0  # e^0.5 = 1.65 capped at 1.5; padding 0
    assert w[1].tolist() == pytest.approx([math.exp(-0.3)] * 3, abs=1e-6)
    # Geometric rejection within [e^−0.2, e^0.2]: row 0's e^0.25 is out, row 1's e^−0.1 in, row 2's e^(−10/3) out.
    geo = LossConfig(
        rollout_rs="geometric", rollout_rs_threshold=math.exp(0.2), rollout_rs_threshold_lower=math.exp(-0.2)
    )
    w, sums = rollout_correction(old, sampler, mask, geo)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert sums["rollout_rejected_fraction"].item() == 5.0  # tokens: 2 of row 0, 3 of row 2
    # Token rejection within [1/1.25, 1.25] (log ±0.223): 0.3 and −10 are out. The veto (1e-4: log −9.2) drops row 2.
    token = LossConfig(rollout_rs="token", rollout_rs_threshold=1.25, rollout_veto_threshold=1e-4)
    w, sums = rollout_correction(old, sampler, mask, token)
    assert w.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert sums["rollout_vetoed_fraction"].item() == 3.0 and sums["rollout_rejected_fraction"].item() == 4.0


def test_sapo_gates_the_ratio_smoothly_with_a_temperature_per_sign():
    # ρ = 1.2: A = 1, τ 1: f = σ(0.2)·4 = 2.199340; A = −1, τ 1.05: f = σ(0.21)·4/1.05 = 2.104034 → ℓ = −f·A.
    logp = torch.tensor([math.log(1.2), math.log(1.2), 0.0, 0.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 2.0, -3.0])
    settings = LossConfig(sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    loss, low, high = OBJECTIVES["sapo"](logp, torch.zeros(4), adv, torch.ones(4), settings)
    sig = lambda x: 1.0 / (1.0 + math.exp(-x))  # noqa: E731
    assert loss[:2].tolist() == pytest.approx([-4 * sig(0.2), 4 * sig(0.21) / 1.05], abs=1e-6)
    assert not low.any() and not high.any()  # no hard clip
    loss.sum().backward()
    # At ρ = 1 the gate's slope is 1: the plain surrogate's gradient, −A; at ρ = 1.2 it is 4σ(1−σ)·ρ·(−A), smaller.
    assert logp.grad[2:].tolist() == pytest.approx([-2.0, 3.0], abs=1e-6)
    s = sig(0.2)
    assert logp.grad[0].item() == pytest.approx(-4 * s * (1 - s) * 1.2, abs=1e-6) and abs(logp.grad[0]) < 1.2


def test_clip_cov_drops_the_gradient_of_a_seeded_random_pick_among_unclipped_in_band_tokens():
    # Token covariances (A − Ā)(log π − mean log π) over the 8 tokens, both means 2.5/8 = 0.3125: tokens 0 and 1 have
    # 1.6875² = 2.85, token 7 (−1.8125)² = 3.29, the others 0.3125² = 0.098: the band (1, 5) holds 0, 1 and 7, and PPO
    # clipped token 1 (ρ = 2, A > 0), so the candidates are 0 and 7. cov_ratio 0.25 → 2 tokens.
    logp = torch.tensor([[2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.5]], requires_grad=True)
    old = logp.detach().clone()
    old[0, 1] -= math.log(2.0)
    adv = torch.tensor([[2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.5]])
    mask = torch.ones(2, 4)
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, cov_ratio=0.25, clip_cov_lb=1.0, clip_cov_ub=5.0)
    from tasks.algos.losses import token_covariance

    cov = token_covariance(logp, adv, mask)
    assert [i for i, c in enumerate(cov.view(-1).tolist()) if 1 < c < 5] == [0, 1, 7]
    loss, low, high = OBJECTIVES["clip_cov"](logp, old, adv, mask, cfg)
    loss.sum().backward()
    dropped = {i for i, g in enumerate(logp.grad.view(-1).tolist()) if g == 0 and adv.view(-1)[i] != 0}
    assert dropped == {0, 1, 7}  # 1 by PPO's clip, 0 and 7 by the pick (both candidates: k = min(2, 2))
    assert high.view(-1).tolist()[:2] == [True, True] and low.view(-1).tolist()[7]
    again, _, _ = OBJECTIVES["clip_cov"](logp, old, adv, mask, cfg.model_copy(update={"cov_ratio": 0.125}))
    twice, _, _ = OBJECTIVES["clip_cov"](logp, old, adv, mask, cfg.model_copy(update={"cov_ratio": 0.125}))
    zeroed = [i for i in (0, 7) if again.view(-1)[i] == 0]
    assert len(zeroed) == 1 and torch.equal(again, twice)  # one of the two, the same one every time (seeded by data)


def test_kl_cov_penalises_the_highest_covariance_tokens_without_a_clip():
    # One row: A = [1, 0, −1] (mean 0), log π = [0, −1, −2] (mean −1): cov = [1·1, 0·0, (−1)(−1)] = [1, 0, 1]; top-1
    # (cov_ratio 1/3) is one of the tied maxima. Δ = log π − log π_old = [0.5, 0.5, −0.5].
    logp = torch.tensor([[0.0, -1.0, -2.0]])
    old = logp - torch.tensor([[0.5, 0.5, -0.5]])
    adv = torch.tensor([[1.0, 0.0, -1.0]])
    cfg = LossConfig(cov_ratio=1 / 3, kl_cov_coef=0.1)
    loss, low, high = OBJECTIVES["kl_cov"](logp, old, adv, torch.ones(1, 3), cfg)
    plain = (-adv * torch.exp(logp - old)).view(-1).tolist()  # −A·ρ, no clip: ρ = e^0.5 is kept whole
    picked = int(torch.nonzero(high | low)[0, 1])
    assert picked in (0, 2) and int((high | low).sum()) == 1
    expected = [p + (0.1 * 0.5 if i == picked else 0.0) for i, p in enumerate(plain)]
    assert loss.view(-1).tolist() == pytest.approx(expected, abs=1e-6)


def test_top_entropy_quantile_trains_only_the_highest_entropy_tokens_and_keeps_the_kl_on_all():
    # Entropies [0.1, 0.5, 0.9, 0.3]: the 0.5 quantile is 0.4 (between 0.3 and 0.5) → tokens 1 and 2 keep the loss.
    logp = torch.zeros(1, 4)
    old = logp - 0.1  # ρ = e^0.1 on every token
    ref = logp - 0.2
    adv, mask, ent = torch.ones(1, 4), torch.ones(1, 4), torch.tensor([[0.1, 0.5, 0.9, 0.3]])
    norm = MinibatchNorm(tokens=4, sequences=1)
    kl = KLConfig(estimator="k1", placement="loss")
    cut = LossSettings(loss=LossConfig(top_entropy_quantile=0.5, clip_eps_high=1.0), kl=kl, kl_beta=0.5)
    loss, sums = policy_loss(logp, old, ref, adv, mask, norm, cut, entropy=ent)
    rho = math.exp(0.1)
    assert loss.item() == pytest.approx((2 * -rho + 4 * 0.5 * 0.2) / 4, abs=1e-6)  # pg on 2 tokens, β·k1 on all 4
    assert sums["entropy_masked_fraction"].item() == 2.0  # a token sum: the trainer divides by the tokens
    every = LossSettings(loss=LossConfig(clip_eps_high=1.0), kl=kl, kl_beta=0.5)
    whole, sums = policy_loss(logp, old, ref, adv, mask, norm, every, entropy=ent)
    assert whole.item() == pytest.approx((4 * -rho + 4 * 0.5 * 0.2) / 4, abs=1e-6)
    assert sums["entropy_masked_fraction"] == 0


def test_adaptive_entropy_coefficient_steps_toward_the_target_within_its_bounds():
    from tasks.stages.kl_control import adapt_entropy_coef

    assert adapt_entropy_coef(0.01, 0.15, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)  # at or below: up
    assert adapt_entropy_coef(0.01, 0.2, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.015)
    assert adapt_entropy_coef(0.01, 0.3, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.005)  # above: down
    assert adapt_entropy_coef(0.002, 0.3, 0.2, 0.005, 0.0, 1.0) == 0.0  # not below the lower bound
    assert adapt_entropy_coef(0.998, 0.1, 0.2, 0.005, 0.0, 1.0) == 1.0  # nor above the upper


def test_geometric_rejection_divides_the_unclamped_sum():
    """Geo-RS on 40 tokens at log-ratio 0.6: the geometric mean is e^0.6 = 1.82, above a 1.7 threshold, so the response
    is rejected. Clamping the sum (24) to 20 before dividing by 40 saw e^0.5 = 1.65 and kept it."""
    from tasks.algos.losses import rollout_correction

    old, sampler, mask = torch.full((1, 40), -1.0), torch.full((1, 40), -1.6), torch.ones(1, 40)
    w, sums = rollout_correction(old, sampler, mask, LossConfig(rollout_rs="geometric", rollout_rs_threshold=1.7))
    assert w.sum().item() == 0.0 and sums["rollout_rejected_fraction"].item() == 40.0


def test_gmpo_keeps_the_gradient_of_a_token_far_below_its_old_probability():
    """GMPO with A > 0 and Δ = −25: unclipped (only Δ > ε_high is clipped for A > 0), so the token still trains, as the
    reference's loss has it: ∂ℓ/∂logp = −A·exp(Δ)/n ≠ 0. A ±20 clamp on Δ made it 0."""
    logp = torch.tensor([[-26.0, -1.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2), torch.ones(1, 2)
    loss, _, _ = OBJECTIVES["gmpo"](logp, old, adv, mask, LossConfig(objective="gmpo"))
    loss[0, 0].backward()
    # ℓ = −exp((Δ_0 + Δ_1)/2) with Δ_1 = 0: ∂ℓ/∂logp_0 = −½·exp(−12.5)
    assert logp.grad[0, 0].item() == pytest.approx(-0.5 * math.exp(-12.5), rel=1e-5)


def test_kl_cov_loss_value_is_exact_past_a_log_ratio_of_20():
    """KL-Cov's penalised token at Δ = 21: ℓ = −A·e^21 + k·21 (a clamp at 20 gave −A·e^20 + k·20)."""
    logp, old = torch.tensor([[20.0]]), torch.tensor([[-1.0]])
    adv, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    cfg = LossConfig(objective="kl_cov", kl_cov_coef=0.5)
    loss, _, _ = OBJECTIVES["kl_cov"](logp, old, adv, mask, cfg)
    assert loss.item() == pytest.approx(math.exp(21) + 0.5 * 21, rel=1e-6)


def test_off_policy_sequence_mask_drops_negative_responses_the_policy_has_drifted_from():
    """DeepSeek-V3.2's mask (TRL's off_policy_mask_threshold), δ = 0.5, hand-worked on three 2-token responses with
    log π_θ = −1: (A −1, sampler −0.4 on both tokens: mean drift 0.6 > δ) masked; (A −1, drift 0.4) kept; (A +1, drift
    1.0) kept, as its advantage is positive. The masked response's tokens still count in the token-mean normaliser."""
    from tasks.algos.losses import off_policy_mask

    logp = torch.full((3, 2), -1.0, requires_grad=True)
    sampler = torch.tensor([[-0.4, -0.4], [-0.6, -0.6], [0.0, 0.0]])
    adv, mask = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]]), torch.ones(3, 2)
    assert off_policy_mask(logp, sampler, adv, mask, 0.5).tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    settings = LossSettings(
        loss=LossConfig(off_policy_mask_threshold=0.5, aggregation="token-mean"), kl=KLConfig(placement="none")
    )
    norm = MinibatchNorm(tokens=6.0, sequences=3.0)
    loss, sums = policy_loss(logp, logp.detach(), logp.detach(), adv, mask, norm, settings, sampler_logp=sampler)
    # ρ = 1 everywhere: ℓ = −A on the 4 kept tokens (+1, +1, −1, −1), 0 on the masked two; token-mean over 6 tokens.
    assert loss.item() == pytest.approx(0.0) and sums["off_policy_masked_fraction"].item() == 2.0
    loss.backward()
    assert logp.grad[0].abs().sum() == 0 and logp.grad[1].abs().sum() > 0
