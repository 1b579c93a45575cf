"""Pure torch math for the policy update: KL estimators, policy objectives and loss aggregations.

Three registries, each keyed by the config's Literal names (DESIGN §5). No I/O, no engines.
Shapes: B sequences × T response positions; `mask` is 1.0 on real response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# ---- KL estimators: lr = log π_θ − log π_ref, per token --------------------------------------------------

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def _kl(name):
    def wrap(fn):
        KL_ESTIMATORS[name] = fn
        return fn

    return wrap


@_kl("k1")
def kl_k1(logp, ref_logp):
    return logp - ref_logp


@_kl("k2")
def kl_k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp) ** 2


@_kl("k3")
def kl_k3(logp, ref_logp):
    lr = logp - ref_logp
    return torch.exp(-lr) - 1 + lr


@_kl("k3+")
def kl_k3_plus(logp, ref_logp):
    """k3's value with k2's gradient (unbiased gradient of KL), as k2 − sg(k2) + sg(k3)."""
    k2 = kl_k2(logp, ref_logp)
    return k2 - k2.detach() + kl_k3(logp, ref_logp).detach()


# ---- Policy objectives: per-token loss ℓ and clip statistics --------------------------------------------


@dataclass(frozen=True)
class ClipSettings:
    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None


def clip_objective(logp, old_logp, adv, settings: ClipSettings):
    """PPO clip: ℓ = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)·A), with optional dual-clip for A < 0.

    Returns (ℓ, clipped_low, clipped_high): the masks of tokens whose gradient the clip removed.
    """
    ratio = torch.exp(logp - old_logp)  # (B, T)
    low, high = 1.0 - settings.eps_low, 1.0 + settings.eps_high
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, low, high) * adv
    loss = -torch.minimum(unclipped, clipped)
    if settings.dual_clip is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -settings.dual_clip * adv), loss)
    clipped_high = (ratio > high) & (adv > 0)
    clipped_low = (ratio < low) & (adv < 0)
    return loss, clipped_low, clipped_high


OBJECTIVES = {"clip": clip_objective}

# ---- Aggregation: normalizers span the optimizer minibatch ----------------------------------------------


@dataclass(frozen=True)
class MinibatchNorm:
    """Normalizers of the whole optimizer minibatch, computed before it is split into micro-batches.

    Every aggregation divides by these, so the sum of micro-batch losses equals the minibatch loss and
    gradient accumulation never changes the update.
    """

    tokens: float  # Σ mask over the minibatch
    sequences: float  # B of the minibatch


def token_mean(loss, mask, norm: MinibatchNorm):
    return (loss * mask).sum() / max(norm.tokens, 1.0)


AGGREGATIONS = {"token-mean": token_mean}


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


# ---- The full policy loss of one micro-batch --------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossSettings:
    objective: str = "clip"
    aggregation: str = "token-mean"
    clip: ClipSettings = ClipSettings()
    kl_estimator: str = "k3"
    kl_in_loss: bool = True
    kl_beta: float = 0.04


def policy_loss(logp, old_logp, ref_logp, adv, mask, norm: MinibatchNorm, s: PolicyLossSettings):
    """Objective + β·KL (when KL is in the loss), aggregated with minibatch normalizers.

    Returns (loss, sums): `sums` are masked token sums of diagnostics (detached), for token-weighted
    averaging across micro-batches by the caller.
    """
    aggregate = AGGREGATIONS[s.aggregation]
    pg, clipped_low, clipped_high = OBJECTIVES[s.objective](logp, old_logp, adv, s.clip)
    kl = KL_ESTIMATORS[s.kl_estimator](logp, ref_logp)
    per_token = pg + s.kl_beta * kl if s.kl_in_loss else pg
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
