"""Stage `prompts`: draw this round's prompts from the train split.

Reads the prompt dataset; writes `prompts` (iteration, round, prompt_id, text, answer), one part per round.
Rounds of one iteration take consecutive slices of one seeded permutation, so no prompt repeats within an
iteration and a restart draws exactly the same prompts.
"""

from __future__ import annotations

import random

import polars as pl

from storage import StageOutput
from tasks.stages.common import Computed, stage_task, load_run, run_stage
from tasks.data.datasets import load_prompt_dataset, task_splits


def sample_prompts(dataset: pl.DataFrame, n: int, seed: int, iteration: int, round_: int) -> pl.DataFrame:
    order = list(range(dataset.height))
    random.Random(f"{seed}-{iteration}").shuffle(order)
    start = (round_ * n) % max(1, dataset.height)
    picked = [order[(start + i) % dataset.height] for i in range(min(n, dataset.height))]
    return dataset[picked].select(
        pl.lit(iteration, pl.Int32).alias("iteration"), pl.lit(round_, pl.Int32).alias("round"),
        "prompt_id", "text", "answer",
    )


@stage_task("prompts")
def prompts_task(storage_root: str, run_id: str, iteration: int, round_: int = 0) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    train_path = task_splits(ctx.cfg.task)["train"]

    def compute():
        dataset = load_prompt_dataset(train_path)
        return Computed(sample_prompts(dataset, ctx.cfg.rollout.prompts_per_round, ctx.cfg.seed, iteration, round_))

    return run_stage(
        ctx, "prompts", iteration, sections=("task", "rollout"), part=round_,
        inputs={"round": str(round_)}, compute=compute,
    )
