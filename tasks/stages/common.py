"""What every stage task shares: the run context and the skip-or-compute-then-write runner."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import polars as pl
import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from schemas.config import RunConfig, build_config
from schemas.errors import NotFound
from storage import RunLayout, StageOutput, find_complete, fingerprint, write_stage
from tasks.engines.launch import run_worker


def stage_task(name: str):
    """A Prefect task for a stage. Prefect's own result cache is off: the manifests are the cache."""
    return task(name=name, cache_policy=NO_CACHE)


@dataclass(frozen=True)
class RunContext:
    layout: RunLayout
    cfg: RunConfig


def load_run(storage_root: str, run_id: str) -> RunContext:
    layout = RunLayout(Path(storage_root), run_id)
    if not layout.config_path.exists():
        raise NotFound(f"run {run_id!r} has no config at {layout.config_path}")
    return RunContext(layout, build_config(yaml.safe_load(layout.config_path.read_text())))


@dataclass
class Computed:
    """What a stage's compute step produced: the frame plus manifest extras."""

    frame: pl.DataFrame
    engines: dict | None = None
    extra: dict | None = None


def run_stage(
    ctx: RunContext,
    stage: str,
    iteration: int,
    *,
    sections: tuple[str, ...],
    inputs: dict[str, str],
    compute: Callable[[], Computed],
    part: int = 0,
    salt: str = "",
) -> StageOutput:
    """Skip the stage if its part is complete with the same fingerprint; otherwise compute and write it.

    The fingerprint covers the stage name, the config sections it depends on (plus `salt`, e.g. a hash of
    reward-function code) and the fingerprints of its inputs.
    """
    config_hash = ctx.cfg.section_hash(*sections) + salt
    fp = fingerprint(stage, config_hash, inputs)
    done = find_complete(ctx.layout, stage, iteration, fp, part)
    if done is not None:
        return done
    started = time.time()
    out = compute()
    return write_stage(
        ctx.layout, stage, iteration, out.frame, fp=fp, inputs=inputs, config_hash=config_hash,
        started=started, part=part, engines=out.engines, extra=out.extra,
    )


def export_checkpoint(checkpoint: Path, dest: str | Path) -> None:
    """Copy a committed checkpoint to a model folder (what `model.path` or vLLM loads), without the
    optimizer state; an existing folder is replaced."""
    import shutil

    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(checkpoint, dest, ignore=shutil.ignore_patterns("ds_state"))


def scratch_file(ctx: RunContext, name: str) -> Path:
    ctx.layout.scratch_dir.mkdir(parents=True, exist_ok=True)
    return ctx.layout.scratch_dir / name


def frame_worker(ctx: RunContext, module: str, request: dict, frame: pl.DataFrame, name: str, log: str | None = None) -> pl.DataFrame:
    """Run a worker on one table: `frame` goes in as `data_path`, the table it writes to `out_path` comes
    back (both scratch files, removed after); its log is logs/{log or name}.log."""
    data_path, out_path = scratch_file(ctx, f"{name}.in.parquet"), scratch_file(ctx, f"{name}.out.parquet")
    frame.write_parquet(data_path)
    run_worker(module, {**request, "data_path": str(data_path), "out_path": str(out_path)}, ctx.layout.scratch_dir,
               ctx.layout.log_path(log or name))
    out = pl.read_parquet(out_path)
    data_path.unlink(), out_path.unlink()
    return out


@stage_task("plan")
def plan_task(storage_root: str, run_id: str) -> dict:
    """The loop bounds of a run, read from its saved config (flows stay free of data code)."""
    cfg = load_run(storage_root, run_id).cfg
    return {"iterations": cfg.rl.iterations, "eval_every": cfg.rl.eval_every, "ptx": cfg.loss.ptx_coef > 0,
            "model_path": cfg.model.path}
