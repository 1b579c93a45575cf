"""A process reward model's held-out figures (the prm_eval stage's manifest). Pure: no I/O."""

from __future__ import annotations

import polars as pl

from tasks.analysis.judge_agreement import auc


def prm_summary(df: pl.DataFrame) -> dict:
    """Held-out figures of a PRM: per step, accuracy at 0.5 against always answering the majority label, and AUC; per
    response, right meaning every step right, the AUC of its weakest step's score and its accuracy at 0.5."""
    flat = df.select(pl.col("step_labels").explode().alias("y"), pl.col("step_scores").explode().alias("p"))
    per = df.select(
        pl.col("step_labels").list.min().alias("y"), pl.col("step_scores").list.min().alias("p")
    ).drop_nulls()
    majority = float(max(flat["y"].mean(), 1 - flat["y"].mean())) if flat.height else None
    return {
        "steps": flat.height,
        "step_accuracy": float(((flat["p"] >= 0.5).cast(pl.Float64) == flat["y"]).mean()) if flat.height else None,
        "step_majority_accuracy": majority,
        "step_auc": auc(flat["p"], flat["y"] >= 0.5),
        "responses": per.height,
        "response_accuracy": float(((per["p"] >= 0.5).cast(pl.Float64) == per["y"]).mean()) if per.height else None,
        "response_auc": auc(per["p"], per["y"] >= 0.5),
    }
