"""Stage `scores`: rule rewards for every rollout of one round.

Reads `rollouts` and `prompts` (answers) of the round; writes `scores`: `score_<fn>` and `error_<fn>` per
reward function, the weighted `reward` and a combined `error`. The fingerprint includes a hash of the reward
functions' source, so fixing a reward function and rerunning re-scores.
"""

from __future__ import annotations

import polars as pl

from storage import StageOutput, read_stage
from tasks.common import Computed, stage_task, load_run, run_stage
from tasks.rewards import code_hash, score_frame


@stage_task("scores")
def scores_task(storage_root: str, run_id: str, iteration: int, round_: int, rollouts_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    weights = dict(ctx.cfg.reward.weights)

    def compute():
        rollouts = read_stage(ctx.layout, "rollouts", iteration).filter(pl.col("round") == round_)
        prompts = read_stage(ctx.layout, "prompts", iteration)
        answers = dict(zip(prompts["prompt_id"].to_list(), prompts["answer"].to_list()))
        return Computed(score_frame(rollouts, answers, ctx.cfg.reward, ctx.cfg.rollout.max_tokens))

    return run_stage(
        ctx, "scores", iteration, sections=("reward",), part=round_, salt=code_hash(weights),
        inputs={"rollouts": rollouts_fp}, compute=compute,
    )
