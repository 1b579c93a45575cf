"""Advantage estimators as Polars expressions over the stage tables (DESIGN §5).

Reads `scores` (reward per sample), `batch` (kept groups) and `logprobs` (response lengths); writes
`advantages`: the sequence advantage, the per-token advantages and the returns.

Edge rules (tested): a single-sample group has no spread, so its advantage is 0; a group whose rewards are
all equal has r − mean = 0, so its advantage is 0 as well (whatever ε_adv is).
"""

from __future__ import annotations

from typing import Callable

import polars as pl

ADVANTAGE_ESTIMATORS: dict[str, Callable[[pl.DataFrame, float], pl.DataFrame]] = {}


def register(name: str):
    def wrap(fn):
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return wrap


def _centered() -> pl.Expr:
    """r − mean_g r, exactly 0 for a group whose rewards are all equal (float means are not exact)."""
    r = pl.col("reward")
    equal = (r.max() == r.min()).over("prompt_id")
    return pl.when(equal).then(0.0).otherwise(r - r.mean().over("prompt_id"))


@register("grpo")
def grpo(scores: pl.DataFrame, eps: float) -> pl.DataFrame:
    """A_i = (r_i − mean_g r) / (std_g r + ε), std unbiased (ddof=1)."""
    std = pl.col("reward").std(ddof=1).over("prompt_id")
    adv = (_centered() / (std + eps)).fill_null(0.0).fill_nan(0.0)
    return scores.with_columns(adv.alias("advantage"))


def broadcast_to_tokens(df: pl.DataFrame, length_col: str = "length") -> pl.DataFrame:
    """Sequence-level advantage on every response token; returns equal advantages when there is no critic."""
    tokens = pl.col("advantage").cast(pl.Float32).repeat_by(pl.col(length_col))
    return df.with_columns(tokens.alias("token_advantages"), tokens.alias("returns"))


def compute_advantages(scores: pl.DataFrame, lengths: pl.DataFrame, estimator: str, eps: float) -> pl.DataFrame:
    """scores: prompt_id, sample_idx, reward (kept groups only); lengths: prompt_id, sample_idx, length."""
    per_seq = ADVANTAGE_ESTIMATORS[estimator](scores, eps)
    joined = per_seq.join(lengths, on=["prompt_id", "sample_idx"], how="inner", validate="1:1")
    return broadcast_to_tokens(joined)


# ---- Stage task ------------------------------------------------------------------------------------------


from storage import StageOutput, read_stage  # noqa: E402
from tasks.common import Computed, stage_task, load_run, run_stage  # noqa: E402


@stage_task("advantages")
def advantages_task(storage_root: str, run_id: str, iteration: int, logprobs_fp: str, batch_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    a = ctx.cfg.advantage

    def compute():
        kept = read_stage(ctx.layout, "batch", iteration).filter("kept").select("prompt_id")
        scores = read_stage(ctx.layout, "scores", iteration).join(kept, on="prompt_id", how="semi")
        lengths = read_stage(ctx.layout, "rollouts", iteration).select("prompt_id", "sample_idx", "length")
        df = compute_advantages(scores.select("iteration", "prompt_id", "sample_idx", "reward"), lengths, a.estimator, a.eps)
        nonzero = float((df["advantage"] != 0).mean())
        return Computed(df.drop("length"), extra={"nonzero_advantage_fraction": nonzero})

    return run_stage(
        ctx, "advantages", iteration, sections=("advantage",),
        inputs={"logprobs": logprobs_fp, "batch": batch_fp}, compute=compute,
    )
