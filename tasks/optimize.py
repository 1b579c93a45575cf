"""Stage `optimize`: one policy update on a DeepSpeed engine, then the checkpoint.

Reads `rollouts`, `logprobs`, `advantages`, `scores` and `batch` of the iteration; writes the checkpoint
`checkpoints/iter=k/` (HF weights + tokenizer + DeepSpeed optimizer state, renamed into place) and then the
`train_metrics` row, whose manifest marks both complete.
"""

from __future__ import annotations

import polars as pl

from storage import StageOutput, commit_dir, read_manifest, read_stage
from tasks.common import Computed, stage_task, RunContext, load_run, run_stage, scratch_file
from tasks.engines.launch import run_worker
from tasks.logprobs import kept_rollouts
from tasks.metrics import advantage_metrics, rollout_metrics, sampler_gap
from tasks.policy import weights_after

STAGES_OF_AN_ITERATION = ("prompts", "rollouts", "scores", "batch", "logprobs", "advantages")


def training_frame(ctx: RunContext, iteration: int) -> pl.DataFrame:
    keys = ["prompt_id", "sample_idx"]
    rollouts = kept_rollouts(ctx, iteration).select(*keys, "prompt_token_ids", "token_ids", "truncated")
    logprobs = read_stage(ctx.layout, "logprobs", iteration).select(*keys, "old_logprobs", "ref_logprobs")
    adv = read_stage(ctx.layout, "advantages", iteration).select(*keys, "token_advantages")
    df = rollouts.join(logprobs, on=keys, validate="1:1").join(adv, on=keys, validate="1:1")
    return df.with_columns(pl.lit(1.0).alias("loss_mask"))


def stage_seconds(ctx: RunContext, iteration: int) -> dict[str, float]:
    out = {}
    for stage in STAGES_OF_AN_ITERATION:
        m = read_manifest(ctx.layout, stage, iteration, verify=False)
        if m:
            out[f"seconds_{stage}"] = float(m["wall_seconds"])
    return out


@stage_task("optimize")
def optimize_task(storage_root: str, run_id: str, iteration: int, advantages_fp: str, logprobs_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    policy = weights_after(ctx, iteration - 1)
    o, lc, kl = ctx.cfg.optim, ctx.cfg.loss, ctx.cfg.kl

    def compute():
        data_path = scratch_file(ctx, "optimize.in.parquet")
        training_frame(ctx, iteration).write_parquet(data_path)
        final = ctx.layout.checkpoint_dir(iteration)
        tmp = final.with_name(final.name + ".tmp")
        prev_state = f"{policy.path}/ds_state" if policy.version > 0 else None
        resp = run_worker(
            "deepspeed_train",
            {
                "mode": "rl", "model_path": policy.path, "tmp_dir": str(tmp), "metrics_path": "",
                "data_path": str(data_path), "resume_state": prev_state, "seed": ctx.cfg.seed + iteration,
                "zero_stage": o.zero_stage, "lr": o.lr, "weight_decay": o.weight_decay, "grad_clip": o.grad_clip,
                "micro_batch_size": o.micro_batch_size, "ppo_epochs": o.ppo_epochs, "minibatches": o.minibatches,
                "warmup_steps": o.warmup_steps, "first_step": (iteration - 1) * o.ppo_epochs * o.minibatches,
                "loss": {
                    "objective": lc.objective, "aggregation": lc.aggregation, "clip_eps_low": lc.clip_eps_low,
                    "clip_eps_high": lc.clip_eps_high, "dual_clip": lc.dual_clip, "kl_estimator": kl.estimator,
                    "kl_in_loss": kl.placement == "loss", "kl_beta": kl.beta,
                },
            },
            ctx.layout.scratch_dir, ctx.layout.log_path(f"optimize-{iteration:05d}"),
        )
        commit_dir(tmp, final)
        data_path.unlink()
        rollouts = read_stage(ctx.layout, "rollouts", iteration)
        row = {
            "iteration": iteration, "policy_version": iteration, **resp["metrics"],
            **rollout_metrics(rollouts, read_stage(ctx.layout, "scores", iteration), read_stage(ctx.layout, "batch", iteration)),
            **advantage_metrics(read_stage(ctx.layout, "advantages", iteration)),
            "sampler_logprob_gap": sampler_gap(rollouts, read_stage(ctx.layout, "logprobs", iteration)),
            "seconds_optimize": resp["train_seconds"], **stage_seconds(ctx, iteration),
        }
        frame = pl.DataFrame([row]).with_columns(
            pl.col("iteration", "policy_version").cast(pl.Int32), pl.col("optimizer_steps").cast(pl.Int32),
            pl.col("loss").cast(pl.Float64),
        )
        return Computed(
            frame, engines={"deepspeed": resp["deepspeed_version"], "zero_stage": resp["zero_stage"]},
            extra={"checkpoint": str(final)},
        )

    return run_stage(
        ctx, "train_metrics", iteration, sections=("optim", "loss", "kl"),
        inputs={"advantages": advantages_fp, "logprobs": logprobs_fp, "policy": policy.fingerprint}, compute=compute,
    )
