"""A mix of prompt sources (`data.sources`): their rows in one `dataset` table, each round's prompts dealt to them by
weight, and the curriculum rule that steps a source through difficulty levels (a reasoning-gym generator's, or its
files' `level` column).

Every row of a mix carries its source's name (`source`) and its difficulty level (`level`, 0 for a source without a
curriculum) among the dataset's own columns (`extra`), so eval reports each source apart and SQL finds them.
Pure but for reading the files and calling reasoning-gym (tasks/data/reasoning_gym_tasks.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import polars as pl

from schemas.config import CurriculumConfig, DataConfig, DataSource
from tasks.data.datasets import DatasetError, frame_rows, split_rows

GENERATED = DataConfig(prompt_key="prompt", answer_key="answer", id_key="prompt_id")


def generated_rows(source: DataSource) -> dict[str, pl.DataFrame]:
    """A reasoning-gym source's train rows (n_train at each of its curriculum's levels, level L from seed +
    L × n_train) and held-out rows (at the curriculum's eval level), none of whose questions training asks."""
    from tasks.data.reasoning_gym_tasks import entries, entry_frame, held_out, level_config

    g, c = source.reasoning_gym, source.curriculum
    levels = range(c.levels) if c else [0]

    def settings(level: int) -> dict:
        return level_config(g.task, g.config, level) if c else g.config

    train: list[tuple[int, dict]] = []
    for level in levels:
        train += [(level, e) for e in entries(g.task, settings(level), g.n_train, g.seed + level * g.n_train)]
    top = (c.levels - 1 if c.eval_level is None else c.eval_level) if c else 0
    asked = {e["question"] for _, e in train}
    balanced = g.eval_draws if g.balance_eval_labels else 0
    evals = held_out(g.task, settings(top), g.n_eval, g.eval_seed, asked, f"data.sources[{source.name}]", balanced)

    def frame(rows: list[tuple[int, dict]], split: str) -> pl.DataFrame:
        ids = [f"{source.name}-{split}-{level}-{i:06d}" for i, (level, _) in enumerate(rows)]
        return entry_frame([(source.name, e) for _, e in rows], ids, g.system_prompt).with_columns(
            pl.Series("level", [level for level, _ in rows], dtype=pl.Int32),
            pl.lit(f"reasoning_gym:{g.task}").alias("_file"),
            pl.int_range(pl.len(), dtype=pl.Int64).alias("_row"),
        )

    what = f"data.sources[{source.name}]"
    return {
        split: frame_rows(frame(rows, split), GENERATED, what, split)
        for split, rows in (("train", train), ("eval", [(top, e) for e in evals]))
    }


def file_rows(data: DataConfig, source: DataSource, seed: int) -> dict[str, pl.DataFrame]:
    """A file source's rows, read as data.train_files/eval_files are (ids numbered under its name without
    data.id_key); with a curriculum, its train files' `level` column checked."""
    alone = data.model_copy(update={"sources": [], "train_files": source.train_files, "eval_files": source.eval_files})
    out = {}
    what = f"data.sources[{source.name}]"
    for split, rows in split_rows(alone, seed, prefix=f"{source.name}-").items():
        own = {f.name: f.dtype for f in rows.schema["extra"].fields} if "extra" in rows.columns else {}
        if "source" in own:
            raise DatasetError(f"{what}: its files have a column named 'source', which a mix adds; rename it")
        c = source.curriculum
        if split == "train" and c is not None:
            if "level" not in own or not own["level"].is_integer():
                raise DatasetError(f"{what}.curriculum: its files need an integer `level` column (0 .. {c.levels - 1})")
            level = rows.select(pl.col("extra").struct.field("level"))["level"]
            bad = level.filter(level.is_null() | (level < 0) | (level >= c.levels))
            if bad.len():
                raise DatasetError(f"{what}.curriculum: a row has level {bad[0]}, not one of 0 .. {c.levels - 1}")
            missing = sorted(set(range(c.levels)) - set(level.to_list()))
            if missing:
                raise DatasetError(f"{what}.curriculum: no train row has level {missing[0]}")
        if "level" in own and own["level"].is_integer():  # one type for every source's levels
            rows = rows.with_columns(pl.col("extra").struct.with_fields(pl.field("level").cast(pl.Int32)))
        out[split] = rows
    return out


def labelled(rows: pl.DataFrame, source: DataSource) -> pl.DataFrame:
    """The rows with `source` (and `level`, where they have none) among their own columns (`extra`)."""
    added = [pl.lit(source.name).alias("source")]
    if "extra" not in rows.columns:
        return rows.with_columns(pl.struct(*added, pl.lit(0, pl.Int32).alias("level")).alias("extra"))
    if "level" not in {f.name for f in rows.schema["extra"].fields}:
        added.append(pl.lit(0, pl.Int32).alias("level"))
    return rows.with_columns(pl.col("extra").struct.with_fields(added))


def source_rows(data: DataConfig, seed: int) -> list[tuple[str, dict[str, pl.DataFrame]]]:
    """Each source's name and {"train": rows, "eval": rows}, as tasks/data/datasets.split_rows gives them for
    one list of files, with `source` and `level` in `extra`. Formatted apart (a source's prompts may be text, another's
    chat messages), then merged (merged_sources)."""
    out = []
    for source in data.sources:
        rows = generated_rows(source) if source.reasoning_gym else file_rows(data, source, seed)
        out.append((source.name, {split: labelled(frame, source) for split, frame in rows.items()}))
    return out


def merged_sources(frames: list[pl.DataFrame]) -> pl.DataFrame:
    """The sources' formatted `dataset` rows in one table: their own columns in one `extra` struct (a column one
    source lacks is null in its rows). One line for a column typed differently in two sources, or a prompt id in two."""

    def flat(frame: pl.DataFrame) -> pl.DataFrame:  # `x:<column>`: an own column may share a core column's name
        own = [f.name for f in frame.schema["extra"].fields]
        return frame.with_columns(pl.col("extra").struct.rename_fields([f"x:{c}" for c in own])).unnest("extra")

    try:
        table = pl.concat([flat(f) for f in frames], how="diagonal_relaxed")
    except pl.exceptions.PolarsError as exc:
        raise DatasetError(
            f"data.sources: a column has different types in two sources: {str(exc).splitlines()[0][:200]}"
        ) from None
    repeated = table.filter(pl.col("prompt_id").is_duplicated())
    if repeated.height:
        first = repeated["prompt_id"][0]
        names = repeated.filter(pl.col("prompt_id") == first)["x:source"].unique(maintain_order=True).to_list()
        raise DatasetError(
            f"data.sources: the prompt id {first!r} is in {' and '.join(names)}; ids must be unique across the sources"
        )
    own = [c for c in table.columns if c.startswith("x:")]
    extra = pl.struct(own).struct.rename_fields([c[2:] for c in own]).alias("extra")
    return table.select(*[c for c in table.columns if not c.startswith("x:")], extra)


def deal(n: int, weights: list[float], u: float) -> list[int]:
    """n prompts dealt to sources by weight (systematic rounding): each gets ⌊n·w⌋ or ⌈n·w⌉ of its normalised weight w,
    together exactly n, and with u uniform in [0, 1) each gets n·w in expectation: a 2:1 mix is 2:1 over the run."""
    total = sum(weights)
    counts, before, cumulative = [], 0, 0.0
    for i, w in enumerate(weights):
        cumulative += n * w / total
        upto = n if i == len(weights) - 1 else min(n, math.floor(cumulative + u))
        counts.append(upto - before)
        before = upto
    return counts


def round_deal(sources: list[DataSource], n: int, seed: int, iteration: int, round_: int) -> list[int]:
    """The deal of one round, seeded by the run's seed, the iteration and the round (so a restart deals the same)."""
    u = random.Random(f"{seed}-{iteration}-{round_}-deal").random()
    return deal(n, [s.weight for s in sources], u)


def sample_from_sources(
    train: pl.DataFrame,
    sources: list[DataSource],
    levels: dict[str, int],
    n: int,
    seed: int,
    iteration: int,
    round_: int,
) -> pl.DataFrame:
    """The round's prompts: each source's share of n, from its rows at its current level. Within an iteration a source
    walks one seeded permutation of those rows (round r continues where round r - 1 stopped), so no prompt repeats
    within an iteration while the source has rows left."""
    source = pl.col("extra").struct.field("source")
    level = pl.col("extra").struct.field("level")
    deals = [round_deal(sources, n, seed, iteration, r) for r in range(round_ + 1)]  # this round's, and the ones before
    picked = []
    for i, s in enumerate(sources):
        count = deals[round_][i]
        if not count:
            continue
        pool = train.filter((source == s.name) & ((level == levels[s.name]) if s.curriculum else True))
        order = list(range(pool.height))
        random.Random(f"{seed}-{iteration}-{s.name}").shuffle(order)
        start = sum(deal[i] for deal in deals[:round_])
        picked.append(pool[[order[(start + j) % pool.height] for j in range(min(count, pool.height))]])
    return pl.concat(picked, how="vertical") if picked else train.clear()


def next_level(current: int, history: list[tuple[int, float | None]], rule: CurriculumConfig) -> int:
    """The level after `current`: one up when the last `rule.window` iterations at it (history: (level, accuracy) of
    the earlier iterations in order; an iteration at another level ends the run, and one where the source had no
    scored samples, None, is skipped) each reached rule.threshold; the last level at most."""
    trailing = []
    for level, accuracy in reversed(history):
        if level != current:
            break
        if accuracy is not None:
            trailing.append(accuracy)
    recent = trailing[: rule.window]
    if len(recent) == rule.window and all(a >= rule.threshold for a in recent):
        return min(current + 1, rule.levels - 1)
    return current


def curriculum_levels(
    accuracy: Callable[[int, int], float | None], iteration: int, rule: CurriculumConfig, lag: int = 0
) -> list[int]:
    """The levels of iterations 1 .. `iteration`: iteration k's from iterations up to k - 1 - lag (lag: how many
    updates generation runs ahead, whose scores it cannot have yet). accuracy(j, level): the source's accuracy in
    iteration j on its prompts at `level` (that iteration's), None where it had none."""
    levels: list[int] = []
    history: list[tuple[int, float | None]] = []
    for k in range(1, iteration + 1):
        while len(history) < k - 1 - lag:  # iteration j = len(history) + 1, scored by now
            j = len(history) + 1
            history.append((levels[j - 1], accuracy(j, levels[j - 1])))
        levels.append(next_level(levels[-1], history, rule) if levels else rule.start_level)
    return levels
