"""Stages `preference_rankings` and `preference_pairs` (iteration 0) of the reward-model and DPO flows.

`preference_rankings`: the user's file (`preference.data`; prompts as strings or chat messages, formatted like
rollouts), or generated offline: `k` samples per train prompt of the run's `dataset` from model.path (vLLM), each
scored by the run's reward functions and ranked by the score of `eval.judge` (higher is better; equal scores tie);
prompts where every sample ties are dropped; a seeded fraction of prompts is held out. `preference_pairs`: every
(better, worse) pair of each ranking.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from storage import StageOutput, read_stage
from storage.model_ids import model_fingerprint
from storage.stage_io import sha256_file
from tasks.data.formatting import PromptFormatter, load_tokenizer
from tasks.data.preferences import (
    SPLITS,
    PreferenceDataError,
    assign_splits,
    load_preferences,
    pairs_from_rankings,
    rankings_from_samples,
)
from tasks.rewards.loader import source_hash, specs_from_config
from tasks.stages.common import Computed, RunContext, load_run, run_stage, stage_task
from tasks.stages.dataset import dataset_fingerprint
from tasks.stages.evaluate import judged
from tasks.stages.prompts import split_of
from tasks.stages.rollouts import generate, sampling_job
from tasks.stages.scores import reward_models
from tasks.stages.spec import StageSpec


def generated_rankings(ctx: RunContext) -> Computed:
    p = ctx.cfg.preference
    train = split_of(ctx, "train").head(p.n_prompts)
    job = sampling_job(ctx, p.k, p.temperature, ctx.cfg.seed)
    (samples,), resp = generate(ctx, ctx.cfg.model.path, train, [job], "preference-samples")
    scored = judged(ctx, samples, train, "preference-rm")
    judge = "reward" if ctx.cfg.eval.judge == "reward" else f"score_{ctx.cfg.eval.judge}"
    ranked = scored.select("prompt_id", pl.col("text").alias("response"), pl.col(judge).alias("reward")).join(
        train.select("prompt_id", pl.col("text").alias("prompt"), "prompt_token_ids"), on="prompt_id", how="left"
    )
    rankings = rankings_from_samples(ranked)
    rankings = assign_splits(rankings, p.heldout_fraction, ctx.cfg.seed)
    extra = {
        "source": "generated",
        "prompts": train.height,
        "samples": samples.height,
        "rankings": rankings.height,
        "sample_accuracy": float(scored["correct"].mean()),
    }
    return Computed(rankings, engines={"vllm": resp.vllm_version}, extra=extra)


@stage_task("preference_rankings")
def preference_rankings_task(storage_root: str, run_id: str) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    p = ctx.cfg.preference

    def compute():
        if p.data:
            formatter = PromptFormatter(load_tokenizer(ctx.cfg.model.path), ctx.cfg.prompt)
            rankings = load_preferences(p.data, p.heldout_fraction, ctx.cfg.seed, formatter)
            return Computed(rankings, extra={"source": p.data, "rankings": rankings.height})
        return generated_rankings(ctx)

    if p.data:
        inputs = {
            "data": sha256_file(Path(p.data))[:20] if Path(p.data).is_file() else "missing",
            "model": model_fingerprint(ctx.cfg.model.path),
        }
        salt = ""
    else:
        inputs = {
            "model": model_fingerprint(ctx.cfg.model.path),
            "dataset": dataset_fingerprint(ctx)[0],
            **reward_models(ctx.cfg.reward),  # the samples are ranked by judged(): its reward model and judges too
        }
        salt = source_hash(specs_from_config(ctx.cfg.reward))
    return run_stage(ctx, 0, salt=salt, inputs=inputs, compute=compute)


@stage_task("preference_pairs")
def preference_pairs_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, PAIRS_SPEC)

    def compute():
        pairs = pairs_from_rankings(read_stage(ctx.layout, "preference_rankings", 0))
        counts = {split: int((pairs["split"] == split).sum()) for split in SPLITS}
        if not all(counts.values()):
            raise PreferenceDataError(
                f"preference data has {counts['train']} train and {counts['heldout']} held-out pairs; both must be > 0 "
                "(raise preference.n_prompts or preference.k, or check that the samples' rewards differ)"
            )
        return Computed(pairs, extra={"pairs_by_split": counts})

    return run_stage(ctx, 0, inputs={"rankings": upstream["preference_rankings"]}, compute=compute)


# Reads the dataset only when it samples (no preference.data): it fingerprints the dataset itself, so it asks the graph
# for no `upstream` (a run from a file may hold no dataset).
SPEC = StageSpec(
    "preference_rankings",
    reads=("dataset",),
    scope="run",
    sections=("preference", "prompt", "rollout", "reward", "eval", "model", "lora", "data", "optim"),
    task=preference_rankings_task,
)
PAIRS_SPEC = StageSpec(
    "preference_pairs", reads=("preference_rankings",), sections=(), scope="run", task=preference_pairs_task
)
