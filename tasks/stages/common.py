"""What every stage task shares: the run context and the skip-or-compute-then-write runner.
Imports: the LoRA merge (peft) only when a checkpoint is exported merged."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import polars as pl
import yaml
from prefect import task
from prefect.cache_policies import NO_CACHE

from schemas.config import RunConfig, build_config
from schemas.errors import NotFound
from schemas.requests import LoraSettings, ScoreRequest
from storage import RunLayout, StageOutput, find_complete, fingerprint, read_manifest, write_stage
from tasks.engines.resident import run_worker
from tasks.engines.trainer_client import trainer_placement
from tasks.engines.workers import SCORE_WORKER
from tasks.stages.spec import SectionView, StageSpec


def stage_task(name: str):
    """A Prefect task for a stage. Prefect's own result cache is off: the manifests are the cache."""
    return task(name=name, cache_policy=NO_CACHE)


@dataclass(frozen=True)
class RunContext:
    layout: RunLayout
    cfg: RunConfig  # a SectionView (the stage's declared sections only) when loaded for a stage
    spec: StageSpec | None = None


def load_run(storage_root: str, run_id: str, spec: StageSpec | None = None) -> RunContext:
    """The run's layout and saved config; for a stage (`spec`), the config it may see (tasks/stages/spec.py)."""
    layout = RunLayout(Path(storage_root), run_id)
    if not layout.config_path.exists():
        raise NotFound(f"run {run_id!r} has no config at {layout.config_path}")
    cfg = saved_config(layout.config_path.read_bytes())
    return RunContext(layout, SectionView(cfg, spec) if spec else cfg, spec)


_PARSED: dict[bytes, RunConfig] = {}


def saved_config(raw: bytes) -> RunConfig:
    """A saved config.yaml's content, parsed and validated once per content (the configs are frozen, so sharing one is
    safe): every stage of every iteration loads it, and parsing it cost ~30 ms a stage, 0.26 s of a 2.3 s demo
    iteration (measured). Keyed by the bytes themselves, so a rewritten config (--reconfigure) is parsed again."""
    if raw not in _PARSED:
        while len(_PARSED) >= 8:  # a long-lived Prefect worker runs many runs
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[raw] = build_config(yaml.safe_load(raw))
    return _PARSED[raw]


@dataclass
class Computed:
    """What a stage's compute step produced: the frame plus manifest extras, and its second tables (name → frame,
    each one of the stage's `also_writes`), which the runner writes first, with the stage's inputs."""

    frame: pl.DataFrame
    engines: dict | None = None
    extra: dict | None = None
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)


def run_stage(
    ctx: RunContext,
    iteration: int,
    *,
    inputs: dict[str, str],
    compute: Callable[[], Computed],
    part: int = 0,
    salt: str = "",
    recompute: bool = False,
) -> StageOutput:
    """Skip the stage if its part is complete with the same fingerprint (unless `recompute`: an output beside the
    table is known incomplete); otherwise compute and write it.

    The fingerprint covers the stage name, the config sections it declares (plus `salt`, e.g. a hash of
    reward-function code) and the fingerprints of its inputs, with the values of its spec's `key_inputs`. A second
    table's covers its own name, the same sections (without the salt) and the same inputs; it is written before the
    stage's own table, whose manifest, written last, marks both complete.
    """
    stage = ctx.spec.name
    inputs = {**inputs, **ctx.spec.key_input_values(ctx.cfg)}
    sections_hash = ctx.cfg.section_hash(*ctx.spec.sections, keys=ctx.spec.keys)
    config_hash = sections_hash + salt
    fp = fingerprint(stage, config_hash, inputs)
    done = None if recompute else find_complete(ctx.layout, stage, iteration, fp, part)
    if done is not None:
        return done
    started = time.time()
    out = compute()
    for name, frame in out.tables.items():
        if name not in ctx.spec.also_writes:
            raise ValueError(f"stage {stage!r} returned table {name!r}, which its also_writes does not declare")
        write_stage(
            ctx.layout,
            name,
            iteration,
            frame,
            fp=fingerprint(name, sections_hash, inputs),
            inputs=inputs,
            config_hash=sections_hash,
            started=time.time(),
            part=part,
        )
    return write_stage(
        ctx.layout,
        stage,
        iteration,
        out.frame,
        fp=fp,
        inputs=inputs,
        config_hash=config_hash,
        started=started,
        part=part,
        engines=out.engines,
        extra=out.extra,
    )


def upstream_fingerprint(root: str, run_id: str, stage: str, iteration: int) -> str:
    """The fingerprint of a complete upstream stage (what a rerun chains on)."""
    return _complete_manifest(root, run_id, stage, iteration)["fingerprint"]


def upstream_part_fingerprints(root: str, run_id: str, stage: str, iteration: int) -> list[str]:
    """The fingerprints of a complete upstream stage's parts, one per sampling round."""
    return [part["fingerprint"] for part in _complete_manifest(root, run_id, stage, iteration)["parts"]]


def _complete_manifest(root: str, run_id: str, stage: str, iteration: int) -> dict:
    manifest = read_manifest(RunLayout(Path(root), run_id), stage, iteration)
    if manifest is None:
        raise NotFound(f"run {run_id!r} has no complete {stage} for iteration {iteration}")
    return manifest


def policy_lora(ctx: RunContext) -> LoraSettings | None:
    """The policy's adapter settings (the stage must declare the `lora` section), or None when LoRA is off."""
    return LoraSettings.from_config(ctx.cfg.lora, ctx.cfg.seed)


def export_checkpoint(checkpoint: Path, dest: str | Path, merge: bool = True) -> None:
    """Copy a committed checkpoint to a model folder (what `model.path` or vLLM loads), without the optimizer state;
    an existing folder is replaced. An adapter checkpoint (LoRA) is merged into its base
    model's weights (a plain Hugging Face folder that needs no peft), unless `merge` is False (the PEFT folder)."""

    from tasks.engines.workers.lora import is_adapter, merge_into_folder

    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    if merge and is_adapter(checkpoint):
        merge_into_folder(str(checkpoint), str(dest))
        return
    shutil.copytree(checkpoint, dest, ignore=shutil.ignore_patterns("ds_state"))


def scratch_file(ctx: RunContext, name: str) -> Path:
    ctx.layout.scratch_dir.mkdir(parents=True, exist_ok=True)
    return ctx.layout.scratch_dir / name


def score_frame_worker(
    ctx: RunContext,
    kind: str,
    model_path: str,
    micro_batch_size: int,
    frame: pl.DataFrame,
    name: str,
    log: str | None = None,
) -> pl.DataFrame:
    """Score one table with the scoring worker (kind rm_score or seq_logprobs): `frame` goes in, the table it writes
    comes back (both scratch files, removed after); its log is logs/{log or name}.log."""
    data_path, out_path = scratch_file(ctx, f"{name}.in.parquet"), scratch_file(ctx, f"{name}.out.parquet")
    frame.write_parquet(data_path)
    run_worker(
        SCORE_WORKER,
        ScoreRequest(
            kind=kind,
            model_path=model_path,
            data_path=str(data_path),
            out_path=str(out_path),
            micro_batch_size=micro_batch_size,
        ),
        ctx.layout.log_path(log or name),
        ranks=1,
        placement=trainer_placement(ctx.cfg.engines),
    )
    out = pl.read_parquet(out_path)
    data_path.unlink(), out_path.unlink()
    return out


@dataclass(frozen=True)
class RunPlan:
    """A run's loop bounds, read from its saved config (flows stay free of data code)."""

    iterations: int
    eval_every: int
    ahead: int  # how many updates ahead of the trainer generation runs (RunConfig.generation_ahead)
    ptx: bool  # PPO-ptx: the SFT demonstrations are formatted first
    model_path: str
    tracking: bool


@stage_task("plan")
def plan_task(storage_root: str, run_id: str) -> RunPlan:
    cfg = load_run(storage_root, run_id).cfg
    return RunPlan(
        iterations=cfg.rl.iterations,
        eval_every=cfg.rl.eval_every,
        ahead=cfg.generation_ahead,
        ptx=cfg.loss.ptx_coef > 0,
        model_path=cfg.model.path,
        tracking=bool(cfg.tracking),
    )
