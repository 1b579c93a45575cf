"""Counterfactual advantage statistics: several estimators on the same saved rollouts (pure Polars).

Used by `rlpipe compare-advantages`. The effective weight of a token is what the aggregation multiplies its
gradient by: |A_i| times the aggregation's normaliser for a response of length L_i in a batch of B
responses and N tokens (token-mean 1/N, seq-mean-token-mean 1/(B·L_i), seq-mean-token-sum 1/B,
seq-mean-token-sum-norm 1/(B·L_max), only-token-mean 1/L_i).
Imports: the losses module (torch) inside the one function that needs its aggregations.
"""

from __future__ import annotations

import polars as pl

LENGTH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


def token_normaliser(aggregation: str, max_len: int) -> pl.Expr:
    """The aggregation's per-token factor for each response, as an expression over `length` (declared with the
    aggregation itself, tasks/algos/losses.py)."""
    from tasks.algos.losses import AGGREGATIONS

    return AGGREGATIONS.entry(aggregation).token_factor(max_len)


def length_bucket() -> pl.Expr:
    """`1`, `2-3`, `4-7`, …: powers of two, so short and long responses land in separate rows."""
    expr = pl.lit(f">{LENGTH_BUCKETS[-1]}")
    for lo, hi in reversed(list(zip(LENGTH_BUCKETS, LENGTH_BUCKETS[1:]))):
        label = str(lo) if hi - lo == 1 else f"{lo}-{hi - 1}"
        expr = pl.when(pl.col("length") < hi).then(pl.lit(label)).otherwise(expr)
    return expr


def estimator_summary(df: pl.DataFrame, reference: pl.Series, aggregation: str, max_len: int) -> dict:
    """df: one estimator's advantages (prompt_id, sample_idx, advantage, length), in the same row order as
    `reference` (grpo's advantages). Returns the headline numbers and the weight per length bucket."""
    weights = df.with_columns(
        (pl.col("advantage").abs() * token_normaliser(aggregation, max_len)).alias("weight"),
        length_bucket().alias("bucket"),
    )
    by_bucket = (
        weights.group_by("bucket")
        .agg(pl.col("weight").mean(), pl.col("length").min().alias("_order"), pl.len().alias("responses"))
        .sort("_order")
        .drop("_order")
    )
    adv = df["advantage"]
    corr = pl.DataFrame({"a": adv, "b": reference}).select(pl.corr("a", "b")).item()
    return {
        "nonzero_fraction": float((adv != 0).mean()),
        "mean_abs": float(adv.abs().mean()),
        "corr_grpo": float(corr) if corr is not None else float("nan"),
        "weight_by_length": by_bucket,
    }
