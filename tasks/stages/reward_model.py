"""Stages of the reward-model flow after the preference data: `rm_metrics` (optimize) and `rm_eval`.

`rm_metrics` (iteration 1): reads the train split of `preference_rankings`; trains a Bradley–Terry reward
model with DeepSpeed (tasks/engines/workers/preference_train.py) into `checkpoints/iter=1/` and exports it to
`reward_model.out_path`; one row per optimizer step. `rm_eval` (iteration 1): scores both responses of
every held-out pair of `preference_pairs`; one row per pair, `correct` when chosen scores higher.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from schemas.requests import EngineSettings, PreferenceTrainRequest, Schedule
from schemas.tables import LIST_I32
from storage import StageOutput, commit_dir, read_stage, temp_dir_for
from storage.model_ids import model_fingerprint
from tasks.data.formatting import PromptFormatter, load_tokenizer
from tasks.engines.resident import run_worker
from tasks.engines.trainer_client import trainer_placement
from tasks.engines.workers import PREFERENCE_WORKER
from tasks.stages.common import (
    Computed,
    RunContext,
    export_checkpoint,
    load_run,
    policy_lora,
    run_stage,
    score_frame_worker,
    scratch_file,
    stage_task,
)
from tasks.stages.spec import StageSpec


def with_token_ids(ctx: RunContext, frame: pl.DataFrame, columns: dict[str, str]) -> pl.DataFrame:
    """Responses as the tokens the trainer sees ({text column: ids column}): formatted like a sampled response,
    EOS included (tasks/data/formatting.py). A column of lists of responses gives lists of token lists."""
    formatter = PromptFormatter(load_tokenizer(ctx.cfg.model.path), ctx.cfg.prompt)
    out = {}
    for text, ids in columns.items():
        values = frame[text].to_list()
        if isinstance(frame.schema[text], pl.List):
            out[ids] = pl.Series(
                ids, [[formatter.response_ids(r) for r in rs] for rs in values], dtype=pl.List(LIST_I32)
            )
        else:
            out[ids] = pl.Series(ids, [formatter.response_ids(r) for r in values], dtype=LIST_I32)
    return frame.with_columns(**out)


def train_preference_model(
    ctx: RunContext,
    kind: str,
    data: pl.DataFrame,
    settings,
    beta: float = 0.0,
    nll_coef: float = 0.0,
    trainable_layers: int | None = None,
) -> tuple[Path, dict, pl.DataFrame]:
    """Run a DeepSpeed preference trainer (kind rm or dpo) from model.path into checkpoints/iter=1, renamed into place
    and exported to settings.out_path; returns (checkpoint, worker response, per-step metrics)."""
    data_path, metrics_path = scratch_file(ctx, f"{kind}.in.parquet"), scratch_file(ctx, f"{kind}.metrics.parquet")
    data.write_parquet(data_path)
    final = ctx.layout.checkpoint_dir(1)
    tmp = temp_dir_for(final)
    request = PreferenceTrainRequest(
        kind=kind,
        model_path=ctx.cfg.model.path,
        tmp_dir=str(tmp),
        data_path=str(data_path),
        metrics_path=str(metrics_path),
        seed=ctx.cfg.seed,
        engine=EngineSettings.for_preferences(settings, ctx.cfg.model, policy_lora(ctx) if kind == "dpo" else None),
        schedule=Schedule(steps=settings.steps, batch_size=settings.batch_size, warmup_steps=settings.warmup_steps),
        beta=beta,
        nll_coef=nll_coef,
        trainable_layers=trainable_layers,
    )
    resp = run_worker(
        PREFERENCE_WORKER,
        request,
        ctx.layout.log_path(f"{kind}_train"),
        ranks=ctx.cfg.engines.train_ranks,
        devices=ctx.cfg.engines.trainer_devices,
        placement=trainer_placement(ctx.cfg.engines),
    )
    commit_dir(tmp, final)
    export_checkpoint(final, settings.out_path)
    metrics = pl.read_parquet(metrics_path)
    data_path.unlink(), metrics_path.unlink()
    return final, resp, metrics


def trained_model(ctx: RunContext, kind: str, data: pl.DataFrame, settings, rows: str) -> Computed:
    """A reward model's training stage's output (kind rm or prm): its per-step metrics, with the checkpoint, where it
    was exported, the training time and how many `rows` it trained on."""
    final, resp, metrics = train_preference_model(ctx, kind, data, settings, trainable_layers=settings.trainable_layers)
    return Computed(
        metrics,
        engines={"deepspeed": resp["deepspeed_version"], "zero_stage": resp["zero_stage"]},
        extra={
            "checkpoint": str(final),
            "exported_to": settings.out_path,
            "train_seconds": resp["train_seconds"],
            rows: data.height,
        },
    )


def ensure_exported(checkpoint: Path, dest: str) -> None:
    """A skipped training stage whose exported copy was removed: copy it again."""
    if not Path(dest, "config.json").exists():
        export_checkpoint(checkpoint, dest)


@stage_task("rm_optimize")
def rm_optimize_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, TRAIN_SPEC)
    r = ctx.cfg.reward_model

    def compute():
        train = read_stage(ctx.layout, "preference_rankings", 0).filter(pl.col("split") == "train")
        train = with_token_ids(ctx, train, {"responses": "response_token_ids"})
        return trained_model(ctx, "rm", train, r, "rankings")

    out = run_stage(
        ctx,
        1,
        compute=compute,
        inputs={"rankings": upstream["preference_rankings"], "base": model_fingerprint(ctx.cfg.model.path)},
    )
    ensure_exported(ctx.layout.checkpoint_dir(1), r.out_path)
    return out


def heldout_sides(pairs: pl.DataFrame) -> pl.DataFrame:
    """Held-out pairs as one row per (pair, side): prompt_id, pair_idx, side, prompt, prompt_token_ids, response."""
    held = pairs.filter(pl.col("split") == "heldout")
    return pl.concat(
        [
            held.select(
                "prompt_id",
                "pair_idx",
                pl.lit(side).alias("side"),
                "prompt",
                "prompt_token_ids",
                pl.col(side).alias("response"),
            )
            for side in ("chosen", "rejected")
        ]
    )


def pair_eval_frame(chosen_score: pl.DataFrame, rejected_score: pl.DataFrame) -> pl.DataFrame:
    """Two frames (prompt_id, pair_idx, score) → one row per pair with `correct` = chosen scores higher."""
    keys = ["prompt_id", "pair_idx"]
    df = chosen_score.rename({"score": "chosen_score"}).join(
        rejected_score.rename({"score": "rejected_score"}), on=keys, validate="1:1"
    )
    return df.select(
        *keys, "chosen_score", "rejected_score", (pl.col("chosen_score") > pl.col("rejected_score")).alias("correct")
    )


@stage_task("rm_eval")
def rm_eval_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, EVAL_SPEC)

    def compute():
        sides = with_token_ids(
            ctx, heldout_sides(read_stage(ctx.layout, "preference_pairs", 0)), {"response": "response_token_ids"}
        )
        scored = score_frame_worker(
            ctx, "rm_score", str(ctx.layout.checkpoint_dir(1)), ctx.cfg.reward_model.micro_batch_size, sides, "rm_eval"
        ).select("prompt_id", "pair_idx", "side", "score")
        df = pair_eval_frame(*(scored.filter(pl.col("side") == s).drop("side") for s in ("chosen", "rejected")))
        return Computed(df, extra={"pairwise_accuracy": float(df["correct"].mean()), "pairs": df.height})

    return run_stage(
        ctx, 1, inputs={"pairs": upstream["preference_pairs"], "reward_model": upstream["rm_metrics"]}, compute=compute
    )


TRAIN_SPEC = StageSpec(
    "rm_metrics",
    reads=("preference_rankings",),
    sections=("reward_model", "model", "prompt"),
    scope="run",
    also_writes=("checkpoints",),
    task=rm_optimize_task,
)
EVAL_SPEC = StageSpec(
    "rm_eval",
    reads=("preference_pairs", "rm_metrics"),
    sections=("reward_model", "model", "prompt"),
    scope="run",
    task=rm_eval_task,
)
