"""`rlpipe report RUN`: runs/RUN/report.html with one PNG per plot (under runs/RUN/report/) and the
reward-hacking flags. Read-only over complete stages: it can run while training goes on.
Imports: matplotlib inside the command, after its Agg backend is chosen; the stage graph (every stage module) only for
the timing plot's order."""

from __future__ import annotations

import html
from pathlib import Path

import polars as pl

from schemas.errors import NotFound, UserError
from storage import RunLayout, read_manifest, scan
from tasks.algos.metrics import split_by_source
from tasks.analysis.agent_stats import per_iteration
from tasks.analysis.reward_hacking import Flag, hacking_flags, repetition_rate
from tasks.analysis.show import tripwire_lines

# (file stem, title, y label, train_metrics columns): one line per column, x = iteration.
LINE_PLOTS = [
    ("reward", "Reward (mean over kept samples)", "reward", ["reward_mean"]),
    ("kl", "KL to the reference, and policy drift per update", "nats/token", ["kl_ref", "ppo_kl"]),
    ("entropy", "Policy entropy", "nats/token", ["entropy"]),
    ("clip_fraction", "Clipped token fraction", "fraction", ["clip_frac_low", "clip_frac_high"]),
    ("response_length", "Response length", "tokens", ["response_length_mean", "response_length_max"]),
    (
        "nonzero_advantages",
        "Samples with a non-zero advantage",
        "fraction",
        ["nonzero_advantage_fraction", "zero_std_group_fraction"],
    ),
]


class ReportError(UserError, ValueError):
    pass


def _line_plot(path: Path, title: str, ylabel: str, series: dict[str, tuple[list, list]]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    for label, (x, y) in series.items():
        ax.plot(x, y, marker="o", markersize=3, label=label, linestyle="--" if label.startswith("label prior") else "-")
    ax.set(title=title, xlabel="iteration", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# Stage wall times are disjoint (each stage runs after the last), so they stack into the iteration's time; these engine
# timers are inside stages (generation and weight sync in rollouts, the forward passes in logprobs, forward and
# backward in optimize), so they are drawn apart, never stacked on their own stage.
SUB_TIMERS = {
    "seconds_generate": "vLLM generate (in rollouts)",
    "weight_sync_seconds": "weight sync (in rollouts)",
    "seconds_logprobs_forward": "logprobs forward (in logprobs)",
    "seconds_forward_backward": "forward+backward (in optimize)",
}


def stage_columns(columns: list[str]) -> list[str]:
    """The disjoint stage times, in the iteration's order (the stage graph's), then eval."""
    from tasks.stages.graph import RL_ITERATION

    order = ["seconds_optimize" if s.name == "train_metrics" else f"seconds_{s.name}" for s in RL_ITERATION]
    return [c for c in order if c in columns]


def _stage_seconds_plot(path: Path, seconds: pl.DataFrame) -> None:
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 5.5), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    colours = plt.get_cmap("tab10").colors
    x, base = seconds["iteration"].to_list(), [0.0] * seconds.height
    for i, col in enumerate(stage_columns(seconds.columns)):
        values = seconds[col].fill_null(0.0).to_list()
        top.bar(x, values, bottom=base, label=col.removeprefix("seconds_"), color=colours[i % len(colours)])
        base = [b + v for b, v in zip(base, values)]
    top.set(title="Time per stage (stacked: the iteration's wall time)", ylabel="seconds")
    top.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    for i, (col, label) in enumerate((c, lab) for c, lab in SUB_TIMERS.items() if c in seconds.columns):
        bottom.plot(x, seconds[col].fill_null(0.0).to_list(), marker="o", markersize=3, label=label, color=colours[i])
    bottom.set(title="Engine time inside the stages", xlabel="iteration", ylabel="seconds")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def eval_table(layout: RunLayout) -> pl.DataFrame:
    rows = []
    for it in layout.iterations("eval"):
        m = read_manifest(layout, "eval", it, verify=False)
        if m:
            rows.append({"iteration": it, "accuracy": m["extra"]["accuracy"], "seconds_eval": float(m["wall_seconds"])})
    return pl.DataFrame(rows, schema={"iteration": pl.Int64, "accuracy": pl.Float64, "seconds_eval": pl.Float64})


def source_accuracy(layout: RunLayout) -> dict[str, tuple[list[int], list[float]]]:
    """Each source's eval accuracy by iteration (its `accuracy/<source>` figures) and, beside it, its label prior (the
    accuracy of always giving its most common held-out answer, `label_prior/<source>`), when the dataset names
    sources: one line each, by name."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for it in layout.iterations("eval"):
        m = read_manifest(layout, "eval", it, verify=False)
        for source, figures in split_by_source(m["extra"] if m else {}).items():
            for line, key in (
                (f"eval greedy accuracy, {source}", "accuracy"),
                (f"label prior, {source}", "label_prior"),
            ):
                if key in figures:
                    its, values = out.setdefault(line, ([], []))
                    its.append(it)
                    values.append(figures[key])
    return dict(sorted(out.items()))


def write_report(run_id: str, root: str = "runs") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    layout = RunLayout(Path(root), run_id)
    if not layout.run_dir.is_dir():
        raise NotFound(f"run {run_id!r} not found under {root}")
    metrics = scan(run_id, "train_metrics", root, verify=True).collect().sort("iteration")
    if metrics.is_empty():
        raise ReportError(f"run {run_id!r} has no complete iteration yet (no train_metrics)")
    evals = eval_table(layout)
    rollouts = scan(run_id, "rollouts", root, verify=True).select("iteration", "token_ids").collect()
    repetition = repetition_rate(rollouts)
    out_dir = layout.report_dir
    out_dir.mkdir(exist_ok=True)
    x = metrics["iteration"].to_list()
    figures = []
    for stem, title, ylabel, cols in LINE_PLOTS:
        series = {c: (x, metrics[c].to_list()) for c in cols if c in metrics.columns}
        if series:
            _line_plot(out_dir / f"{stem}.png", title, ylabel, series)
            figures.append((stem, title))
    accuracy = {"eval greedy accuracy (rule)": (evals["iteration"].to_list(), evals["accuracy"].to_list())}
    accuracy.update(source_accuracy(layout))  # a dataset that names its sources: its accuracy and prior, each
    if "score_accuracy_mean" in metrics.columns:
        accuracy["train accuracy reward"] = (x, metrics["score_accuracy_mean"].to_list())
    _line_plot(out_dir / "accuracy.png", "Accuracy", "fraction", accuracy)
    figures.insert(1, ("accuracy", "Accuracy"))
    _line_plot(
        out_dir / "repetition.png",
        "Repeated token bigrams within a response",
        "fraction",
        {"repetition_rate": (repetition["iteration"].to_list(), repetition["repetition_rate"].to_list())},
    )
    figures.append(("repetition", "Repetition"))
    agent = per_iteration(scan(run_id, "rollouts", root, verify=True).collect())
    if agent is not None:  # a multi-turn run
        ax = agent["iteration"].to_list()
        _line_plot(
            out_dir / "multi_turn.png",
            "Multi-turn rollouts",
            "per sample / share",
            {c: (ax, agent[c].to_list()) for c in ("turns", "tool_call_rate", "call_errors", "truncated", "failed")},
        )
        figures.append(("multi_turn", "Multi-turn rollouts: turns, tool use and its errors, endings"))
    seconds = metrics.select("iteration", *[c for c in metrics.columns if c.startswith("seconds_") or c in SUB_TIMERS])
    seconds = seconds.join(evals.select("iteration", "seconds_eval"), on="iteration", how="left")
    _stage_seconds_plot(out_dir / "stage_seconds.png", seconds)
    figures.append(("stage_seconds", "Time per stage"))
    flags = hacking_flags(metrics, evals, repetition)
    path = layout.report_path
    path.write_text(_html(run_id, metrics, evals, flags, figures, tripwire_lines(layout)))
    return path


def _html(run_id: str, metrics: pl.DataFrame, evals: pl.DataFrame, flags: list[Flag], figures, tripwires=()) -> str:
    esc = html.escape
    trips = "".join(f"<li>{esc(line)}</li>" for line in tripwires) or "<li>none fired</li>"
    flag_rows = "".join(
        f"<tr class={'raised' if f.raised else 'ok'}><td>{esc(f.name)}</td><td>{'RAISED' if f.raised else 'ok'}</td>"
        f"<td>{esc(f.evidence)}</td></tr>"
        for f in flags
    )
    eval_rows = "".join(
        f"<tr><td>{it}</td><td>{acc:.3f}</td></tr>" for it, acc in evals.select("iteration", "accuracy").iter_rows()
    )
    images = "".join(
        f"<figure><img src='report/{stem}.png' alt='{esc(title)}'><figcaption>{esc(title)}</figcaption></figure>"
        for stem, title in figures
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>rlpipe report: {esc(run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}} td,th{{border:1px solid
#ccc;padding:4px 8px}}
tr.raised td{{background:#fdd}} figure{{display:inline-block;margin:8px}}</style></head>
<body><h1>rlpipe report: {esc(run_id)}</h1>
<p>{metrics.height} iterations with train metrics (iterations
{metrics["iteration"].min()}–{metrics["iteration"].max()}).</p>
<h2>Reward-hacking flags</h2>
<table><tr><th>check</th><th>status</th><th>evidence</th></tr>{flag_rows}</table>
<h2>Tripwires</h2>
<ul>{trips}</ul>
<h2>Eval (greedy, rule-judged)</h2>
<table><tr><th>iteration</th><th>accuracy</th></tr>{eval_rows}</table>
<h2>Per iteration</h2>{images}
</body></html>
"""
