"""`rlpipe judge-agreement`: how well each LLM judge of a run agrees with a rule reward, on the run's scored samples.

The label is a reward function's score (a response is right when it reaches the threshold, eval.judge_threshold by
default). Per judge, over the samples whose reply it could read: AUC (the probability that a right response is
scored above a wrong one, ties counting half: 0.5 is chance), agreement (the judge's score ≥ 0.5 against the
label), its mean score on right and on wrong responses; and, apart, how many of its replies were errors. A new
judge is measured on saved rollouts first, with `rlpipe rerun --stage scores --fork` adding it
(docs/reward-sources.md), before any RL is run against it.
"""

from __future__ import annotations

import polars as pl
from rich.console import Console
from rich.table import Table

from schemas.errors import NotFound
from storage import read_manifest, read_stage
from tasks.algos.metrics import auc


def agreement_table(scores: pl.DataFrame, judges: list[str], label: str, threshold: float) -> pl.DataFrame:
    """One row per judge: `samples` it scored (iterations scored before it was added have no score of it), of which
    `errors` had no readable reply; the statistics are over the rest whose label is known (score_<label> not null;
    an error's score of 0 is not the judge's opinion)."""
    rows = []
    for name in judges:
        scored = scores.filter(pl.col(f"score_{name}").is_not_null())
        read = scored.filter(pl.col(f"error_{name}").is_null() & pl.col(f"score_{label}").is_not_null())
        value, right = read[f"score_{name}"], read[f"score_{label}"] >= threshold
        rows.append(
            {
                "judge": name,
                "samples": scored.height,
                "errors": int(scored[f"error_{name}"].is_not_null().sum()),
                "right_share": right.mean(),
                "auc": auc(value, right),
                "agreement": ((value >= 0.5) == right).mean(),
                "mean_right": value.filter(right).mean(),
                "mean_wrong": value.filter(~right).mean(),
            }
        )
    floats = ("right_share", "auc", "agreement", "mean_right", "mean_wrong")
    return pl.DataFrame(rows, schema_overrides=dict.fromkeys(floats, pl.Float64))


def judge_agreement(run_id: str, label: str | None, iteration: int | None, root: str) -> pl.DataFrame:
    from tasks.stages.common import load_run

    ctx = load_run(root, run_id)
    label = label or ctx.cfg.eval.judge
    iterations = [iteration] if iteration is not None else range(1, ctx.cfg.rl.iterations + 1)
    done = [k for k in iterations if read_manifest(ctx.layout, "scores", k, verify=False) is not None]
    if not done:
        which = f" for iteration {iteration}" if iteration is not None else ""
        raise NotFound(f"run {run_id!r} has no scores{which}")
    scores = pl.concat([read_stage(ctx.layout, "scores", k) for k in done], how="diagonal_relaxed")
    judges = [c.removeprefix("judge_text_") for c in scores.columns if c.startswith("judge_text_")]
    if not judges:
        raise NotFound(f"run {run_id!r} has no judge's scores (reward.judges)")
    if f"score_{label}" not in scores.columns:
        raise NotFound(f"run {run_id!r} has no score_{label} to label the samples with (--label)")
    table = agreement_table(scores, judges, label, ctx.cfg.eval.judge_threshold)
    out = Table(title=f"{run_id}: judges against {label} ≥ {ctx.cfg.eval.judge_threshold:g}, iterations {done}")
    out.add_column("judge", no_wrap=True, min_width=max(map(len, judges)))  # whole names, even in 80 columns
    for column in table.columns[1:]:
        out.add_column(column.replace("_", " ").replace("agreement", "agree"), justify="right")
    for row in table.iter_rows():
        out.add_row(*(_cell(v) for v in row))
    Console().print(out)
    return table


def _cell(value) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
