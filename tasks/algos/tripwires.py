"""Tripwires: the signs of a run that has stopped learning, one figure each per iteration (pure Polars, no I/O).

`iteration_figures` computes the figures of one iteration from its tables and the run's history; each rule in
`TRIPWIRES` reads its figure and fires when it reaches its bound. The figures do not depend on the config (every run
records them); `rl.tripwires` only sets each rule's bound and what a firing does (warn, stop, off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl

from tasks.registry import Registry

LINE_REPEATS = 4  # a response that holds one non-empty line this many times or more repeats itself
MIN_SOURCE_RESPONSES = 8  # fewer responses from a source say nothing of its answers' spread


@dataclass(frozen=True)
class Rule:
    figure: str  # the figure the rule reads (iteration_figures' key)
    bound: float  # the default bound: the rule fires when the figure is at or above it
    action: str  # the default action: warn, stop or off
    what: str  # the bound in words, for the one line


TRIPWIRES: Registry = Registry("tripwire", Rule)
# The figures by rule; each default stays silent on the demo's healthy runs (tests/test_tripwires.py).
for name, rule in {
    "truncated_at_zero_reward": Rule("truncated_zero_reward", 0.9, "warn", "most responses cut off, reward 0"),
    "zero_variance_streak": Rule("zero_variance_streak", 3, "warn", "iterations with every group at one reward"),
    "logprob_gap": Rule("logprob_gap", 0.5, "warn", "mean |sampler − trainer| logprob"),
    "answer_collapse": Rule("answer_top_share", 0.9, "warn", "one answer's share of a source's responses"),
    "repetition": Rule("repetition_share", 0.5, "warn", f"share of responses with a line {LINE_REPEATS}+ times"),
    "reward_up_eval_down": Rule("eval_drop_while_reward_rose", 0.05, "warn", "held-out accuracy lost, reward up"),
}.items():
    TRIPWIRES.register(name, **vars(rule))(lambda: None)


def last_line(text: pl.Expr) -> pl.Expr:
    """A response's last non-empty line, stripped and lower-cased: the answer a line-ended response gives."""
    lines = text.str.split("\n").list.eval(pl.element().str.strip_chars().filter(pl.element() != ""))
    return lines.list.last().str.to_lowercase().fill_null("")


def answer_top_share(
    rollouts: pl.DataFrame, sources: pl.DataFrame | None = None, least: int = MIN_SOURCE_RESPONSES
) -> float:
    """The largest share one answer (last_line) takes of a source's responses, over the sources (prompt_id, source
    in `sources`; one source without) with at least `least` responses. NaN when none has."""
    frame = rollouts.select("prompt_id", last_line(pl.col("text")).alias("answer"))
    if sources is not None:
        frame = frame.join(sources.select("prompt_id", "source"), on="prompt_id", how="left")
    else:
        frame = frame.with_columns(source=pl.lit(""))
    counts = frame.group_by("source", "answer").len().with_columns(total=pl.col("len").sum().over("source"))
    shares = counts.filter(pl.col("total") >= least).select(pl.col("len") / pl.col("total"))
    return float(shares["len"].max()) if shares.height else float("nan")


def repetition_share(rollouts: pl.DataFrame, repeats: int = LINE_REPEATS) -> float:
    """The share of responses in which one non-empty line occurs `repeats` times or more. NaN with no responses."""
    if rollouts.height == 0:
        return float("nan")
    lines = rollouts.select(
        pl.col("text").str.split("\n").list.eval(pl.element().str.strip_chars().filter(pl.element() != ""))
    )
    most = lines.select(
        pl.col("text").list.eval(pl.element().value_counts().struct.field("count").max()).list.first().fill_null(0)
    )
    return float((most["text"] >= repeats).mean())


def zero_variance_streak(history: pl.DataFrame) -> float:
    """How many iterations up to the last of `history` (train_metrics rows) had every group at one reward."""
    streak = 0
    for fraction in reversed(history.sort("iteration")["zero_std_group_fraction"].to_list()):
        if fraction is None or fraction < 1.0:
            break
        streak += 1
    return float(streak)


def eval_drop_while_reward_rose(history: pl.DataFrame, evals: pl.DataFrame) -> float:
    """Held-out accuracy lost from the first eval to the last (0 when it did not fall) while the training reward rose
    (the last iteration's reward_mean above the first's); 0 with fewer than two evals or iterations."""
    rewards = history.sort("iteration")["reward_mean"].drop_nans().drop_nulls()
    accuracy = evals.sort("iteration")["accuracy"].drop_nulls()
    if len(rewards) < 2 or len(accuracy) < 2 or rewards[-1] <= rewards[0]:
        return 0.0
    return max(0.0, float(accuracy[0] - accuracy[-1]))


def _finite(*values) -> float:
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return max(finite) if finite else float("nan")


def iteration_figures(
    rollouts: pl.DataFrame, history: pl.DataFrame, evals: pl.DataFrame, sources: pl.DataFrame | None = None
) -> dict[str, float]:
    """Every rule's figure at the last iteration of `history` (its train_metrics rows so far), from that iteration's
    rollouts and the run's evals so far (iteration, accuracy)."""
    last = history.sort("iteration").row(-1, named=True)
    reward_zero = last.get("reward_mean") == 0.0
    return {
        "truncated_zero_reward": float(last["truncation_rate"]) if reward_zero else 0.0,
        "zero_variance_streak": zero_variance_streak(history),
        "logprob_gap": _finite(last.get("sampler_logprob_gap"), last.get("weight_sync_logprob_gap")),
        "answer_top_share": answer_top_share(rollouts, sources),
        "repetition_share": repetition_share(rollouts),
        "eval_drop_while_reward_rose": eval_drop_while_reward_rose(history, evals),
    }


@dataclass(frozen=True)
class Firing:
    rule: str
    figure: str
    value: float
    iteration: int
    bound: float
    action: str

    def line(self) -> str:
        what = TRIPWIRES.entry(self.rule).what
        return (
            f"tripwire {self.rule}: {self.figure}={self.value:.4g} at iteration {self.iteration} "
            f"(bound {self.bound:g}: {what}; {self.action})"
        )


def fired(figures: dict[str, float], iteration: int, settings: dict[str, tuple[float, str]]) -> list[Firing]:
    """The rules whose figure reached its bound; `settings`: rule → (bound, action), each rule's default where absent.
    A rule set off, or whose figure is NaN (nothing to measure), never fires."""
    out = []
    for name in TRIPWIRES:
        rule = TRIPWIRES.entry(name)
        bound, action = settings.get(name, (rule.bound, rule.action))
        value = figures.get(rule.figure, float("nan"))
        if action != "off" and math.isfinite(value) and value >= bound:
            out.append(Firing(name, rule.figure, value, iteration, bound, action))
    return out
