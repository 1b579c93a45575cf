"""Stage `eval`: greedy pass@1 and sampled pass@k on the held-out split of the run's `dataset`, with vLLM.

Reads `dataset` (split eval, at most eval.max_prompts) and the weights after iteration k (k = 0: the starting
model); writes `eval`, one row per prompt. Every response is scored by the run's reward functions, in the reward
pool as in training; a response is correct when score_<eval.judge> ≥ eval.judge_threshold. The manifest records
the greedy accuracy, pass@k, the mean reward and length of the greedy responses, the samples' mean reward and each
function's error rate, and the label prior (the accuracy of always giving the most common held-out answer); per source
too (`accuracy/<source>`, `label_prior/<source>`, ...) when the dataset has a `source` column; with a
reward model, also its Spearman correlation with the judge on the samples.
"""

from __future__ import annotations

from math import comb

import polars as pl

from storage import StageOutput
from tasks.algos.metrics import label_prior, spearman
from tasks.rewards.loader import source_hash, specs_from_config
from tasks.stages import agent_rollouts
from tasks.stages.common import Computed, RunContext, load_run, run_stage, stage_task
from tasks.stages.dataset import dataset_fingerprint
from tasks.stages.prompts import split_of
from tasks.stages.rollouts import generate, one_job, sampling_job
from tasks.stages.scores import reward_models, scored
from tasks.stages.spec import StageSpec
from tasks.stages.weights import weights_after, weights_fingerprint

# Reads the weights after the iteration: the checkpoint train_metrics (or dpo_metrics) marks complete.
SPEC = StageSpec(
    "eval",
    reads=("dataset", "train_metrics"),
    sections=("eval", "rollout", "reward", "data", "model", "lora", "optim", "agent"),
    scope="iteration",
)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n−c, k)/C(n, k) (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def judged(
    ctx: RunContext, responses: pl.DataFrame, held_out: pl.DataFrame, name: str, turns: pl.DataFrame | None = None
) -> pl.DataFrame:
    """The responses with every reward column, the total `reward` and `correct` (the judge's score ≥ threshold).
    Multi-turn responses come with their `turns` rows, for the reward functions that read them."""
    stamp = (pl.lit(0, pl.Int32).alias("iteration"), pl.lit(0, pl.Int32).alias("round"))
    frame = responses.with_columns(*stamp)
    turns = turns.with_columns(*stamp) if turns is not None else None
    scores = scored(ctx, frame, held_out, name, turns)
    e = ctx.cfg.eval
    judge = "reward" if e.judge == "reward" else f"score_{e.judge}"
    out = responses.with_columns(scores.select(pl.exclude("iteration", "round", "prompt_id", "sample_idx")))
    return out.with_columns((pl.col(judge) >= e.judge_threshold).alias("correct"))


def eval_table(
    held_out: pl.DataFrame, greedy: pl.DataFrame, sampled: pl.DataFrame, k: int, iteration: int
) -> pl.DataFrame:
    """One row per held-out prompt from the greedy and sampled responses, each already judged (`correct`, `reward`)."""
    g = greedy.select(
        "prompt_id",
        pl.col("text").alias("greedy_text"),
        pl.col("correct").alias("greedy_correct"),
        pl.col("length").alias("greedy_length"),
        pl.col("reward").alias("greedy_reward"),
    )
    s = sampled.group_by("prompt_id").agg(
        pl.len().cast(pl.Int32).alias("n_samples"),
        pl.col("correct").sum().cast(pl.Int32).alias("n_correct"),
        pl.col("reward").mean().alias("sampled_reward_mean"),
    )
    out = held_out.select("prompt_id", pl.col("answer").fill_null("")).join(g, on="prompt_id").join(s, on="prompt_id")
    return out.with_columns(
        pl.lit(iteration, pl.Int32).alias("iteration"),
        pl.struct("n_samples", "n_correct")
        .map_elements(lambda r: pass_at_k(r["n_samples"], r["n_correct"], k), return_dtype=pl.Float64)
        .alias("pass_at_k"),
    )


def sources_of(held_out: pl.DataFrame) -> pl.DataFrame | None:
    """(prompt_id, source) when the dataset has a `source` column (the reasoning_gym task writes one), else None."""
    extra = held_out.schema.get("extra")
    if not isinstance(extra, pl.Struct) or "source" not in {f.name for f in extra.fields}:
        return None
    return held_out.select("prompt_id", pl.col("extra").struct.field("source").cast(pl.Utf8).fill_null(""))


def source_figures(df: pl.DataFrame, sources: pl.DataFrame, k: int) -> dict:
    """Per source: greedy accuracy, pass@k, greedy mean length, prompts and the label prior (the accuracy of always
    giving the source's most common held-out answer), as flat keys (`accuracy/<source>`), which the tracking backends
    log as `eval/accuracy/<source>`."""
    out = {}
    joined = df.join(sources, on="prompt_id")
    priors = {s: label_prior(rows["answer"]) for (s,), rows in joined.partition_by("source", as_dict=True).items()}
    per = joined.group_by("source").agg(
        pl.col("greedy_correct").mean().alias("accuracy"),
        pl.col("pass_at_k").mean().alias(f"pass_at_{k}"),
        pl.col("greedy_length").mean().alias("mean_length"),
        pl.len().alias("prompts"),
    )
    for row in per.sort("source").iter_rows(named=True):
        source = row.pop("source")
        out.update({f"{name}/{source}": (int(v) if name == "prompts" else float(v)) for name, v in row.items()})
        if priors[source] is not None:
            out[f"label_prior/{source}"] = priors[source]
    return out


def eval_summary(
    ctx: RunContext, df: pl.DataFrame, greedy: pl.DataFrame, sampled: pl.DataFrame, sources: pl.DataFrame | None = None
) -> dict:
    e = ctx.cfg.eval
    both = pl.concat([greedy.select(pl.col("^error_.*$")), sampled.select(pl.col("^error_.*$"))])
    summary = {
        "accuracy": float(df["greedy_correct"].mean()),
        f"pass_at_{e.pass_k}": float(df["pass_at_k"].mean()),
        "mean_reward": float(df["greedy_reward"].mean()),
        "sampled_mean_reward": float(sampled["reward"].mean()),
        "mean_length": float(df["greedy_length"].mean()),
        "prompts": df.height,
        **({"label_prior": prior} if (prior := label_prior(df["answer"])) is not None else {}),
        **{f"{c.replace('error_', 'error_rate_')}": float(both[c].is_not_null().mean()) for c in both.columns},
    }
    if sources is not None:
        summary.update(source_figures(df, sources, e.pass_k))
    if ctx.cfg.reward.kind == "model":  # does the reward model still rank like the judge on unseen prompts?
        summary["reward_model_rule_spearman"] = spearman(sampled, "score_model", "correct")
    return summary


def episodes(ctx: RunContext, model_path: str, held_out: pl.DataFrame, name: str):
    """The agent section's eval: a greedy episode and eval.samples sampled ones per held-out prompt, played as in
    training and judged with their turns; the greedy episodes' turns, tool calls and their errors summarized."""
    e, frames, seed = ctx.cfg.eval, one_job(ctx, model_path), ctx.cfg.seed
    greedy, greedy_turns, resp, _ = agent_rollouts.play(
        ctx, model_path, held_out, 1, seed, f"{name}-greedy", frames, lambda s: sampling_job(ctx, 1, 0.0, s)
    )
    sampled, sampled_turns, _, _ = agent_rollouts.play(
        ctx, model_path, held_out, e.samples, seed + 1, f"{name}-sampled", frames,
        lambda s: sampling_job(ctx, 1, e.temperature, s),
    )  # fmt: skip
    greedy = judged(ctx, greedy, held_out, f"{name}-rm-greedy", greedy_turns)
    sampled = judged(ctx, sampled, held_out, f"{name}-rm-sampled", sampled_turns)
    calls = int(greedy["tool_calls"].sum())
    extra = {
        "mean_turns": float(greedy["turns"].mean()),
        "tool_call_rate": float((greedy["tool_calls"] > 0).mean()),
        "tool_error_rate": float(greedy["tool_errors"].sum() / calls) if calls else 0.0,
        "mean_env_reward": float(greedy["env_reward"].fill_null(0.0).mean()),
        "agent_error_rate": float(greedy["agent_error"].is_not_null().mean()),
    }
    return greedy, sampled, resp, extra


@stage_task("eval")
def eval_task(
    storage_root: str, run_id: str, iteration: int, weights_stage: str = "train_metrics", interim: bool = False
) -> StageOutput | None:
    """None when the run has no held-out prompts (data.eval_files empty and data.eval_fraction 0). `interim`: an eval
    during training, on eval.interim_prompts held-out prompts when that is set."""
    ctx = load_run(storage_root, run_id, SPEC)
    dataset_fp, stats = dataset_fingerprint(ctx)
    if not stats["prompts"]["eval"]:
        return None
    e = ctx.cfg.eval
    subset = e.interim_prompts if interim and e.interim_prompts else None
    limit = min(n for n in (subset, e.max_prompts) if n) if subset or e.max_prompts else None

    def compute():
        weights = weights_after(ctx, iteration, weights_stage)
        held_out = split_of(ctx, "eval")
        held_out = held_out.head(limit) if limit else held_out
        if ctx.cfg.agent.enabled:
            greedy, sampled, resp, extra = episodes(ctx, weights.path, held_out, f"eval-{iteration:05d}")
        else:
            seed = ctx.cfg.seed
            jobs = [sampling_job(ctx, 1, 0.0, seed), sampling_job(ctx, e.samples, e.temperature, seed + 1)]
            (greedy, sampled), resp = generate(ctx, weights.path, held_out, jobs, f"eval-{iteration:05d}")
            greedy, sampled = (
                judged(ctx, f, held_out, f"eval-rm-{name}") for f, name in ((greedy, "greedy"), (sampled, "sampled"))
            )
            extra = {}
        df = eval_table(held_out, greedy, sampled, e.pass_k, iteration)
        summary = {**eval_summary(ctx, df, greedy, sampled, sources_of(held_out)), **extra}
        return Computed(df, engines={"vllm": resp.vllm_version}, extra=summary)

    inputs = {
        "weights": weights_fingerprint(ctx, iteration, weights_stage),
        "dataset": dataset_fp,
        **reward_models(ctx.cfg.reward),
    }
    salt = source_hash(specs_from_config(ctx.cfg.reward)) + (f":interim{subset}" if subset else "")
    return run_stage(ctx, iteration, salt=salt, inputs=inputs, compute=compute)
