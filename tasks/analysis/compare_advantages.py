"""`rlpipe compare-advantages`: every requested estimator on one iteration's saved rollouts, no generation.

The rows are every group scored in that iteration (all sampling rounds, before the batch filter), so an
estimator that keeps zero-variance groups (dcpo) is compared on the same footing as one that does not. The
KL penalty is left out (it is the same for every estimator). dcpo's prompt history is the run's own
`prompt_stats` when it has one, or else is replayed from the scores of the earlier iterations.
Imports: The stage modules are imported inside the command: `rlpipe --help` imports none of them.
"""

from __future__ import annotations

import polars as pl
from rich.console import Console
from rich.table import Table

from schemas.config import ConfigError
from schemas.errors import NotFound
from storage import read_manifest, read_stage, verified_parts


def _history(ctx, iteration: int) -> pl.DataFrame:
    from tasks.algos.advantages import empty_prompt_stats, update_prompt_stats
    from tasks.stages.advantages import advantage_inputs

    if iteration > 1 and read_manifest(ctx.layout, "prompt_stats", iteration - 1) is not None:
        return read_stage(ctx.layout, "prompt_stats", iteration - 1)
    history = empty_prompt_stats()
    for k in range(1, iteration):
        if read_manifest(ctx.layout, "scores", k, verify=False) is not None:
            history = update_prompt_stats(history, advantage_inputs(ctx, k, kept_only=False), k)
    return history


def compare_advantages(run_id: str, iteration: int, estimators: list[str], aggregation: str | None, root: str) -> dict:
    from tasks.algos.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
    from tasks.algos.losses import AGGREGATIONS
    from tasks.analysis.advantage_analysis import estimator_summary
    from tasks.stages.advantages import advantage_inputs, settings_from
    from tasks.stages.common import load_run

    ctx = load_run(root, run_id)  # validates the run id too
    entries = [ADVANTAGE_ESTIMATORS.entry(e) for e in estimators]  # an unknown name: one line listing the choices
    critics = [e.name for e in entries if e.needs_critic]
    if critics:
        raise ConfigError(
            f"{critics[0]} needs a critic's values for every response; compare-advantages covers the critic-free "
            f"estimators"
        )
    aggregation = aggregation or ctx.cfg.loss.aggregation
    AGGREGATIONS.entry(aggregation)  # an unknown name: one line listing the choices
    if read_manifest(ctx.layout, "scores", iteration, verify=False) is None:
        raise NotFound(f"run {run_id!r} has no scores for iteration {iteration}")
    # What it reads, each part checked against its manifest.
    verified_parts(
        ctx.layout, [(stage, k) for k in range(1, iteration + 1) for stage in ("scores", "rollouts", "prompt_stats")]
    )
    df = advantage_inputs(
        ctx,
        iteration,
        kept_only=False,
        components=any(e.needs_components for e in entries),
        steps=any(e.needs_steps for e in entries),
    ).sort("prompt_id", "sample_idx")
    settings = settings_from(ctx.cfg)  # no KL: the estimators themselves are compared
    history = _history(ctx, iteration) if any(e.keeps_prompt_state for e in entries) else None
    reference = compute_advantages(df, "grpo", settings)["advantage"]
    max_len = ctx.cfg.rollout.max_tokens
    results = {}
    for name in estimators:
        out = compute_advantages(df, name, settings, history)
        results[name] = estimator_summary(out.select("advantage", "length"), reference, aggregation, max_len)
    _print(results, run_id, iteration, df, aggregation)
    return results


def _print(results: dict, run_id: str, iteration: int, df: pl.DataFrame, aggregation: str) -> None:
    out = Console()
    groups = df["prompt_id"].n_unique()
    head = Table(
        title=f"{run_id} iteration {iteration}: {df.height} responses in {groups} groups (all rounds, before filtering)"
    )
    for col in ("estimator", "non-zero A", "mean |A|", "corr with grpo"):
        head.add_column(col, justify="right")
    for name, r in results.items():
        head.add_row(name, f"{r['nonzero_fraction']:.3f}", f"{r['mean_abs']:.4f}", f"{r['corr_grpo']:.3f}")
    out.print(head)
    buckets = next(iter(results.values()))["weight_by_length"]
    weights = Table(title=f"effective weight per token (|A| × {aggregation} normaliser), by response length")
    weights.add_column("estimator")
    for bucket, n in zip(buckets["bucket"], buckets["responses"]):
        weights.add_column(f"len {bucket} (n={n})", justify="right")
    for name, r in results.items():
        weights.add_row(name, *(f"{w:.3e}" for w in r["weight_by_length"]["weight"]))
    out.print(weights)
