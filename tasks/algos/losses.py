"""Pure torch math for the policy update: policy objectives and loss aggregations (KL estimators: tasks/algos/kl.py).

One registry per family, keyed by the config's Literal names (docs/algorithms.md). No I/O, no engines.
Shapes: B sequences × T response positions; `mask` is 1.0 on real response tokens.
"""

from __future__ import annotations

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
    seq_adv = adv[torch.arange(adv.shape[0]), _first_token(mask)].unsqueeze(-1).expand_as(adv)
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
    ratio = torch.exp((logp - old_logp).clamp(-20.0, 20.0))  # verl's guard against an overflowing exp
    low, high = 1.0 - loss.clip_eps_low, 1.0 + loss.clip_eps_high
    weight = ratio.clamp(min=low, max=high).detach()
    return -weight * adv * logp, ratio < low, ratio > high


def gmpo_objective(logp, old_logp, adv, mask, loss: LossConfig):
    """GMPO (Zhao et al. 2025, 2507.20673): the geometric mean of the token ratios in place of their arithmetic mean.
    Each log-ratio Δ_t is clipped pessimistically in log space (to ε_high above for A > 0, to −ε_low below for A < 0),
    and ℓ_i = −Ā_i·exp(mean over y_i's tokens of the clipped Δ_t), Ā_i the mean of y_i's token advantages (as verl's
    GMPO loss takes it); ℓ_i is placed on every token of y_i (aggregate with seq-mean-token-mean for the paper's mean
    over sequences)."""
    delta = (logp - old_logp).clamp(-20.0, 20.0)
    sign = torch.sign(adv)
    clipped = delta.clamp(-loss.clip_eps_low, loss.clip_eps_high)
    pessimistic = sign * torch.minimum(sign * delta, sign * clipped)
    n = mask.sum(-1, keepdim=True).clamp_min(1.0)
    ratio = torch.exp((pessimistic * mask).sum(-1, keepdim=True) / n)
    seq_adv = (adv * mask).sum(-1, keepdim=True) / n
    clipped_high = (delta > loss.clip_eps_high) & (adv > 0)
    clipped_low = (delta < -loss.clip_eps_low) & (adv < 0)
    return (-seq_adv * ratio).expand_as(logp), clipped_low, clipped_high


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


def tis_weights(old_logp, sampler_logp, cap: float):
    """Truncated importance sampling: min(π_old/π_sampler, C) per token, detached. The sampler (vLLM, often in bf16)
    and the trainer disagree on the old policy's probabilities; weighting each token's policy loss by their ratio
    corrects the off-policy gap, and the cap bounds the variance (Yao et al. 2025)."""
    return torch.clamp(torch.exp(old_logp - sampler_logp), max=cap).detach()


def policy_loss(
    logp, old_logp, ref_logp, adv, mask, norm: MinibatchNorm, s: LossSettings, entropy=None, token_weights=None
):
    """Objective (× `token_weights`, e.g. TIS, when given) + β·KL (when KL is in the loss) − c_ent·H, aggregated with
    minibatch normalizers.

    Returns (loss, sums): `sums` are masked token sums of diagnostics (detached), for token-weighted
    averaging across micro-batches by the caller.
    """
    aggregate = AGGREGATIONS[s.loss.aggregation]
    pg, clipped_low, clipped_high = OBJECTIVES[s.loss.objective](logp, old_logp, adv, mask, s.loss)
    if token_weights is not None:
        pg = pg * token_weights
    kl = KL_ESTIMATORS[s.kl.estimator](logp, ref_logp)
    per_token = pg + s.kl_beta * kl if s.kl_in_loss else pg
    if s.loss.entropy_coef and entropy is not None:
        per_token = per_token - s.loss.entropy_coef * entropy
    loss = aggregate(per_token, mask, norm)
    with torch.no_grad():
        sums = {
            "pg_loss": (pg * mask).sum(),
            "kl_ref": (kl_k3(logp, ref_logp) * mask).sum(),
            "ppo_kl": ((old_logp - logp) * mask).sum(),
            "clip_frac_low": (clipped_low.float() * mask).sum(),
            "clip_frac_high": (clipped_high.float() * mask).sum(),
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
