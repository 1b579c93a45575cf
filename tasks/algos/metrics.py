"""Per-iteration training metrics computed from the stage tables, and a process reward model's held-out figures (the
prm_eval stage's manifest): pure Polars, no I/O. A stage reads its metrics here, never from tasks/analysis."""

from __future__ import annotations

import polars as pl


def rollout_metrics(rollouts: pl.DataFrame, scores: pl.DataFrame, batch: pl.DataFrame) -> dict[str, float]:
    """Reward, length and filtering statistics over every rollout of the iteration (all rounds)."""
    out = {
        "reward_mean": scores["reward"].mean(),
        "reward_std": scores["reward"].std(),
        "response_length_mean": rollouts["length"].mean(),
        "response_length_max": float(rollouts["length"].max()),
        "truncation_rate": rollouts["truncated"].mean(),
        "zero_std_group_fraction": float((batch["reward_std"] == 0).mean()),
        "rounds_used": float(batch["rounds_used"].max()),
        "kept_groups": float(batch["kept"].sum()),
        "reward_error_rate": float(scores["error"].is_not_null().mean()),
    }
    for col in scores.columns:
        if col.startswith("score_"):
            out[f"{col}_mean"] = scores[col].mean()
    if {"score_model", "score_accuracy"} <= set(scores.columns):
        # How well the reward model ranks what the rule judges: the signal that it is still a good proxy.
        out["reward_model_rule_spearman"] = spearman(scores, "score_model", "score_accuracy")
    return {k: float(v) if v is not None else float("nan") for k, v in out.items()}


def spearman(frame: pl.DataFrame, a: str, b: str) -> float:
    """Rank correlation of two columns; NaN when it is undefined (a constant column)."""
    rho = frame.select(pl.corr(a, b, method="spearman")).item()
    return float(rho) if rho is not None else float("nan")


def sampler_gap(rollouts: pl.DataFrame, logprobs: pl.DataFrame) -> float:
    """Mean |log π_sampler − log π_old| over response tokens: how far vLLM's numbers are from the trainer's."""
    joined = logprobs.join(
        rollouts.select("prompt_id", "sample_idx", "sampler_logprobs"), on=["prompt_id", "sample_idx"]
    )
    diff = joined.select((pl.col("sampler_logprobs").explode() - pl.col("old_logprobs").explode()).abs().mean()).item()
    return float(diff) if diff is not None else float("nan")


def advantage_metrics(advantages: pl.DataFrame) -> dict[str, float]:
    return {
        "nonzero_advantage_fraction": float((advantages["advantage"] != 0).mean()),
        "advantage_abs_mean": float(advantages["advantage"].abs().mean()),
    }


def explained_variance(advantages: pl.DataFrame, logprobs: pl.DataFrame) -> float:
    """1 − Var(R − V)/Var(R) over response tokens: how much of the returns the critic's values explain."""
    joined = advantages.select("prompt_id", "sample_idx", "returns").join(
        logprobs.select("prompt_id", "sample_idx", "values"), on=["prompt_id", "sample_idx"]
    )
    tokens = joined.select(pl.col("returns").explode().cast(pl.Float64), pl.col("values").explode().cast(pl.Float64))
    var_r = tokens["returns"].var()
    if not var_r:
        return float("nan")
    return float(1.0 - (tokens["returns"] - tokens["values"]).var() / var_r)


def label_prior(answers: pl.Series) -> float | None:
    """The accuracy of always giving the most common answer: its share of all the answers (an empty or null answer is
    no label, but counts in the total); None when there is no label. The control a held-out accuracy is read against:
    50 "Yes" among 64 answers give 0.781 to a model that only ever says "Yes"."""
    labels = answers.drop_nulls().filter(answers.drop_nulls() != "")
    if labels.is_empty():
        return None
    return float(labels.value_counts(sort=True)["count"][0] / answers.len())


def auc(scores: pl.Series, labels: pl.Series) -> float | None:
    """P(score of a positive > score of a negative), ties ½ (Mann–Whitney U over n₊·n₋, from average ranks); None when
    one class is empty."""
    positives = int(labels.sum())
    negatives = labels.len() - positives
    if not positives or not negatives:
        return None
    ranks = scores.rank("average")
    rank_sum = float(ranks.filter(labels).sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


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


def split_by_source(figures: dict) -> dict[str, dict]:
    """An eval manifest's per-source figures (`accuracy/<source>`, ...) as {source: {figure: value}}, sources sorted;
    {} when the dataset names no sources."""
    out: dict[str, dict] = {}
    for key, value in figures.items():
        if "/" in key:
            name, source = key.split("/", 1)
            out.setdefault(source, {})[name] = value
    return dict(sorted(out.items()))
