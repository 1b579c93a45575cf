"""Stages of the DPO flow after the preference data: `ref_logprobs`, `dpo_metrics` (optimize), `dpo_eval`.

`ref_logprobs` (iteration 0): the frozen reference's (model.path) sequence logprob of the chosen and the
rejected response of every pair, computed once. `dpo_metrics` (iteration 1): DPO on the train pairs with
DeepSpeed from model.path into `checkpoints/iter=1/`, exported to `dpo.out_path`; one row per step with
loss, reward margin and accuracy, chosen and rejected logps. `dpo_eval` (iteration 1): the implicit reward
β·(log π − log π_ref) of both responses of each held-out pair under the trained policy.
"""

from __future__ import annotations

import polars as pl

from storage import StageOutput, read_stage
from storage.model_ids import model_fingerprint
from tasks.stages.common import Computed, RunContext, load_run, run_stage, score_frame_worker, stage_task
from tasks.stages.reward_model import ensure_exported, pair_eval_frame, train_preference_model, with_token_ids
from tasks.stages.spec import StageSpec

KEYS = ["prompt_id", "pair_idx"]


def sequence_logprobs(ctx: RunContext, model_path: str, pairs: pl.DataFrame, name: str) -> pl.DataFrame:
    """prompt_id, pair_idx, chosen_logp, rejected_logp of `pairs` under the model at `model_path`."""
    data = with_token_ids(
        ctx,
        pairs.select(*KEYS, "prompt_token_ids", "chosen", "rejected"),
        {"chosen": "chosen_token_ids", "rejected": "rejected_token_ids"},
    )
    return score_frame_worker(ctx, "seq_logprobs", model_path, ctx.cfg.dpo.micro_batch_size, data, name)


@stage_task("ref_logprobs")
def ref_logprobs_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, REF_SPEC)

    def compute():
        pairs = read_stage(ctx.layout, "preference_pairs", 0)
        return Computed(sequence_logprobs(ctx, ctx.cfg.model.path, pairs, "ref_logprobs"))

    return run_stage(
        ctx,
        0,
        compute=compute,
        inputs={"pairs": upstream["preference_pairs"], "ref": model_fingerprint(ctx.cfg.model.path)},
    )


@stage_task("dpo_optimize")
def dpo_optimize_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, TRAIN_SPEC)
    d = ctx.cfg.dpo

    def compute():
        ref = read_stage(ctx.layout, "ref_logprobs", 0).rename(
            {"chosen_logp": "ref_chosen_logp", "rejected_logp": "ref_rejected_logp"}
        )
        train = (
            read_stage(ctx.layout, "preference_pairs", 0)
            .filter(pl.col("split") == "train")
            .join(ref, on=KEYS, validate="1:1")
        )
        train = with_token_ids(ctx, train, {"chosen": "chosen_token_ids", "rejected": "rejected_token_ids"})
        final, resp, metrics = train_preference_model(ctx, "dpo", train, d, d.beta, d.nll_coef)
        return Computed(
            metrics,
            engines={"deepspeed": resp["deepspeed_version"], "zero_stage": resp["zero_stage"]},
            extra={
                "checkpoint": str(final),
                "exported_to": d.out_path,
                "train_seconds": resp["train_seconds"],
                "pairs": train.height,
            },
        )

    out = run_stage(
        ctx,
        1,
        compute=compute,
        inputs={
            "pairs": upstream["preference_pairs"],
            "ref": upstream["ref_logprobs"],
            "policy": model_fingerprint(ctx.cfg.model.path),
        },
    )
    ensure_exported(ctx.layout.checkpoint_dir(1), d.out_path)
    return out


@stage_task("dpo_eval")
def dpo_eval_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, EVAL_SPEC)
    beta = ctx.cfg.dpo.beta

    def compute():
        held = read_stage(ctx.layout, "preference_pairs", 0).filter(pl.col("split") == "heldout")
        policy = sequence_logprobs(ctx, str(ctx.layout.checkpoint_dir(1)), held, "dpo_eval")
        df = policy.join(read_stage(ctx.layout, "ref_logprobs", 0), on=KEYS, suffix="_ref", validate="1:1")
        rewards = [
            df.select(*KEYS, (beta * (pl.col(f"{s}_logp") - pl.col(f"{s}_logp_ref"))).alias("score"))
            for s in ("chosen", "rejected")
        ]
        out = pair_eval_frame(*rewards)
        margin = float((out["chosen_score"] - out["rejected_score"]).mean())
        return Computed(
            out, extra={"reward_accuracy": float(out["correct"].mean()), "reward_margin": margin, "pairs": out.height}
        )

    return run_stage(
        ctx,
        1,
        compute=compute,
        inputs={"pairs": upstream["preference_pairs"], "ref": upstream["ref_logprobs"], "dpo": upstream["dpo_metrics"]},
    )


REF_SPEC = StageSpec(
    "ref_logprobs",
    reads=("preference_pairs",),
    sections=("dpo", "model", "prompt"),
    scope="run",
    task=ref_logprobs_task,
)
TRAIN_SPEC = StageSpec(
    "dpo_metrics",
    reads=("preference_pairs", "ref_logprobs"),
    sections=("dpo", "model", "lora", "prompt"),
    scope="run",
    also_writes=("checkpoints",),
    task=dpo_optimize_task,
)
EVAL_SPEC = StageSpec(
    "dpo_eval",
    reads=("preference_pairs", "ref_logprobs", "dpo_metrics"),
    sections=("dpo", "model", "prompt"),
    scope="run",
    task=dpo_eval_task,
)
