"""Stages `preference_rankings` and `preference_pairs` (iteration 0) of the reward-model and DPO flows.

`preference_rankings`: the user's file (`preference.data`), or generated offline from the task: `k` samples
per train prompt from model.path (vLLM), each judged by the rule reward (math-verify accuracy), ranked
correct ≻ incorrect with equal rewards tied; prompts where all samples agree are dropped; a seeded fraction
of prompts is held out. `preference_pairs`: every (better, worse) pair of each ranking.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from storage import StageOutput, read_stage
from storage.stage_io import sha256_file
from tasks.stages.common import Computed, load_run, run_stage, stage_task
from tasks.data.datasets import load_prompt_dataset, task_splits
from tasks.stages.evaluate import judge
from tasks.stages.weights import model_fingerprint
from tasks.data.preferences import SPLITS, PreferenceDataError, assign_splits, load_preferences, pairs_from_rankings, rankings_from_samples
from tasks.rewards.builtin import code_hash
from tasks.stages.rollouts import generate


def _file_fingerprint(path: str) -> str:
    return sha256_file(Path(path))[:20] if Path(path).exists() else "missing"


@stage_task("preference_rankings")
def preference_rankings_task(storage_root: str, run_id: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    p = ctx.cfg.preference

    def compute():
        if p.data:
            rankings = load_preferences(p.data, p.heldout_fraction, ctx.cfg.seed)
            return Computed(rankings, extra={"source": p.data, "rankings": rankings.height})
        train = load_prompt_dataset(task_splits(ctx.cfg.task)["train"]).head(p.n_prompts)
        job = {"n": p.k, "temperature": p.temperature, "top_p": 1.0, "max_tokens": ctx.cfg.rollout.max_tokens, "seed": ctx.cfg.seed}
        (samples,), resp = generate(ctx, ctx.cfg.model.path, train, [job], "preference-samples")
        correct = judge(samples, dict(zip(train["prompt_id"], train["answer"])))
        scored = samples.select("prompt_id", pl.col("text").alias("response")).with_columns(correct.cast(pl.Float64).alias("reward"))
        scored = scored.join(train.select("prompt_id", pl.col("text").alias("prompt")), on="prompt_id", how="left")
        rankings = assign_splits(rankings_from_samples(scored), p.heldout_fraction, ctx.cfg.seed)
        extra = {"source": "generated", "prompts": train.height, "samples": samples.height, "rankings": rankings.height,
                 "sample_accuracy": float(correct.mean())}
        return Computed(rankings, engines={"vllm": resp["vllm_version"]}, extra=extra)

    if p.data:
        inputs = {"data": _file_fingerprint(p.data)}
    else:
        inputs = {"model": model_fingerprint(ctx.cfg.model.path)}
    return run_stage(ctx, "preference_rankings", 0, sections=("preference", "task", "rollout"), salt=code_hash(["accuracy"]),
                     inputs=inputs, compute=compute)


@stage_task("preference_pairs")
def preference_pairs_task(storage_root: str, run_id: str, rankings_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)

    def compute():
        pairs = pairs_from_rankings(read_stage(ctx.layout, "preference_rankings", 0))
        counts = {split: int((pairs["split"] == split).sum()) for split in SPLITS}
        if not all(counts.values()):
            raise PreferenceDataError(
                f"preference data has {counts['train']} train and {counts['heldout']} held-out pairs; both must be > 0 "
                "(raise preference.n_prompts or preference.k, or check that the samples' rewards differ)"
            )
        return Computed(pairs, extra={"pairs_by_split": counts})

    return run_stage(ctx, "preference_pairs", 0, sections=(), inputs={"rankings": rankings_fp}, compute=compute)
