"""Stage `batch`: dynamic filtering of groups (DAPO dynamic sampling).

Reads `scores` of every round so far; writes `batch` once the batch is full or the rounds are spent: one row
per group with its reward mean/std, whether it is kept, why not, and how many rounds were used. Groups with
zero reward variance carry no GRPO signal and are dropped (when configured); the first `target_groups` of
the rest are kept, in round order.
"""

from __future__ import annotations

import polars as pl

from schemas.errors import UserError
from storage import StageOutput, read_stage
from tasks.stages.common import Computed, load_run, run_stage, stage_task
from tasks.stages.spec import AnotherRound, StageSpec


class EmptyBatchError(UserError, ValueError):
    pass


def select_groups(scores: pl.DataFrame, target_groups: int, drop_zero_variance: bool) -> pl.DataFrame:
    """One row per group (prompt), in round then first-appearance order, with `kept` and `filter_reason`."""
    groups = (
        scores.group_by("prompt_id", maintain_order=True)
        .agg(
            pl.col("iteration").first(),
            pl.col("round").first(),
            pl.len().cast(pl.Int32).alias("group_size"),
            pl.col("reward").mean().alias("reward_mean"),
            pl.col("reward").std(ddof=1).fill_null(0.0).alias("reward_std"),
            (pl.col("reward").max() - pl.col("reward").min()).alias("_spread"),
        )
        .sort("round", maintain_order=True)
    )
    zero = (pl.col("_spread") == 0) & pl.lit(drop_zero_variance)
    # _rank: 1-based position among the groups that survive the variance filter.
    groups = groups.with_columns(zero.alias("_zero")).with_columns(
        pl.col("_zero").not_().cast(pl.Int32).cum_sum().alias("_rank")
    )
    return groups.with_columns(
        (~pl.col("_zero") & (pl.col("_rank") <= target_groups)).alias("kept"),
        pl.when(pl.col("_zero"))
        .then(pl.lit("zero_variance"))
        .when(pl.col("_rank") > target_groups)
        .then(pl.lit("over_target"))
        .otherwise(pl.lit(""))
        .alias("filter_reason"),
    ).drop("_spread", "_zero", "_rank")


@stage_task("batch")
def batch_task(
    storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict
) -> StageOutput | AnotherRound:
    """The batch when the rounds so far fill it (or the last round is reached), else AnotherRound."""
    ctx = load_run(storage_root, run_id, SPEC)
    b = ctx.cfg.batch
    scores = read_stage(ctx.layout, "scores", iteration).filter(pl.col("round") <= round_)
    groups = select_groups(scores, b.target_groups, b.drop_zero_variance)
    kept = int(groups["kept"].sum())
    last_round = round_ + 1 >= b.max_rounds
    if kept < b.target_groups and not last_round:
        return AnotherRound(f"{kept} of {b.target_groups} groups after {round_ + 1} round(s)")
    if groups.height == 0:  # partial rollouts: every sequence still in flight
        raise EmptyBatchError(
            f"batch: no group of iteration {iteration} ended within batch.max_rounds={b.max_rounds} rounds (the rest "
            "is carried; with rollout.partial_tokens raise batch.max_rounds, so that a round's responses can end)"
        )
    if kept == 0:
        raise EmptyBatchError(
            f"batch: every group of iteration {iteration} was filtered (zero reward variance) after "
            f"batch.max_rounds={b.max_rounds} rounds"
        )

    def compute():
        frame = groups.with_columns(pl.lit(round_ + 1, pl.Int32).alias("rounds_used"))
        dropped = float((groups["filter_reason"] == "zero_variance").mean())
        return Computed(
            frame, extra={"rounds_used": round_ + 1, "kept_groups": kept, "zero_variance_fraction": dropped}
        )

    return run_stage(ctx, iteration, inputs=upstream, compute=compute)


SPEC = StageSpec("batch", reads=("scores",), sections=("batch",), scope="iteration", task=batch_task, rerunnable=True)
