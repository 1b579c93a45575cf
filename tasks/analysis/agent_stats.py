"""Multi-turn runs, per iteration (for `show` and the report): the model's turns, tool calls and the share that
failed, the environment's reward, and how trajectories ended."""

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
            pl.col("env_reward").mean().alias("env_reward"),
            (pl.col("finish_reason") == "max_turns").mean().alias("max_turns"),
            pl.col("truncated").mean().alias("truncated"),
            pl.col("agent_error").is_not_null().mean().alias("failed"),
        )
        .sort("iteration")
    )
