"""Stage `eval`: greedy pass@1 and sampled pass@k on the held-out prompts, with vLLM.

Reads the held-out split and the weights after iteration k (k = 0: the starting model); writes `eval`, one
row per prompt. Correctness is the `accuracy` reward function, the same judge as training. When RL is scored
by a reward model, the manifest also gets its Spearman correlation with that judge on the sampled responses.
"""

from __future__ import annotations

from math import comb

import polars as pl

from storage import StageOutput
from tasks.stages.common import Computed, stage_task, load_run, run_stage
from tasks.data.datasets import load_prompt_dataset, task_splits
from tasks.algos.metrics import spearman
from tasks.rewards.builtin import REWARD_FUNCTIONS, Sample, code_hash
from tasks.stages.rollouts import generate
from tasks.stages.scores import reward_model_scores
from tasks.stages.weights import model_fingerprint, weights_after


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n−c, k)/C(n, k) (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def judge(samples: pl.DataFrame, answers: dict[str, str]) -> pl.Series:
    fn = REWARD_FUNCTIONS["accuracy"]
    return pl.Series(
        [fn(Sample(t, answers[p], r)) > 0 for t, p, r in zip(samples["text"], samples["prompt_id"], samples["finish_reason"])],
        dtype=pl.Boolean,
    )


def eval_table(held_out: pl.DataFrame, greedy: pl.DataFrame, sampled: pl.DataFrame, k: int, iteration: int) -> pl.DataFrame:
    """One row per held-out prompt from the greedy and sampled responses, each already judged (`correct`)."""
    g = greedy.select(
        "prompt_id", pl.col("text").alias("greedy_text"), pl.col("correct").alias("greedy_correct"),
        pl.col("length").alias("greedy_length"),
    )
    s = sampled.group_by("prompt_id").agg(
        pl.len().cast(pl.Int32).alias("n_samples"), pl.col("correct").sum().cast(pl.Int32).alias("n_correct")
    )
    out = held_out.select("prompt_id", "answer").join(g, on="prompt_id").join(s, on="prompt_id")
    return out.with_columns(
        pl.lit(iteration, pl.Int32).alias("iteration"),
        pl.struct("n_samples", "n_correct").map_elements(
            lambda r: pass_at_k(r["n_samples"], r["n_correct"], k), return_dtype=pl.Float64
        ).alias("pass_at_k"),
    )


def rm_rule_spearman(ctx, held_out: pl.DataFrame, sampled: pl.DataFrame) -> float:
    """Spearman correlation of the reward model's score with the rule's judgement (`correct`) of the sampled
    responses."""
    scored = sampled.with_columns(reward_model_scores(ctx, sampled, held_out, "eval_rm").alias("rm"))
    return spearman(scored, "rm", "correct")


@stage_task("eval")
def eval_task(storage_root: str, run_id: str, iteration: int, weights_stage: str = "train_metrics") -> StageOutput:
    ctx = load_run(storage_root, run_id)
    weights = weights_after(ctx, iteration, weights_stage)
    e, r = ctx.cfg.eval, ctx.cfg.rollout

    def compute():
        held_out = load_prompt_dataset(task_splits(ctx.cfg.task)["eval"])
        jobs = [
            {"n": 1, "temperature": 0.0, "max_tokens": r.max_tokens, "seed": ctx.cfg.seed},
            {"n": e.samples, "temperature": e.temperature, "max_tokens": r.max_tokens, "seed": ctx.cfg.seed + 1},
        ]
        (greedy, sampled), resp = generate(ctx, weights.path, held_out, jobs, f"eval-{iteration:05d}")
        answers = dict(zip(held_out["prompt_id"], held_out["answer"]))
        greedy, sampled = (f.with_columns(judge(f, answers).alias("correct")) for f in (greedy, sampled))
        df = eval_table(held_out, greedy, sampled, e.pass_k, iteration)
        summary = {
            "accuracy": float(df["greedy_correct"].mean()), f"pass_at_{e.pass_k}": float(df["pass_at_k"].mean()),
            "mean_length": float(df["greedy_length"].mean()), "prompts": df.height,
        }
        if ctx.cfg.reward.kind == "model":  # does the reward model still rank like the rule on unseen prompts?
            summary["reward_model_rule_spearman"] = rm_rule_spearman(ctx, held_out, sampled)
        return Computed(df, engines={"vllm": resp["vllm_version"]}, extra=summary)

    inputs = {"weights": weights.fingerprint}
    if ctx.cfg.reward.kind == "model":
        inputs["reward_model"] = model_fingerprint(ctx.cfg.reward.model_path)
    return run_stage(
        ctx, "eval", iteration, sections=("eval", "task"), salt=code_hash(["accuracy"]), inputs=inputs, compute=compute,
    )
