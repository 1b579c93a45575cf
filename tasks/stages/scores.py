"""Stage `scores`: rule rewards (and, with reward.kind=model, a trained reward model) for every rollout of
one round.

Reads `rollouts` and `prompts` (answers, prompt text) of the round; writes `scores`: `score_<fn>` and
`error_<fn>` per reward function, `score_model` for the reward model, the weighted `reward` and a combined
`error`. The fingerprint includes a hash of the reward functions' source (and the reward model's identity),
so fixing a reward function and rerunning re-scores.
"""

from __future__ import annotations

import polars as pl

from storage import StageOutput, read_stage
from tasks.stages.common import Computed, RunContext, frame_worker, load_run, run_stage, stage_task
from tasks.stages.weights import model_fingerprint
from tasks.rewards.builtin import RewardError, code_hash, score_frame
from tasks.engines.workers import PREFERENCE_WORKER


@stage_task("scores")
def scores_task(storage_root: str, run_id: str, iteration: int, round_: int, rollouts_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    weights = dict(ctx.cfg.reward.weights)

    def compute():
        rollouts = read_stage(ctx.layout, "rollouts", iteration).filter(pl.col("round") == round_)
        prompts = read_stage(ctx.layout, "prompts", iteration)
        answers = dict(zip(prompts["prompt_id"].to_list(), prompts["answer"].to_list()))
        scores = score_frame(rollouts, answers, ctx.cfg.reward, ctx.cfg.rollout.max_tokens)
        if ctx.cfg.reward.kind == "model":
            scores = add_model_score(scores, reward_model_scores(ctx, rollouts, prompts, f"rm-score-{iteration:05d}-{round_}"),
                                     ctx.cfg.reward.model_weight)
        return Computed(scores)

    inputs = {"rollouts": rollouts_fp}
    if ctx.cfg.reward.kind == "model":
        inputs["reward_model"] = model_fingerprint(ctx.cfg.reward.model_path)
    return run_stage(
        ctx, "scores", iteration, sections=("reward",), part=round_, salt=code_hash(weights),
        inputs=inputs, compute=compute,
    )


def reward_model_scores(ctx: RunContext, rollouts: pl.DataFrame, prompts: pl.DataFrame, name: str) -> pl.Series:
    """The reward model's score of each rollout (prompt text + response, EOS only where the sampler
    stopped), in batches in a torch worker."""
    data = rollouts.select("prompt_id", pl.col("text").alias("response"), (pl.col("finish_reason") == "stop").alias("eos")).join(
        prompts.select("prompt_id", pl.col("text").alias("prompt")), on="prompt_id", how="left", maintain_order="left",
    )
    request = {"mode": "rm_score", "model_path": ctx.cfg.reward.model_path}
    return frame_worker(ctx, PREFERENCE_WORKER, request, data, name, log="rm_score")["score"]


def add_model_score(scores: pl.DataFrame, model_scores: pl.Series, weight: float) -> pl.DataFrame:
    """The reward model's column, added (weighted) to the rule reward; a non-finite score is refused."""
    if not model_scores.is_finite().all():
        raise RewardError("the reward model returned a non-finite score")
    return scores.with_columns(model_scores.alias("score_model")).with_columns(
        (pl.col("reward") + weight * pl.col("score_model")).alias("reward")
    )
