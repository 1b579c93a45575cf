"""Stage `prompts`: draw this round's prompts from the train split of the run's `dataset`.

Reads `dataset`; writes `prompts` (iteration, round, prompt_id, text, prompt_token_ids, messages, answer, and the
dataset's other columns as `extra`), one part per round. Rounds of one iteration take consecutive slices of one
seeded permutation, so no prompt repeats within an iteration and a restart draws exactly the same prompts.
"""

from __future__ import annotations

import random

import polars as pl

from storage import StageOutput, read_stage
from tasks.stages.common import Computed, load_run, run_stage, stage_task
from tasks.stages.spec import StageSpec


def sample_prompts(dataset: pl.DataFrame, n: int, seed: int, iteration: int, round_: int) -> pl.DataFrame:
    order = list(range(dataset.height))
    random.Random(f"{seed}-{iteration}").shuffle(order)
    start = (round_ * n) % max(1, dataset.height)
    picked = [order[(start + i) % dataset.height] for i in range(min(n, dataset.height))]
    return dataset[picked].select(
        pl.lit(iteration, pl.Int32).alias("iteration"),
        pl.lit(round_, pl.Int32).alias("round"),
        pl.exclude("split"),
    )


def split_of(ctx, split: str) -> pl.DataFrame:
    return read_stage(ctx.layout, "dataset", 0).filter(pl.col("split") == split)


@stage_task("prompts")
def prompts_task(storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)

    def compute():
        return Computed(
            sample_prompts(split_of(ctx, "train"), ctx.cfg.rollout.prompts_per_round, ctx.cfg.seed, iteration, round_)
        )

    return run_stage(ctx, iteration, part=round_, inputs={**upstream, "round": str(round_)}, compute=compute)


SPEC = StageSpec("prompts", reads=("dataset",), sections=("rollout",), scope="round", task=prompts_task)
