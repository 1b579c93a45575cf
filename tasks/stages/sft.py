"""SFT stages: `sft_data` (the user's demonstrations, formatted and tokenized) and `sft_metrics` (a DeepSpeed run +
checkpoint).

`sft_data` (iteration 0) reads `sft.files` with the tokenizer of `tokenizer_path` (model.base_path for SFT,
model.path when PPO-ptx reuses the demonstrations in RL); `sft_metrics` trains model.base_path on its token ids.
The checkpoint is written to the run's `checkpoints/sft/` and exported to `model.path`, which is where the RL flow
starts from (its policy and its frozen reference).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from schemas.requests import EngineSettings, Schedule, SFTRequest
from storage import StageOutput, commit_dir, read_stage, temp_dir_for
from storage.model_ids import model_fingerprint, tokenizer_fingerprint
from tasks.data.datasets import files_fingerprint
from tasks.data.formatting import load_tokenizer
from tasks.data.sft_data import build_sft_examples
from tasks.engines.resident import run_worker
from tasks.engines.trainer_client import trainer_placement
from tasks.engines.workers import TRAIN_WORKER
from tasks.stages.common import Computed, export_checkpoint, load_run, policy_lora, run_stage, scratch_file, stage_task
from tasks.stages.spec import StageSpec


@stage_task("sft_data")
def sft_data_task(storage_root: str, run_id: str, tokenizer_path: str | None = None) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    s, path = ctx.cfg.sft, tokenizer_path or ctx.cfg.model.base_path

    def compute():
        table, stats = build_sft_examples(s, ctx.cfg.prompt, load_tokenizer(path), ctx.cfg.data.max_prompt_tokens)
        return Computed(table, extra=stats)

    inputs = {
        "files": files_fingerprint(s.files, "sft.files") if s.files else "",
        "tokenizer": tokenizer_fingerprint(path),
        "max_prompt_tokens": str(ctx.cfg.data.max_prompt_tokens),
    }
    return run_stage(ctx, 0, inputs=inputs, compute=compute)


@stage_task("sft_train")
def sft_train_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, TRAIN_SPEC)
    s, m = ctx.cfg.sft, ctx.cfg.model
    final = ctx.layout.sft_checkpoint_dir

    def compute():
        data_path, metrics_path = scratch_file(ctx, "sft.in.parquet"), scratch_file(ctx, "sft.metrics.parquet")
        read_stage(ctx.layout, "sft_data", 0).select("prompt_token_ids", "response_token_ids").write_parquet(data_path)
        tmp = temp_dir_for(final)
        request = SFTRequest(
            model_path=m.base_path,
            tmp_dir=str(tmp),
            data_path=str(data_path),
            metrics_path=str(metrics_path),
            seed=ctx.cfg.seed,
            engine=EngineSettings.for_sft(s, ctx.cfg.optim, m, policy_lora(ctx)),
            schedule=Schedule(steps=s.steps, batch_size=s.batch_size, warmup_steps=s.warmup_steps),
        )
        resp = run_worker(
            TRAIN_WORKER,
            request,
            ctx.layout.log_path("sft"),
            ranks=ctx.cfg.engines.train_ranks,
            devices=ctx.cfg.engines.trainer_devices,
            placement=trainer_placement(ctx.cfg.engines),
        )
        commit_dir(tmp, final)
        export = Path(m.path)
        export_checkpoint(final, export)
        metrics = pl.read_parquet(metrics_path)
        data_path.unlink(), metrics_path.unlink()
        return Computed(
            metrics,
            engines={"deepspeed": resp["deepspeed_version"], "zero_stage": resp["zero_stage"]},
            extra={"checkpoint": str(final), "exported_to": str(export), "train_seconds": resp["train_seconds"]},
        )

    out = run_stage(
        ctx, 0, inputs={"data": upstream["sft_data"], "base": model_fingerprint(m.base_path)}, compute=compute
    )
    if not Path(m.path, "config.json").exists():  # a skipped stage whose export was removed
        export_checkpoint(final, m.path)
    return out


SPEC = StageSpec("sft_data", reads=(), sections=("sft", "prompt", "data", "model"), scope="run", task=sft_data_task)
TRAIN_SPEC = StageSpec(
    "sft_metrics",
    reads=("sft_data",),
    sections=("sft", "model", "lora", "optim"),
    scope="run",
    also_writes=("checkpoints/sft",),
    task=sft_train_task,
)
