"""Pure torch math for the policy update: policy objectives and loss aggregations (KL estimators: tasks/algos/kl.py).

One registry per family, keyed by the config's Literal names (docs/algorithms.md). No I/O, no engines.
Shapes: B sequences × T response positions; `mask` is 1.0 on real response tokens.
Over 400 lines as the registry of objectives and aggregations: each is a short pure function beside its family, so that
a new one touches this file alone (docs/architecture.md, How to extend).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable

import polars as pl
import torch

from schemas.config import LossConfig
from schemas.requests import LossSettings
from tasks.algos.kl import KL_ESTIMATORS, kl_k3
from tasks.registry import Registry

# ---- Policy objectives: per-token loss ℓ and clip statistics --------------------------------------------
# Every objective has the signature (logp, old_logp, adv, mask, loss) → (ℓ, clipped_low, clipped_high), where
# `loss` is the config's loss section (its clip_eps_low, clip_eps_high, dual_clip) and the clipped masks mark tokens
# whose gradient the clip removed (for the clip-fraction metrics).


def clipped_surrogate(ratio, adv, low, high, dual_clip: float | None):
    """ℓ = −min(ρA, clip(ρ, low, high)·A), then dual-clip for A < 0: ℓ := min(ℓ, −c·A).

    `low` and `high` are bounds on ρ itself (floats, or tensors broadcastable to ρ for per-token bounds).
    """
    unclipped = ratio * adv
    clipped = torch.minimum(torch.maximum(ratio, torch.as_tensor(low)), torch.as_tensor(high)) * adv
    loss = -torch.minimum(unclipped, clipped)
    if dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    clipped_high = (ratio > high) & (adv > 0)
    clipped_low = (ratio < low) & (adv < 0)
    return loss, clipped_low, clipped_high


def clip_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """PPO/GRPO clip with asymmetric ε (DAPO clip-higher: ε_low 0.2, ε_high 0.28)."""
    ratio = torch.exp(logp - old_logp)  # (B, T)
    return clipped_surrogate(ratio, adv, 1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high, loss.dual_clip)


def sequence_ratio(logp, old_logp, mask):
    """GSPO's s_i = exp(mean over the response tokens of (log π_θ − log π_old)), shape (B, 1)."""
    n = mask.sum(-1, keepdim=True).clamp_min(1.0)
    return torch.exp(((logp - old_logp) * mask).sum(-1, keepdim=True) / n)


def gspo_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """GSPO: the clip applied to the sequence ratio s_i; ℓ_i is placed on every token of y_i (aggregate with
    seq-mean-token-mean to get the paper's mean over sequences). The advantage is the sequence's (its first
    token's), since GSPO's A_i is per sequence."""
    s = sequence_ratio(logp, old_logp, mask).expand_as(logp)
    seq_adv = adv[torch.arange(adv.shape[0], device=adv.device), _first_token(mask)].unsqueeze(-1).expand_as(adv)
    return clipped_surrogate(s, seq_adv, 1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high, loss.dual_clip)


def gspo_token_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """GSPO-token: s_{i,t} = sg[s_i] · π_θ(y_t)/sg[π_θ(y_t)]: the value of s_i, a per-token gradient, and
    token-level advantages allowed."""
    s = sequence_ratio(logp, old_logp, mask).detach() * torch.exp(logp - logp.detach())
    return clipped_surrogate(s, adv, 1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high, loss.dual_clip)


DCPO_HIGH_CAP = 10.0


def dcpo_bounds(old_prob, eps_low: float, eps_high: float, dual_clip: float | None):
    """DCPO's dynamic-adaptive bounds on ρ for a token whose old probability is q:
    low = ½ + ½·sqrt(max(0, 1 − 4ε_low/q)), high = ½ + ½·sqrt(1 + 4ε_high/q) capped at max(c, 10).
    Rare tokens (small q) get wide bounds, so exploration is not clipped away."""
    q = old_prob.clamp_min(1e-12)
    low = 0.5 + 0.5 * torch.sqrt(torch.clamp(1.0 - 4.0 * eps_low / q, min=0.0))
    high = 0.5 + 0.5 * torch.sqrt(1.0 + 4.0 * eps_high / q)
    return low, torch.clamp(high, max=max(dual_clip or 0.0, DCPO_HIGH_CAP))


def dcpo_objective(logp, old_logp, adv, mask, loss: LossConfig):
    low, high = dcpo_bounds(torch.exp(old_logp), loss.clip_eps_low, loss.clip_eps_high, loss.dual_clip)
    return clipped_surrogate(torch.exp(logp - old_logp), adv, low, high, loss.dual_clip)


def cispo_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """CISPO (MiniMax-M1, 2506.13585): ℓ = −sg(clip(ρ, 1−ε_low, 1+ε_high))·A·log π_θ. The clip bounds the importance
    weight, not the update: every token keeps its gradient −ŵ·A·∇log π_θ (PPO's clip zeroes it beyond the bound). ℓ's
    value is a weighted log-probability, not a surrogate of the return. The masks mark tokens whose weight was
    truncated, whatever A's sign."""
    # verl's guard against an overflowing exp; exact, since the weight is then clipped to [1 − ε_low, 1 + ε_high].
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    low, high = 1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high
    weight = ratio.clamp(min=low, max=high).detach()
    return -weight * adv * logp, ratio < low, ratio > high


def gmpo_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """GMPO (Zhao et al. 2025, 2507.20673): the geometric mean of the token ratios in place of their arithmetic mean.
    Each log-ratio Δ_t is clipped pessimistically in log space (to ε_high above for A > 0, to −ε_low below for A < 0),
    and ℓ_i = −Ā_i·exp(mean over y_i's tokens of the clipped Δ_t), Ā_i the mean of y_i's token advantages (as verl's
    GMPO loss takes it); ℓ_i is placed on every token of y_i (aggregate with seq-mean-token-mean for the paper's mean
    over sequences). No guard on Δ_t: a ±20 clamp here zeroed the gradient of a token the reference keeps (A > 0 and
    Δ_t < −20: unclipped, it still trains), as verl's commented-out one would; the pessimistic clip already bounds the
    side that could overflow for A > 0, and for A < 0 only a mean log-ratio past 88 would."""
    delta = logp - old_logp
    sign = torch.sign(adv)
    clipped = delta.clamp(-loss.clip_eps_low, loss.clip_eps_high)
    pessimistic = sign * torch.minimum(sign * delta, sign * clipped)
    n = mask.sum(-1, keepdim=True).clamp_min(1.0)
    ratio = torch.exp((pessimistic * mask).sum(-1, keepdim=True) / n)
    seq_adv = (adv * mask).sum(-1, keepdim=True) / n
    clipped_high = (delta > loss.clip_eps_high) & (adv > 0)
    clipped_low = (delta < -loss.clip_eps_low) & (adv < 0)
    return (-seq_adv * ratio).expand_as(logp), clipped_low, clipped_high


def sapo_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025, Qwen, 2511.20347): a smooth gate in place of the
    hard clip, ℓ = −f_τ(ρ)·A with f_τ(ρ) = σ(τ(ρ − 1))·4/τ, τ = τ_pos for A > 0 and τ_neg otherwise. f's slope is 1 at
    ρ = 1 (the plain surrogate's gradient there) and decays smoothly away from it, so an off-policy token's gradient
    fades instead of being cut; τ_neg > τ_pos fades negative-advantage tokens faster. As verl's `sapo` loss: no token
    is clipped, so the clip masks are empty."""
    # A guard against an overflowing exp: past e^±20 the gate σ(τ(ρ − 1)) is 0 or 1 to float precision, its gradient 0.
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))
    tau = torch.where(adv > 0, loss.sapo_tau_pos, loss.sapo_tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(ratio, dtype=torch.bool)
    return -gate * adv, none, none


def token_covariance(logp, adv, mask):
    """Per token, (A − mean A)·(log π_θ − mean log π_θ), the means over the micro-batch's response tokens, detached:
    the tokens whose log-probability rises with their advantage, which are what drives the entropy down (Cui et al.
    2025, 2505.22617)."""
    logp = logp.detach()
    return (adv - masked_mean(adv, mask)) * (logp - masked_mean(logp, mask))


def _selection_seed(old_logp, mask) -> int:
    """A seed drawn from the micro-batch itself: Clip-Cov's random pick is then the same wherever the same update
    runs (a replay, a resume), with no generator state to save."""
    digest = hashlib.sha256(old_logp.detach().cpu().to(torch.float64).mul(mask.cpu()).numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little")


def clip_cov_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """Clip-Cov (Cui et al. 2025, 2505.22617): PPO's clip, and among the tokens it leaves alone, a random
    max(1, ⌊r·N⌋) of those whose covariance lies in (lb, ub) get no gradient (N: the micro-batch's response tokens,
    r = loss.cov_ratio). As verl's `clip_cov` loss (which draws from the global generator; here the draw is seeded by
    the micro-batch's old logprobs). The clip masks count every token whose gradient was removed, by the clip or by
    the selection."""
    ratio = torch.exp(logp - old_logp)
    pg, clipped_low, clipped_high = clipped_surrogate(
        ratio, adv, 1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high, None
    )
    cov = token_covariance(logp, adv, mask)
    valid = mask > 0
    candidates = valid & ~(clipped_low | clipped_high) & (cov > loss.clip_cov_lb) & (cov < loss.clip_cov_ub)
    where = torch.nonzero(candidates)
    k = min(max(int(loss.cov_ratio * int(valid.sum())), 1), len(where))
    chosen = torch.zeros_like(valid)
    if k:
        generator = torch.Generator().manual_seed(_selection_seed(old_logp, mask))
        picked = where[torch.randperm(len(where), generator=generator)[:k]]
        chosen[picked[:, 0], picked[:, 1]] = True
    return (
        torch.where(chosen, torch.zeros_like(pg), pg),
        clipped_low | (chosen & (adv < 0)),
        clipped_high | (chosen & (adv >= 0)),
    )


def kl_cov_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """KL-Cov (Cui et al. 2025, 2505.22617): no clip; the max(1, ⌊r·N⌋) tokens of the highest covariance get a KL
    penalty, ℓ = −ρA + k·|log π_θ − log π_old| (k = loss.kl_cov_coef), the others ℓ = −ρA. As verl's `kl_cov` loss.
    The clip masks count the penalised tokens. Exact, as verl's: a ±20 clamp on the log-ratio changed the loss's value
    past it (e^20 for e^21)."""
    delta = logp - old_logp
    pg = -adv * torch.exp(delta)
    valid = mask > 0
    cov = torch.where(valid, token_covariance(logp, adv, mask), torch.full_like(pg, -torch.inf))
    k = min(max(int(loss.cov_ratio * int(valid.sum())), 1), int(valid.sum()))
    chosen = torch.zeros_like(valid)
    if k:
        chosen.view(-1)[torch.topk(cov.view(-1), k).indices] = True
    pg = torch.where(chosen, pg + loss.kl_cov_coef * delta.abs(), pg)
    return pg, chosen & (adv < 0), chosen & (adv >= 0)


def _first_token(mask):
    """Index of each row's first response token (0 for an all-zero row)."""
    return torch.argmax((mask > 0).int(), dim=-1)


OBJECTIVES: Registry = Registry("policy objective")
for _name, _fn in (
    ("clip", clip_objective),
    ("gspo", gspo_objective),
    ("gspo_token", gspo_token_objective),
    ("dcpo", dcpo_objective),
    ("cispo", cispo_objective),
    ("gmpo", gmpo_objective),
    ("sapo", sapo_objective),
    ("clip_cov", clip_cov_objective),
    ("kl_cov", kl_cov_objective),
):
    OBJECTIVES.register(_name)(_fn)

# ---- Aggregation: normalizers span the optimizer minibatch ----------------------------------------------


@dataclass(frozen=True)
class MinibatchNorm:
    """Normalizers of the whole optimizer minibatch, computed before it is split into micro-batches.

    Every aggregation divides by these (or by per-sequence token counts, which a micro-batch holds whole),
    so the sum of micro-batch losses equals the minibatch loss and gradient accumulation never changes the update.
    """

    tokens: float  # Σ mask over the minibatch
    sequences: float  # B: sequences of the minibatch with at least one loss token
    max_len: float = 1.0  # L_max of seq-mean-token-sum-norm (the rollout's max_tokens)


def _seq_token_means(loss, mask):
    return (loss * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)


def token_mean(loss, mask, norm: MinibatchNorm):
    """Σ ℓ·m / Σ m over the minibatch (DAPO): every token weighs the same."""
    return (loss * mask).sum() / max(norm.tokens, 1.0)


def seq_mean_token_mean(loss, mask, norm: MinibatchNorm):
    """Mean over sequences of each sequence's token mean (original GRPO, GSPO)."""
    return _seq_token_means(loss, mask).sum() / max(norm.sequences, 1.0)


def seq_mean_token_sum(loss, mask, norm: MinibatchNorm):
    return (loss * mask).sum() / max(norm.sequences, 1.0)


def seq_mean_token_sum_norm(loss, mask, norm: MinibatchNorm):
    """Σ ℓ·m / (B·L_max) with a constant L_max (Dr.GRPO): no length bias."""
    return (loss * mask).sum() / (max(norm.sequences, 1.0) * norm.max_len)


def only_token_mean(loss, mask, norm: MinibatchNorm):
    """Σ over sequences of each sequence's token mean, with no batch averaging (DCPO)."""
    return _seq_token_means(loss, mask).sum()


# Each aggregation's per-token factor, as a Polars expression over a batch's response lengths, is a capability: what
# `rlpipe compare-advantages` weighs tokens by (length L_i of the response, B responses, N tokens, constant L_max).
@dataclass(frozen=True)
class TokenFactor:
    token_factor: Callable[[float], pl.Expr]  # L_max → the per-token weight, over a batch's `length` column


AGGREGATIONS: Registry = Registry("loss aggregation", TokenFactor)
_LEN = pl.col("length").cast(pl.Float64)
for _name, _fn, _factor in (
    ("token-mean", token_mean, lambda max_len: 1.0 / _LEN.sum()),
    ("seq-mean-token-mean", seq_mean_token_mean, lambda max_len: 1.0 / (pl.len().cast(pl.Float64) * _LEN)),
    ("seq-mean-token-sum", seq_mean_token_sum, lambda max_len: 1.0 / pl.len().cast(pl.Float64)),
    ("seq-mean-token-sum-norm", seq_mean_token_sum_norm, lambda max_len: 1.0 / (pl.len().cast(pl.Float64) * max_len)),
    ("only-token-mean", only_token_mean, lambda max_len: 1.0 / _LEN),
):
    AGGREGATIONS.register(_name, token_factor=_factor)(_fn)


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


# ---- The full policy loss of one micro-batch --------------------------------------------------------------


# verl's SAFETY_BOUND: a token's log π_old − log π_sampler, and a sequence's sum of them, are clamped to it before exp
# (e^20 ≈ 4.9e8: far past any IS cap or rejection bound, so only a weight that would overflow is changed).
LOG_RATIO_BOUND = 20.0


def rollout_correction(old_logp, sampler_logp, mask, loss: LossConfig):
    """The sampler (vLLM, often in bf16) and the trainer disagree on the old policy's probabilities; the ratio
    r_t = π_old/π_sampler corrects for it (docs/algorithms.md, "Rollout correction", as verl's rollout_corr_helper).

    Returns (weights, sums): per-token weights (detached) for the policy loss, the importance weight (rollout_is:
    token, min(r_t, C); sequence, min(Π_t r_t, C) on every token of the response) times 0 where rejection drops the
    token (rollout_rs: token, r_t outside [lower, upper]; sequence, Π_t r_t outside; geometric, (Π_t r_t)^(1/|y|)
    outside) or the veto drops the response (a token with r_t below rollout_veto_threshold); and masked token sums of
    the weights' statistics for train_metrics."""
    log_ratio = ((old_logp - sampler_logp) * mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    seq_sum = (log_ratio * mask).sum(-1, keepdim=True)
    # The sequence's product is clamped before exp (it overflows past e^88); the geometric mean is not: clamping the sum
    # before dividing by the length kept 40 tokens at log-ratio 0.6 (e^0.5 seen) against a 1.7 threshold.
    seq_log = seq_sum.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    valid = mask > 0
    weights = torch.ones_like(log_ratio)
    capped = torch.zeros_like(valid)
    if loss.rollout_is:
        raw = torch.exp(log_ratio if loss.rollout_is == "token" else seq_log.expand_as(log_ratio))
        weights, capped = raw.clamp(max=loss.rollout_is_threshold), raw >= loss.rollout_is_threshold
    kept = valid
    if loss.rollout_rs:
        upper = loss.rollout_rs_threshold
        lower = loss.rollout_rs_threshold_lower or 1.0 / upper
        n = mask.sum(-1, keepdim=True).clamp_min(1.0)
        stat = {"token": log_ratio, "sequence": seq_log, "geometric": seq_sum / n}[loss.rollout_rs].expand_as(log_ratio)
        kept = kept & (stat >= math.log(lower)) & (stat <= math.log(upper))
    vetoed = torch.zeros_like(valid)
    if loss.rollout_veto_threshold:
        vetoed = ((log_ratio < math.log(loss.rollout_veto_threshold)) & valid).any(-1, keepdim=True).expand_as(valid)
    dropped = valid & (~kept | vetoed)
    weights = (weights * (valid & ~dropped)).detach()  # 0 on padding and on what was dropped
    m = mask
    sums = {
        "rollout_is_weight_mean": (weights * m).sum(),
        "rollout_is_capped_fraction": (capped.float() * m).sum(),
        "rollout_rejected_fraction": (dropped.float() * m).sum(),
        "rollout_vetoed_fraction": ((vetoed & valid).float() * m).sum(),
        "rollout_log_ratio_mean": (log_ratio * m).sum(),
    }
    return weights, sums


def high_entropy_tokens(entropy, mask, quantile: float):
    """The response tokens whose entropy is at least the (1 − quantile) quantile of the micro-batch's ("Beyond the
    80/20 rule", Wang et al. 2025, 2506.01939: the top 20% carry the learning). As TRL's `top_entropy_quantile`, over
    the tokens of one micro-batch (TRL gathers them across ranks; here each rank's micro-batch sets its own)."""
    valid = mask > 0
    if quantile >= 1.0 or not valid.any():
        return valid
    threshold = torch.quantile(entropy.detach()[valid].float(), 1.0 - quantile)
    return valid & (entropy.detach() >= threshold)


def off_policy_mask(logp, sampler_logp, adv, mask, threshold: float):
    """DeepSeek-V3.2's off-policy sequence masking (TRL's off_policy_mask_threshold): 0 on every token of a response
    whose advantage is negative and whose mean over its tokens of log π_sampler − log π_θ (π_θ detached) exceeds δ =
    `threshold`, 1 elsewhere, (B, T). A response the policy has already moved away from, and that would be pushed
    further down, is left out rather than let its stale negative signal dominate."""
    n = mask.sum(-1, keepdim=True).clamp_min(1.0)
    drift = ((sampler_logp - logp.detach()) * mask).sum(-1, keepdim=True) / n  # (B, 1)
    negative = (adv * mask).sum(-1, keepdim=True) < 0  # a response's advantage: its tokens share it (GRPO and kin)
    return (~(negative & (drift > threshold))).to(mask.dtype).expand_as(mask)


def policy_loss(
    logp,
    old_logp,
    ref_logp,
    adv,
    mask,
    norm: MinibatchNorm,
    s: LossSettings,
    entropy=None,
    token_weights=None,
    sampler_logp=None,
):
    """Objective (× `token_weights`, e.g. rollout correction's, when given; × the off-policy sequence mask with
    loss.off_policy_mask_threshold, from `sampler_logp`) − c_ent·H (the iteration's coefficient), both only on the
    highest-entropy tokens with loss.top_entropy_quantile < 1, + β·KL (when KL is in the loss, on every token),
    aggregated with minibatch normalizers (every token counts in them, as in TRL).

    Returns (loss, sums): `sums` are masked token sums of diagnostics (detached), for token-weighted
    averaging across micro-batches by the caller.
    """
    aggregate = AGGREGATIONS[s.loss.aggregation]
    pg, clipped_low, clipped_high = OBJECTIVES[s.loss.objective](logp, old_logp, adv, mask, s.loss)
    if token_weights is not None:
        pg = pg * token_weights
    kept = None
    if s.loss.off_policy_mask_threshold is not None:
        kept = off_policy_mask(logp, sampler_logp, adv, mask, s.loss.off_policy_mask_threshold)
        pg = pg * kept
    trained = mask
    if s.loss.top_entropy_quantile < 1.0 and entropy is not None:
        trained = high_entropy_tokens(entropy, mask, s.loss.top_entropy_quantile).to(mask.dtype)
        pg = pg * trained
    kl = KL_ESTIMATORS[s.kl.estimator](logp, ref_logp)
    per_token = pg + s.kl_beta * kl if s.kl_in_loss else pg
    if s.entropy_coef and entropy is not None:  # over the tokens the policy loss trains, as TRL's
        per_token = per_token - s.entropy_coef * entropy * trained
    loss = aggregate(per_token, mask, norm)
    with torch.no_grad():
        sums = {
            "pg_loss": (pg * mask).sum(),
            "kl_ref": (kl_k3(logp, ref_logp) * mask).sum(),
            "ppo_kl": ((old_logp - logp) * mask).sum(),
            "clip_frac_low": (clipped_low.float() * mask).sum(),
            "clip_frac_high": (clipped_high.float() * mask).sum(),
            "entropy_masked_fraction": (mask - trained).sum(),
            **({"off_policy_masked_fraction": ((1.0 - kept) * mask).sum()} if kept is not None else {}),
            "tokens": mask.sum(),
        }
    return loss, sums


# ---- PPO's critic ---------------------------------------------------------------------------------------


def value_loss(values, old_values, returns, mask, value_clip: float, norm: MinibatchNorm):
    """½·max((V − R)², (clip(V, V_old ± ε_v) − R)²), token-mean over the minibatch.

    Returns (loss, clipped_tokens): the second is the count of tokens where the clipped term won.
    """
    clipped = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    plain, clip_sq = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(plain, clip_sq)
    return token_mean(per_token, mask, norm), ((clip_sq > plain).float() * mask).sum().detach()
