"""Stage `prompts`: draw this round's prompts from the train split of the run's `dataset`.

Reads `dataset`; writes `prompts` (iteration, round, prompt_id, text, prompt_token_ids, messages, answer, and the
dataset's other columns as `extra`), one part per round. Rounds of one iteration take consecutive slices of one
seeded permutation, so no prompt repeats within an iteration and a restart draws exactly the same prompts.
"""

from __future__ import annotations

import json
import random

import polars as pl

from storage import StageOutput, read_stage
from tasks.data.data_sources import curriculum_levels, sample_from_sources
from tasks.stages.common import Computed, load_run, run_stage, stage_task
from tasks.stages.spec import StageSpec


def sample_prompts(dataset: pl.DataFrame, n: int, seed: int, iteration: int, round_: int) -> pl.DataFrame:
    order = list(range(dataset.height))
    random.Random(f"{seed}-{iteration}").shuffle(order)
    start = (round_ * n) % max(1, dataset.height)
    picked = [order[(start + i) % dataset.height] for i in range(min(n, dataset.height))]
    return as_prompts(dataset[picked], iteration, round_)


def as_prompts(rows: pl.DataFrame, iteration: int, round_: int) -> pl.DataFrame:
    """Drawn `dataset` rows as the round's `prompts` rows."""
    return rows.select(
        pl.lit(iteration, pl.Int32).alias("iteration"),
        pl.lit(round_, pl.Int32).alias("round"),
        pl.exclude("split"),
    )


def split_of(ctx, split: str) -> pl.DataFrame:
    return read_stage(ctx.layout, "dataset", 0).filter(pl.col("split") == split)


@stage_task("prompts")
def prompts_task(storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)

    cfg = ctx.cfg
    sources = cfg.data.sources
    # A curriculum's levels follow the scores of earlier iterations: an input of the fingerprint, so a changed score
    # redraws. Not a `reads_previous` of the spec: that would make the stage per iteration in the graph, and only a
    # curriculum reads them.
    if any(s.curriculum for s in sources):
        # How far generation runs ahead (rl.max_staleness) moves the levels alone, and the levels are an input: read
        # from the whole config, so that the stage's sections (and a change of rl) leave other runs' prompts alone.
        levels = source_levels(ctx, iteration, load_run(storage_root, run_id).cfg.generation_ahead)
    else:
        levels = {}

    def compute():
        n = cfg.rollout.prompts_per_round
        if not sources:
            return Computed(sample_prompts(split_of(ctx, "train"), n, cfg.seed, iteration, round_))
        picked = sample_from_sources(split_of(ctx, "train"), sources, levels, n, cfg.seed, iteration, round_)
        return Computed(as_prompts(picked, iteration, round_), extra={"levels": levels} if levels else {})

    inputs = {**upstream, "round": str(round_), **({"levels": json.dumps(levels, sort_keys=True)} if levels else {})}
    return run_stage(ctx, iteration, part=round_, inputs=inputs, compute=compute)


def source_levels(ctx, iteration: int, lag: int) -> dict[str, int]:
    """Each curriculum source's level in `iteration` (tasks/data/data_sources.curriculum_levels), from its mean reward
    on its own prompts at its level in the earlier iterations' scores."""
    train = split_of(ctx, "train").select(
        "prompt_id",
        pl.col("extra").struct.field("source").alias("source"),
        pl.col("extra").struct.field("level").alias("level"),
    )
    scored: dict[int, pl.DataFrame] = {}

    def accuracy(source: str):
        def of(j: int, level: int) -> float | None:
            if j not in scored:
                rewards = read_stage(ctx.layout, "scores", j).select(
                    "prompt_id", pl.col("reward").fill_nan(0.0).fill_null(0.0)
                )
                scored[j] = rewards.join(train, on="prompt_id")
            mine = scored[j].filter((pl.col("source") == source) & (pl.col("level") == level))
            return float(mine["reward"].mean()) if mine.height else None

        return of

    return {
        s.name: curriculum_levels(accuracy(s.name), iteration, s.curriculum, lag)[-1]
        for s in ctx.cfg.data.sources
        if s.curriculum
    }


SPEC = StageSpec(
    "prompts",
    reads=("dataset",),
    sections=("rollout",),
    keys=("data.sources",),  # the mix's weights and curricula
    scope="round",
    task=prompts_task,
)
