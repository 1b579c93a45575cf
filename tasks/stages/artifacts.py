"""The Prefect artifact of one iteration: its metrics, its reward distribution and three sample rollouts
(markdown). They show in the Prefect UI on the iteration's flow run; the data stays in Parquet.
Imports: Prefect's artifacts inside the task (the module is imported by the CLI's checks too)."""

from __future__ import annotations

import polars as pl

from storage import read_stage
from tasks.stages.common import load_run, stage_task
from tasks.stages.partial_rollouts import source_prompts


def reward_summary_markdown(scores: pl.DataFrame) -> str:
    cols = ["reward"] + [c for c in scores.columns if c.startswith("score_")]
    lines = ["| column | mean | std | min | max |", "|---|---|---|---|---|"]
    for c in cols:
        s = scores[c]
        lines.append(f"| {c} | {s.mean():.4f} | {s.std() or 0.0:.4f} | {s.min():.4f} | {s.max():.4f} |")
    hist = scores.group_by("reward").len().sort("reward")
    lines += ["", "| reward | responses |", "|---|---|"] + [f"| {r:.4g} | {n} |" for r, n in hist.iter_rows()]
    errors = scores["error"].drop_nulls()
    lines += ["", f"reward-function errors: {errors.len()} of {scores.height}"]
    return "\n".join(lines)


def samples_markdown(prompts: pl.DataFrame, rollouts: pl.DataFrame, scores: pl.DataFrame, n: int = 3) -> str:
    """The first n rollouts of the iteration with their prompt, answer, response and reward."""
    keys = ["prompt_id", "sample_idx"]
    rows = (
        rollouts.select(*keys, "text", "finish_reason")
        .head(n)
        .join(scores.select(*keys, "reward"), on=keys)
        .join(prompts.select("prompt_id", pl.col("text").alias("prompt"), "answer"), on="prompt_id")
    )
    out = []
    for r in rows.iter_rows(named=True):
        out.append(
            f"**{r['prompt_id']} #{r['sample_idx']}** prompt `{r['prompt']}` answer `{r['answer']}` → "
            f"`{r['text']}` ({r['finish_reason']}), reward {r['reward']:.3f}"
        )
    return "\n\n".join(out)


def metrics_markdown(metrics: dict) -> str:
    rows = [f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()]
    return "\n".join(["| metric | value |", "|---|---|", *rows])


@stage_task("artifacts")
def artifacts_task(storage_root: str, run_id: str, iteration: int) -> None:
    """One markdown artifact per iteration (one API call: three took 0.35 s of a 5.7 s demo iteration)."""
    from prefect.artifacts import create_markdown_artifact

    ctx = load_run(storage_root, run_id)
    layout = ctx.layout
    key = f"{run_id}-iter-{iteration}".lower().replace("_", "-").replace(".", "-")
    metrics = read_stage(layout, "train_metrics", iteration).row(0, named=True)
    scores = read_stage(layout, "scores", iteration)
    rollouts = read_stage(layout, "rollouts", iteration)
    prompts = source_prompts(layout, rollouts, read_stage(layout, "prompts", iteration), iteration)
    samples = samples_markdown(prompts, rollouts, scores)
    body = "\n\n".join(
        [
            "## Metrics",
            metrics_markdown(metrics),
            "## Reward distribution (every rollout of the iteration)",
            reward_summary_markdown(scores),
            "## Sample rollouts",
            samples,
        ]
    )
    create_markdown_artifact(body, key=key, description=f"{run_id} iteration {iteration}: metrics, rewards, samples")
