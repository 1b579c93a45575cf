"""`rlpipe show RUN`: what a run holds, at a glance, in 80 columns.

One line per stage (in the stage graph's order): the iterations it holds, their state, and their wall seconds; then
the last iterations' key metrics and every eval. Every part shown as complete is checked against its manifest first.
`--wide` shows the full grid (a column per stage, a row per iteration) and every metric column.
Imports: the stage graph (every stage module) inside `stage_states`, for `show`'s order only.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from schemas.errors import NotFound
from storage import RunLayout, folder_bytes, has_weight_files, read_manifest, scan, state_bytes, verified_parts
from tasks.algos.metrics import split_by_source
from tasks.analysis.agent_stats import per_iteration
from tasks.analysis.query import warn_strays

# (train_metrics column, short header) for the 80-column view.
KEY_METRICS = [
    ("reward_mean", "reward"),
    ("score_accuracy_mean", "acc"),
    ("kl_ref", "kl_ref"),
    ("entropy", "entropy"),
    ("clip_frac_high", "clip_hi"),
    ("response_length_mean", "len"),
    ("seconds_optimize", "s_opt"),
]


def superseded_stages(layout) -> set[tuple[str, int]]:
    """(stage, iteration) pairs that `rlpipe rerun` (or `--reconfigure`) moved aside (see superseded.json)."""
    log = layout.superseded_log
    records = json.loads(log.read_text()) if log.exists() else []
    return {(name, k) for record in records for name, k in record["stages"]}


def ranges(values: list[int]) -> str:
    """[1, 2, 3, 5] → "1-3, 5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _order(stages: set[str]) -> list[str]:
    from tasks.stages import graph

    known = [s.name for s in graph.STAGES if s.name in stages]
    return known + sorted(stages - set(known))


def stage_states(layout) -> dict[str, dict[int, tuple[str, float]]]:
    """stage → iteration → (complete | missing | superseded, wall seconds), each complete part verified."""

    superseded = superseded_stages(layout)
    out: dict[str, dict[int, tuple[str, float]]] = {}
    for stage in layout.stages():
        for it in layout.iterations(stage):
            m = read_manifest(layout, stage, it, verify=False)
            out.setdefault(stage, {})[it] = ("complete", float(m["wall_seconds"])) if m else ("missing", 0.0)
    # A damaged part: one line naming it, and how to repair it.
    verified_parts(
        layout, [(stage, it) for stage, its in out.items() for it, (state, _) in its.items() if state == "complete"]
    )
    for stage, it in superseded:
        out.setdefault(stage, {}).setdefault(it, ("superseded", 0.0))
    return out


def summary_table(run_id: str, states: dict) -> Table:
    table = Table(title=f"{run_id}: stages")
    for col, justify in (("stage", "left"), ("iterations", "left"), ("state", "left"), ("seconds", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for stage in _order(set(states)):
        its = states[stage]
        counts = {}
        for state, _ in its.values():
            counts[state] = counts.get(state, 0) + 1
        state = ", ".join(f"{n} {s}" for s, n in counts.items()) if len(counts) > 1 else next(iter(counts))
        table.add_row(stage, ranges(sorted(its)), state, f"{sum(sec for _, sec in its.values()):.1f}")
    return table


def grid_table(run_id: str, states: dict) -> Table:
    stages = _order(set(states))
    table = Table(title=f"{run_id}: stages")
    table.add_column("iteration")
    for s in stages:
        table.add_column(s)
    for it in sorted({it for its in states.values() for it in its}):
        cells = []
        for s in stages:
            state, sec = states[s].get(it, ("", 0.0))
            cells.append(f"complete ({sec:.1f}s)" if state == "complete" else state)
        table.add_row(str(it), *cells)
    return table


def metrics_table(metrics, wide: bool, last: int = 5) -> Table | None:
    if not metrics.height:
        return None
    if wide:
        cols = [(c, c) for c in metrics.columns]
    else:
        cols = [("iteration", "it")] + [(c, h) for c, h in KEY_METRICS if c in metrics.columns]
        metrics = metrics.sort("iteration").tail(last)
    table = Table(title="train_metrics" + ("" if wide else f" (last {min(last, metrics.height)})"))
    for _, header in cols:
        table.add_column(header, justify="right")
    for row in metrics.sort("iteration").select([c for c, _ in cols]).iter_rows():
        table.add_row(*[f"{v:.4g}" if isinstance(v, float) else str(v) for v in row])
    return table


def pass_at(figures: dict) -> float:
    """The pass@k among eval figures (its key names k: `pass_at_4`)."""
    return next((v for k, v in figures.items() if k.startswith("pass_at_") and "/" not in k), float("nan"))


def prior(figures: dict) -> str:
    """The label prior beside an accuracy; "-" where the held-out set has no answers or the eval predates the figure."""
    value = figures.get("label_prior")
    return "-" if value is None else f"{value:.4f}"


def eval_table(layout) -> Table:
    table = Table(
        title="eval (greedy pass@1 beside its label prior: always the most common held-out answer; sampled pass@k, "
        "greedy mean reward; held-out prompts)"
    )
    for col in ("iteration", "accuracy", "prior", "pass@k", "reward", "length", "prompts", "seconds"):
        table.add_column(col, justify="right")
    for it in layout.iterations("eval"):
        m = read_manifest(layout, "eval", it, verify=False)
        if m and "accuracy" in m["extra"]:
            e = m["extra"]
            pk = pass_at(e)
            table.add_row(
                str(it),
                f"{e['accuracy']:.4f}",
                prior(e),
                f"{pk:.4f}",
                f"{e.get('mean_reward', float('nan')):.4f}",
                f"{e.get('mean_length', float('nan')):.1f}",
                str(e["prompts"]),
                f"{m['wall_seconds']:.0f}",
            )
            for source, f in split_by_source(e).items():
                table.add_row(
                    f"{it} {source}",
                    f"{f['accuracy']:.4f}",
                    prior(f),
                    f"{pass_at(f):.4f}",
                    "",
                    f"{f.get('mean_length', float('nan')):.1f}",
                    str(f.get("prompts", "")),
                    "",
                )
    return table


def agent_table(rollouts) -> Table | None:
    """Multi-turn runs: the last iterations' turns, tool calls and their errors per sample, and how trajectories
    ended."""
    per = per_iteration(rollouts)
    if per is None:
        return None
    headers = ("it", "turns", "calls", "call errors", "env reward", "max turns", "truncated", "failed")
    table = Table(title="multi-turn rollouts (means per sample; shares of samples)")
    for col in headers:
        table.add_column(col, justify="right")
    shown = ("turns", "calls", "call_errors", "env_reward", "max_turns", "truncated", "failed")
    for row in per.tail(5).select("iteration", *shown).iter_rows():
        table.add_row(str(row[0]), *("-" if v is None else f"{v:.3g}" for v in row[1:]))
    return table


def show_run(run_id: str, root: str, console: Console, wide: bool = False) -> None:
    layout = RunLayout(Path(root), run_id)
    if not layout.run_dir.is_dir():
        raise NotFound(f"run {run_id!r} not found under {root}")
    warn_strays(layout, console)
    states = stage_states(layout)
    out = Console(width=None if wide else min(Console().width, 80))
    out.print(grid_table(run_id, states) if wide else summary_table(run_id, states))
    metrics = metrics_table(scan(run_id, "train_metrics", root, verify=True).collect(), wide)
    if metrics is not None:
        out.print(metrics)
    if "turns" in states:
        agent = agent_table(scan(run_id, "rollouts", root, verify=True).collect())
        if agent is not None:
            out.print(agent)
    out.print(eval_table(layout))
    for line in tripwire_lines(layout):
        out.print(line, markup=False, highlight=False)
    out.print(disk_table(disk_use(layout)))


def tripwire_lines(layout: RunLayout) -> list[str]:
    """The line of every tripwire that fired, in iteration order (runs/RUN/tripwires.json; none before any ran)."""
    if not layout.tripwires_path.exists():
        return []
    state = json.loads(layout.tripwires_path.read_text())
    return [line for it in sorted(state, key=int) for line in state[it].get("fired", [])]


def disk_use(layout: RunLayout) -> dict:
    """Bytes on disk: the stage tables (and how many iterations they span), the checkpoints (each one's weights and
    DeepSpeed state apart: the state is the bulk, and `engines.keep_optimizer_states` bounds it), the rest (logs,
    report, tracking) and the total."""
    tables = {stage: folder_bytes(layout.stage_root(stage)) for stage in layout.stages()}
    checkpoints = {}
    for k in layout.checkpoint_iterations():
        folder = layout.checkpoint_dir(k)
        state = state_bytes(folder)
        checkpoints[k] = {"weights": folder_bytes(folder) - state, "state": state, "files": has_weight_files(folder)}
    total = folder_bytes(layout.run_dir)  # a second walk of a few hundred files: simpler than excluding folders
    iterations = max((max(layout.iterations(stage), default=0) for stage in tables), default=0)
    held = sum(tables.values()) + sum(c["weights"] + c["state"] for c in checkpoints.values())
    return {"tables": tables, "checkpoints": checkpoints, "iterations": iterations, "other": total - held,
            "total": total, "written_per_iteration": checkpoint_bytes_written(layout, checkpoints)}  # fmt: skip


def checkpoint_bytes_written(layout: RunLayout, checkpoints: dict) -> float:
    """What an update writes on average: a kept checkpoint's weights in the share of updates that wrote weight files
    (under engines.weight_sync collective the weights-only ones write only the model's config, tokenizer and probe),
    plus an optimizer state in the share of updates that wrote one (checkpoint.every). An update recorded before
    either was optional wrote both."""
    if not checkpoints:
        return 0.0
    updates = [read_manifest(layout, "train_metrics", k, verify=False) for k in layout.iterations("train_metrics")]
    extras = [m["extra"] for m in updates if m]

    def share(key: str) -> float:
        return sum(e.get(key, True) for e in extras) / len(extras) if extras else 1.0

    def mean(values: list) -> float:
        return sum(values) / len(values) if values else 0.0

    weights = mean([c["weights"] for c in checkpoints.values() if c["files"]])
    bare = mean([c["weights"] for c in checkpoints.values() if not c["files"]])
    state = mean([c["state"] for c in checkpoints.values() if c["state"]])
    return weights * share("weight_files") + bare * (1 - share("weight_files")) + state * share("full_checkpoint")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def disk_table(use: dict) -> Table:
    """`show`'s disk panel: what each part of the run takes, and per iteration."""
    table = Table(title="disk", title_justify="left", box=None)
    for col in ("what", "bytes", "per iteration"):
        table.add_column(col, justify="left" if col == "what" else "right")
    n = max(use["iterations"], 1)
    tables = sum(use["tables"].values())
    table.add_row(f"stage tables ({use['iterations']} iterations)", human_bytes(tables), human_bytes(tables / n))
    ckpts = use["checkpoints"]
    if ckpts:
        weights = sum(c["weights"] for c in ckpts.values())
        state = sum(c["state"] for c in ckpts.values())
        with_state = sum(1 for c in ckpts.values() if c["state"])
        each = human_bytes(weights / len(ckpts))
        table.add_row(f"checkpoint weights ({len(ckpts)} kept)", human_bytes(weights), each)
        table.add_row(
            f"optimizer states ({with_state} kept)", human_bytes(state), human_bytes(state / max(with_state, 1))
        )
        table.add_row("checkpoints written per update", "", human_bytes(use["written_per_iteration"]))
    table.add_row("logs, report, other", human_bytes(use["other"]), "")
    table.add_row("total", human_bytes(use["total"]), "")
    return table
