"""Which weights a stage uses: the policy of iteration k is the checkpoint of k−1, or the starting model.
Imports: `export_run` imports the stage helpers and the LoRA module (peft) only for `rlpipe export`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage import read_manifest
from storage.model_ids import ModelPathError, model_fingerprint
from tasks.stages.common import RunContext


@dataclass(frozen=True)
class Weights:
    path: str
    fingerprint: str
    version: int  # 0 = the starting model; k = after iteration k's update


def starting_weights(ctx: RunContext) -> Weights:
    return Weights(ctx.cfg.model.path, model_fingerprint(ctx.cfg.model.path), 0)


def sampling_version(cfg, iteration: int) -> int:
    """The update whose weights iteration `iteration` samples with: k − 1, or k − 2 one step off-policy
    (rl.max_staleness 1 without partial rollouts), never before the starting model. Fixed by the config, never by
    timing."""
    return max(0, iteration - 1 - cfg.generation_ahead)


def weights_after(ctx: RunContext, iteration: int, stage: str = "train_metrics", files: bool = False) -> Weights:
    """The weights after `iteration` updates (0 = the starting model). `stage` is the table whose manifest
    marks that update's checkpoint complete (`dpo_metrics` for a DPO run). With `files` the checkpoint holds them on
    disk; without, it may be one whose weights only this process's resident trainer holds (engines.weight_sync
    collective), which the trainer uses and sends to the sampler."""
    if iteration == 0:
        return starting_weights(ctx)
    fp = weights_fingerprint(ctx, iteration, stage)
    ckpt = ctx.layout.checkpoint_dir(iteration)
    if stage == "train_metrics" and not _usable(ctx, ckpt, files):
        # A weights-only checkpoint removed since (checkpoint.every), or written without its weight files and held by
        # no trainer of this process: rebuilt by replaying the updates before it.
        from tasks.stages import optimize
        from tasks.stages.common import load_run

        run = load_run(str(ctx.layout.root), ctx.layout.run_id, optimize.SPEC)
        optimize.restore_state(run, iteration, files=files)
    if not (ckpt / "config.json").exists():
        raise ModelPathError(f"run {ctx.layout.run_id!r} has no checkpoint for iteration {iteration}")
    return Weights(str(ckpt), fp, iteration)


def _usable(ctx: RunContext, ckpt: Path, files: bool) -> bool:
    from storage import has_weight_files
    from tasks.engines.trainer_client import trainer_holds

    if has_weight_files(ckpt):
        return True
    held = (ckpt / "config.json").exists() and trainer_holds(ctx.layout, ctx.cfg.engines, str(ckpt))
    return held and not files


def weights_fingerprint(ctx: RunContext, iteration: int, stage: str = "train_metrics") -> str:
    """The identity of the weights after `iteration` updates, whether or not their checkpoint is kept on disk: the
    manifest of the update that wrote them (the starting model's files for 0)."""
    if iteration == 0:
        return model_fingerprint(ctx.cfg.model.path)
    manifest = read_manifest(ctx.layout, stage, iteration, verify=False)
    if manifest is None:
        raise ModelPathError(f"run {ctx.layout.run_id!r} has no complete checkpoint for iteration {iteration}")
    return manifest["fingerprint"]


@dataclass(frozen=True)
class CriticWeights:
    path: str
    fresh: bool  # True: build from the policy checkpoint at `path` with a zeroed value head


def critic_after(ctx: RunContext, iteration: int) -> CriticWeights:
    """PPO's critic after `iteration` updates; before any, it is built from the starting policy."""
    if iteration == 0:
        return CriticWeights(ctx.cfg.model.path, True)
    return CriticWeights(str(ctx.layout.critic_dir(iteration)), False)


def export_run(run_id: str, storage_root: str, out: str, iteration: int | None = None, merge: bool = False) -> dict:
    """`rlpipe export`: the policy after `iteration` updates (default: the last complete one) as a model folder at
    `out`, without optimizer state. An adapter checkpoint (LoRA) is written as its PEFT folder, or with `merge` merged
    into the base model's weights: a plain Hugging Face folder that vLLM and transformers load with no peft
    installed."""
    from tasks.engines.workers.lora import is_adapter
    from tasks.stages.common import export_checkpoint, load_run

    ctx = load_run(storage_root, run_id)
    done = [
        it for it in ctx.layout.checkpoint_iterations() if read_manifest(ctx.layout, "train_metrics", it, verify=False)
    ]
    if iteration is None:
        if not done:
            raise ModelPathError(f"run {run_id!r} has no complete checkpoint to export")
        iteration = done[-1]
    weights = weights_after(ctx, iteration, files=True)
    export_checkpoint(Path(weights.path), out, merge=merge)
    return {
        "iteration": iteration,
        "checkpoint": weights.path,
        "out": out,
        "kind": ("merged" if merge else "adapter") if is_adapter(weights.path) else "full",
    }
