"""SFT stages: `sft_data` (generated demonstrations) and `sft_metrics` (a DeepSpeed run + checkpoint).

The checkpoint is written to the run's `checkpoints/sft/` and exported to `model.path`, which is where the
RL flow starts from (its policy and its frozen reference).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from storage import StageOutput, commit_dir, read_stage, temp_dir_for
from tasks.data.arithmetic import demonstrations
from tasks.stages.common import Computed, export_checkpoint, stage_task, load_run, run_stage, scratch_file
from tasks.data.datasets import load_prompt_dataset, task_splits
from tasks.engines.launch import run_worker
from tasks.stages.weights import model_fingerprint
from tasks.engines.workers import TRAIN_WORKER


@stage_task("sft_data")
def sft_data_task(storage_root: str, run_id: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    s = ctx.cfg.sft

    def compute():
        train = load_prompt_dataset(task_splits(ctx.cfg.task)["train"])
        return Computed(demonstrations(train, s.n_demos, ctx.cfg.seed, s.teacher_flaw, s.teacher_flaw_rate))

    return run_stage(ctx, "sft_data", 0, sections=("task", "sft"), inputs={}, compute=compute)


@stage_task("sft_train")
def sft_train_task(storage_root: str, run_id: str, data_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id)
    s, base = ctx.cfg.sft, ctx.cfg.model.base_path
    final = ctx.layout.sft_checkpoint_dir

    def compute():
        data_path, metrics_path = scratch_file(ctx, "sft.in.parquet"), scratch_file(ctx, "sft.metrics.parquet")
        read_stage(ctx.layout, "sft_data", 0).write_parquet(data_path)
        tmp = temp_dir_for(final)
        resp = run_worker(
            TRAIN_WORKER,
            {
                "mode": "sft", "model_path": base, "tmp_dir": str(tmp), "metrics_path": str(metrics_path),
                "data_path": str(data_path), "seed": ctx.cfg.seed, "zero_stage": s.zero_stage, "lr": s.lr,
                "weight_decay": 0.0, "grad_clip": 1.0, "micro_batch_size": ctx.cfg.optim.micro_batch_size,
                "steps": s.steps, "batch_size": s.batch_size, "warmup_steps": s.warmup_steps,
            },
            ctx.layout.scratch_dir, ctx.layout.log_path("sft"),
        )
        commit_dir(tmp, final)
        export = Path(ctx.cfg.model.path)
        export_checkpoint(final, export)
        metrics = pl.read_parquet(metrics_path)
        data_path.unlink(), metrics_path.unlink()
        return Computed(
            metrics, engines={"deepspeed": resp["deepspeed_version"], "zero_stage": resp["zero_stage"]},
            extra={"checkpoint": str(final), "exported_to": str(export), "train_seconds": resp["train_seconds"]},
        )

    out = run_stage(
        ctx, "sft_metrics", 0, sections=("sft",), inputs={"data": data_fp, "base": model_fingerprint(base)},
        compute=compute,
    )
    if not Path(ctx.cfg.model.path, "config.json").exists():  # a skipped stage whose export was removed
        export_checkpoint(final, ctx.cfg.model.path)
    return out
