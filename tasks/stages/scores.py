"""Stage `scores`: rule rewards (and, with reward.kind=model, a trained reward model) for every rollout of
one round.

Reads `rollouts` and `prompts` (the prompt, ground truth and dataset columns the functions receive) of the round; writes
`scores`: `score_<fn>` and `error_<fn>` per reward function, `score_model` for the reward model, the weighted `reward`
and a combined `error`. The fingerprint includes a hash of the reward functions' source (and the reward model's
identity), so fixing a reward function and rerunning re-scores."""

from __future__ import annotations

import polars as pl

from storage import StageOutput, read_stage
from tasks.data.formatting import load_tokenizer
from tasks.rewards.loader import source_hash, specs_from_config
from tasks.rewards.scoring import RewardError, score_frame
from tasks.rewards.steps import step_ends_column
from tasks.stages.common import (
    Computed,
    RunContext,
    load_run,
    run_stage,
    score_frame_worker,
    stage_task,
)
from tasks.stages.spec import StageSpec
from tasks.stages.weights import model_fingerprint


@stage_task("scores")
def scores_task(storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)

    def compute():
        rollouts = read_stage(ctx.layout, "rollouts", iteration).filter(pl.col("round") == round_)
        prompts = read_stage(ctx.layout, "prompts", iteration)
        turns = (  # multi-turn rollouts: their turns table, for the reward functions that take `turns`
            read_stage(ctx.layout, "turns", iteration).filter(pl.col("round") == round_)
            if "conversation" in rollouts.columns
            else None
        )
        scores = score_frame(
            rollouts, prompts, ctx.cfg.reward, ctx.cfg.rollout.max_tokens, ctx.cfg.data.answer_key, turns
        )
        if any(f.per_step for f in ctx.cfg.reward.functions.values()):
            scores = scores.with_columns(step_ends(ctx, rollouts))
        if ctx.cfg.reward.kind == "model":
            scores = add_model_score(
                scores,
                reward_model_scores(ctx, rollouts, f"rm-score-{iteration:05d}-{round_}"),
                ctx.cfg.reward.model_weight,
            )
        return Computed(scores)

    inputs = dict(upstream)
    if ctx.cfg.reward.kind == "model":
        inputs["reward_model"] = model_fingerprint(ctx.cfg.reward.model_path)
    return run_stage(
        ctx, iteration, part=round_, salt=source_hash(specs_from_config(ctx.cfg.reward)), inputs=inputs, compute=compute
    )


def step_ends(ctx: RunContext, rollouts: pl.DataFrame) -> pl.Series:
    """Process rewards: the response token on which each step ends (reward.steps), found with the policy's tokenizer
    on the tokens sampled."""
    tokenizer = load_tokenizer(ctx.cfg.model.path)
    ends = step_ends_column(
        rollouts["text"].to_list(),
        rollouts["token_ids"].to_list(),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        ctx.cfg.reward.steps,
    )
    return pl.Series("step_ends", ends, dtype=pl.List(pl.Int32))


def reward_model_scores(ctx: RunContext, rollouts: pl.DataFrame, name: str) -> pl.Series:
    """The reward model's score of each rollout, on exactly the tokens sampled (prompt, then the response with its
    EOS when it stopped), in batches in a torch worker."""
    data = rollouts.select("prompt_token_ids", pl.col("token_ids").alias("response_token_ids"))
    return score_frame_worker(
        ctx, "rm_score", ctx.cfg.reward.model_path, ctx.cfg.optim.micro_batch_size, data, name, log="rm_score"
    )["score"]


def add_model_score(scores: pl.DataFrame, model_scores: pl.Series, weight: float) -> pl.DataFrame:
    """The reward model's column, added (weighted) to the rule reward; a non-finite score is refused."""
    if not model_scores.is_finite().all():
        raise RewardError("the reward model returned a non-finite score")
    return scores.with_columns(model_scores.alias("score_model")).with_columns(
        (pl.col("reward") + weight * pl.col("score_model")).alias("reward")
    )


SPEC = StageSpec(
    "scores",
    reads=("rollouts",),
    also_reads=("prompts", "turns"),  # the rollouts' own prompts and turns
    sections=("reward", "rollout", "data", "optim", "model"),  # model: its tokenizer places process rewards' steps
    scope="round",
    task=scores_task,
    rerunnable=True,  # every round again, from the saved rollouts: a fixed reward function re-scores, no generation
)
