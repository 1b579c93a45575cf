"""The coefficients of an iteration's loss that may adapt between iterations (docs/algorithms.md): the KL's β, fixed or
Ziegler et al.'s adaptive controller, and the entropy bonus's, fixed or stepped toward a target entropy. Each is a pure
function of the previous iteration's `train_metrics`, so a rerun or a replay of an update gets the same value."""

from __future__ import annotations

from storage import read_stage
from tasks.stages.common import RunContext


def adapt_beta(beta: float, kl: float, target: float, n: int, horizon: int) -> float:
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon): raise β when KL overshoots the target, lower it
    when under, by at most 20% of n/horizon per update."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n / horizon)


def kl_beta(ctx: RunContext, iteration: int) -> float:
    """β for `iteration` (0 when the run uses no KL), from the previous iteration's recorded β, KL to ref and
    sample count."""
    k = ctx.cfg.kl
    if k.placement == "none":
        return 0.0
    if k.target is None or iteration <= 1:
        return k.beta
    prev = read_stage(ctx.layout, "train_metrics", iteration - 1).row(0, named=True)
    return adapt_beta(prev["kl_beta"], prev["kl_ref"], k.target, int(prev["samples"]), k.horizon)


def adapt_entropy_coef(coef: float, entropy: float, target: float, delta: float, low: float, high: float) -> float:
    """One step of TRL's adaptive entropy controller (Skywork-OR1): up by δ when the entropy was at or below the
    target, down by δ when above, within [low, high]."""
    return min(coef + delta, high) if entropy <= target else max(coef - delta, low)


def entropy_coef(ctx: RunContext, iteration: int) -> float:
    """The entropy bonus's coefficient for `iteration`: loss.entropy_coef, or with loss.entropy_target the controller's
    step from the previous iteration's coefficient and mean token entropy. TRL steps it at every optimizer step and
    applies it only while the entropy is below the target; here it steps once an iteration (from tables already on
    disk, which keeps updates replayable) and is always applied, moving toward 0 while the entropy is above target."""
    loss = ctx.cfg.loss
    if loss.entropy_target is None or iteration <= 1:
        return loss.entropy_coef
    prev = read_stage(ctx.layout, "train_metrics", iteration - 1).row(0, named=True)
    return adapt_entropy_coef(
        prev["entropy_coef"],
        prev["entropy"],
        loss.entropy_target,
        loss.entropy_coef_delta,
        loss.entropy_coef_min,
        loss.entropy_coef_max,
    )
