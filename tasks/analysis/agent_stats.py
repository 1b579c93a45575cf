"""Multi-turn runs, per iteration (for `show` and the report): the model's turns, tool calls and the share that
failed, the environment's reward (per trajectory, 0 where it never stepped), and how trajectories ended."""

from __future__ import annotations

import polars as pl

COLUMNS = ("turns", "tool_call_rate", "calls", "call_errors", "env_reward", "max_turns", "truncated", "failed")


def per_iteration(rollouts: pl.DataFrame) -> pl.DataFrame | None:
    """None for single-turn rollouts."""
    if "action_mask" not in rollouts.columns:
        return None
    return (
        rollouts.group_by("iteration")
        .agg(
            pl.col("turns").mean().alias("turns"),
            (pl.col("tool_calls") > 0).mean().alias("tool_call_rate"),
            pl.col("tool_calls").mean().alias("calls"),
            (pl.col("tool_errors").sum() / pl.col("tool_calls").sum().clip(1)).alias("call_errors"),
            # A trajectory the environment never stepped (it ended first) earned nothing from it, as a reward function
            # reading `env_reward or 0.0` counts it; a run without an environment has none at all (null).
            pl.when(pl.col("env_reward").is_not_null().any())
            .then(pl.col("env_reward").fill_null(0.0).mean())
            .alias("env_reward"),
            (pl.col("finish_reason") == "max_turns").mean().alias("max_turns"),
            pl.col("truncated").mean().alias("truncated"),
            pl.col("agent_error").is_not_null().mean().alias("failed"),
        )
        .sort("iteration")
    )
