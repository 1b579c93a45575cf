"""Tripwires (`rl.tripwires`, tasks/algos/tripwires.py): after each RL iteration (and its eval, when one is due), the
figures of every rule from the iteration's `rollouts`, `prompts` (their sources), the run's `train_metrics` so far and
its eval manifests, kept in runs/RUN/tripwires.json; each rule at or over its bound logs one line, and a rule set to
`stop` ends the run with it (exit status 1; flows/rl.py raises TripwireStop). Writes no table: the iteration's tables
are complete before it runs."""

from __future__ import annotations

import json
import sys

import polars as pl

from schemas.errors import UserError
from storage import read_manifest, read_stage, scan
from storage.stage_io import write_bytes_atomic
from tasks.algos.tripwires import TRIPWIRES, Firing, fired, iteration_figures
from tasks.stages.common import load_run, stage_task
from tasks.stages.evaluate import sources_of


class TripwireStop(UserError, RuntimeError):
    """A tripwire set to `stop` fired: the message is its one line."""


def settings(tripwires: dict) -> dict[str, tuple[float, str]]:
    """rl.tripwires as fired() takes it: rule → (bound, action), the rule's defaults where the config leaves them."""
    out = {}
    for name, cfg in tripwires.items():
        rule = TRIPWIRES.entry(name)
        out[name] = (rule.bound if cfg.bound is None else cfg.bound, cfg.action or rule.action)
    return out


def evals_frame(layout) -> pl.DataFrame:
    rows = []
    for it in layout.iterations("eval"):
        manifest = read_manifest(layout, "eval", it, verify=False)
        if manifest and manifest.get("extra", {}).get("accuracy") is not None:
            rows.append({"iteration": it, "accuracy": float(manifest["extra"]["accuracy"])})
    return pl.DataFrame(rows, schema={"iteration": pl.Int64, "accuracy": pl.Float64})


@stage_task("tripwires")
def tripwires_task(storage_root: str, run_id: str, iteration: int) -> str | None:
    """Check iteration `iteration`, record its figures and log a line per rule that fired; returns the line of the
    first that is set to `stop` (the flow raises TripwireStop with it once the iteration is tracked), else None."""
    ctx = load_run(storage_root, run_id)
    layout = ctx.layout
    history = scan(run_id, "train_metrics", storage_root).filter(pl.col("iteration") <= iteration).collect()
    rollouts = read_stage(layout, "rollouts", iteration)
    sources = sources_of(read_stage(layout, "prompts", iteration))
    figures = iteration_figures(rollouts, history, evals_frame(layout), sources)
    firings = fired(figures, iteration, settings(ctx.cfg.rl.tripwires))
    record(layout, iteration, figures, firings)
    for firing in firings:
        print(firing.line(), file=sys.stderr, flush=True)
    return next((f.line() for f in firings if f.action == "stop"), None)


def record(layout, iteration: int, figures: dict[str, float], firings: list[Firing]) -> None:
    path = layout.tripwires_path
    state = json.loads(path.read_text()) if path.exists() else {}
    state[str(iteration)] = {"figures": figures, "fired": [f.line() for f in firings]}
    write_bytes_atomic(path, json.dumps(state, indent=1, sort_keys=True).encode())
