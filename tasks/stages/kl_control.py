"""The KL coefficient β of an iteration: fixed, or Ziegler et al.'s adaptive controller (docs/algorithms.md)."""

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
