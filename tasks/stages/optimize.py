"""Stage `optimize`: one policy update on a DeepSpeed engine, then the checkpoint.

Reads `rollouts`, `logprobs`, `advantages`, `scores` and `batch` of the iteration; writes the checkpoint
`checkpoints/iter=k/` (HF weights + tokenizer, and on every checkpoint.every-th and the last iteration the DeepSpeed
optimizer state; renamed into place) and then the `train_metrics` row, whose manifest marks both complete.

Sparse checkpoints: between full checkpoints the resident trainer keeps the optimizer state in memory. A trainer that
lost it (a resumed run) gets it back by replaying the updates since the last full checkpoint from their cached
tables (`restore_state`): each is safe to replay when storage says its inputs are unchanged since it was written
(storage.changed_inputs) and it started from the weights it recorded, and each is checked against the sync probe it
recorded. No generation: the batch, logprobs and advantages are on disk.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import polars as pl

from schemas.errors import NotFound
from schemas.requests import CriticRequest, EngineSettings, LossSettings, PtxRequest, UpdateRequest
from storage import (
    StageOutput,
    changed_inputs,
    commit_dir,
    ensure_free,
    folder_bytes,
    has_weight_files,
    read_manifest,
    read_stage,
    state_bytes,
    state_dir_for,
    temp_dir_for,
)
from storage.stage_io import sha256_file
from tasks.algos.metrics import advantage_metrics, explained_variance, rollout_metrics, sampler_gap
from tasks.engines.trainer_client import call_trainer, trainer_holds
from tasks.engines.workers.engine_cache import state_pending, weights_only
from tasks.engines.workers.lora import describe, is_adapter
from tasks.engines.workers.sync_probe import PROBE_FILE
from tasks.stages.common import (
    Computed,
    RunContext,
    load_run,
    policy_lora,
    run_stage,
    scratch_file,
    stage_task,
)
from tasks.stages.kl_control import entropy_coef, kl_beta
from tasks.stages.logprobs import kept_rollouts
from tasks.stages.spec import StageSpec
from tasks.stages.weights import critic_after, weights_after, weights_fingerprint


def training_frame(ctx: RunContext, iteration: int) -> pl.DataFrame:
    """What the trainer needs per sample. `loss_mask` is 0 for a truncated response under DAPO's overlong
    filtering (it stays in the batch, so its group's advantages are unchanged, but gives no gradient)."""
    keys = ["prompt_id", "sample_idx"]
    rollouts = kept_rollouts(ctx, iteration)
    actions = ["action_mask"] if "action_mask" in rollouts.columns else []  # multi-turn: the model's own tokens
    rollouts = rollouts.select(*keys, "prompt_token_ids", "token_ids", "sampler_logprobs", "truncated", *actions)
    logprobs = read_stage(ctx.layout, "logprobs", iteration).select(*keys, "old_logprobs", "ref_logprobs", "values")
    adv = read_stage(ctx.layout, "advantages", iteration).select(*keys, "token_advantages", "returns")
    df = rollouts.join(logprobs, on=keys, validate="1:1").join(adv, on=keys, validate="1:1")
    masked = pl.col("truncated") & pl.lit(ctx.cfg.loss.overlong_filter)
    return df.with_columns(pl.when(masked).then(0.0).otherwise(1.0).alias("loss_mask"))


def ptx_fingerprint(ctx: RunContext) -> str:
    """PPO-ptx's demonstrations are the run's own `sft_data` stage (the sft section's files, formatted with the
    policy's tokenizer); its fingerprint is an input of every update, so changed demonstrations retrain."""
    manifest = read_manifest(ctx.layout, "sft_data", 0)
    if manifest is None:
        raise NotFound(
            f"loss.ptx_coef > 0 needs the run's sft_data stage, which is missing (run {ctx.layout.run_id!r})"
        )
    return manifest["fingerprint"]


def ptx_file(ctx: RunContext) -> Path:
    path = scratch_file(ctx, "ptx.parquet")
    read_stage(ctx.layout, "sft_data", 0).select("prompt_token_ids", "response_token_ids").write_parquet(path)
    return path


def critic_request(ctx: RunContext, iteration: int, tmp: Path) -> CriticRequest | None:
    """The critic's part of the trainer request; it is saved inside the policy's temporary checkpoint folder
    `tmp`, at the place the layout gives it, so both are committed by one rename."""
    if not ctx.cfg.uses_critic:
        return None
    c, prev = ctx.cfg.critic, critic_after(ctx, iteration - 1)
    out_dir = tmp / ctx.layout.critic_dir(iteration).relative_to(ctx.layout.checkpoint_dir(iteration))
    return CriticRequest(
        path=prev.path,
        fresh=prev.fresh,
        resume_state=None if prev.fresh else f"{prev.path}/ds_state",
        out_dir=str(out_dir),
        lr=c.lr,
        value_clip=c.value_clip,
        coef=c.coef,
    )


def prune_checkpoints(layout, iteration: int, keep: int | None) -> None:
    """Once update `iteration` is complete: remove the weights-only checkpoints before it (checkpoint.every; a replay
    rebuilds any of them), and the DeepSpeed optimizer state of the full checkpoints before the last
    `engines.keep_optimizer_states` (≥ 2: a crash before an update's state is written redoes it from the full
    checkpoint before, which must keep its state)."""
    full = []
    for k in (k for k in layout.checkpoint_iterations() if k <= iteration):
        if weights_only(str(layout.checkpoint_dir(k))):
            if k < iteration:
                shutil.rmtree(layout.checkpoint_dir(k), ignore_errors=True)
        else:
            full.append(k)
    for k in full[: -keep if keep else 0]:
        for state in (layout.checkpoint_dir(k) / "ds_state", layout.critic_dir(k) / "ds_state"):
            shutil.rmtree(state, ignore_errors=True)


def rollout_engine_metrics(rounds: list[dict]) -> dict[str, float]:
    """From the rollouts manifest's per-round records: vLLM's generation seconds, the seconds spent syncing the
    sampler to the policy (0 when the engine started on it), and the sampler's logprob gap to the trainer on the
    checkpoint's probe (NaN when it has none), the largest replica's peak resident memory so far, and the KV cache
    the sampler reserved."""
    gaps = [r["sync_logprob_gap"] for r in rounds if r.get("sync_logprob_gap") is not None]
    return {
        "seconds_generate": float(sum(r.get("generate_seconds", 0.0) for r in rounds)),
        "weight_sync_seconds": float(sum(r.get("sync_seconds", 0.0) for r in rounds)),
        # bytes sent over the trainer's process group (0: synced from the checkpoint's files, or no sync)
        "weight_sync_bytes": float(sum(r.get("sync_bytes", 0) for r in rounds)),
        "weight_sync_logprob_gap": float(max(gaps)) if gaps else float("nan"),
        "sampler_peak_rss_gib": float(
            max((r.get("sampler_peak_rss_gib", float("nan")) for r in rounds), default=float("nan"))
        ),
        "sampler_kv_cache_gib": float(rounds[0].get("sampler_kv_cache_gib") or float("nan"))
        if rounds
        else float("nan"),
        **partial_metrics(rounds),
    }


def partial_metrics(rounds: list[dict]) -> dict[str, float]:
    """Partial rollouts' pool over the iteration's rounds (none without them): groups dropped for their age, admitted,
    carried over ended from the batch before and not stale (rollout.carry_surplus), ended by generation, and the
    sequences still in flight after the last round."""
    if not rounds or "carried_sequences" not in rounds[-1]:
        return {}
    keys = ("stale_groups", "admitted_groups", "surplus_groups", "ended_groups")
    out = {k: float(sum(r.get(k, 0) for r in rounds)) for k in keys}
    return {**out, "carried_sequences": float(rounds[-1]["carried_sequences"])}


def stage_metrics(ctx: RunContext, iteration: int) -> dict[str, float]:
    """Wall seconds of each earlier stage of the iteration (every table the run holds for it, but this one and the eval
    that follows), and what their manifests record of the engines: the rollouts' generation and weight sync, the
    logprobs forward passes (`seconds_logprobs_forward`) and the trainer's peak memory after them, and the curricula's
    levels."""
    out = {}
    for stage in (s for s in ctx.layout.stages() if s not in (SPEC.name, "eval")):
        m = read_manifest(ctx.layout, stage, iteration, verify=False)
        if m:
            out[f"seconds_{stage}"] = float(m["wall_seconds"])
            extra = m.get("extra", {})
            if stage == "rollouts":
                out.update(rollout_engine_metrics([v for k, v in extra.items() if k.startswith("round")]))
            if stage == "prompts":  # each curriculum source's level this iteration (data.sources)
                out.update({f"curriculum_level/{k}": float(v) for k, v in extra.get("levels", {}).items()})
            if stage == "logprobs" and "forward_seconds" in extra:
                out["seconds_logprobs_forward"] = float(extra["forward_seconds"])
                out["logprobs_peak_rss_gib"] = float(extra.get("peak_rss_gib", float("nan")))
                out.update(
                    {
                        f"logprobs_{k}": float(v)
                        for k, v in extra.items()
                        if k.startswith("forward_") and k != "forward_seconds"
                    }
                )
    return out


def checkpoint_bytes(ctx: RunContext, policy, request: UpdateRequest) -> int:
    """About what this update's checkpoint will take: the checkpoint before it (weights, critic; the starting model's
    when that one holds no weight files), with the optimizer state of the newest full checkpoint kept when this one is
    full; for the first, the starting weights (a lower bound; a first adapter checkpoint is small, and not estimated).
    Nothing much for an update that writes no weights (engines.weight_sync collective)."""
    if (policy.version == 0 and ctx.cfg.lora.enabled) or not request.save_weights:
        return 0
    layout = ctx.layout
    kept = [layout.checkpoint_dir(k) for k in layout.checkpoint_iterations()]
    with_state = [folder for folder in kept if (folder / "ds_state").is_dir()]
    state = state_bytes(with_state[-1]) if request.save_state and with_state else 0
    before = Path(policy.path) if has_weight_files(policy.path) else Path(ctx.cfg.model.path)
    return folder_bytes(before) - state_bytes(before) + state


def update_request(
    ctx: RunContext, iteration: int, policy, tmp: Path, *, beta: float, entropy: float, replay: str = ""
) -> UpdateRequest:
    """Update `iteration` as the trainer takes it: from `policy` (the checkpoint before it) on the iteration's cached
    training frame, into `tmp`, with the iteration's KL β and entropy coefficient. A `replay` rebuilds a complete
    update's checkpoint under the id it recorded."""
    o, lc = ctx.cfg.optim, ctx.cfg.loss
    data_path = scratch_file(ctx, "optimize.in.parquet")
    training_frame(ctx, iteration).write_parquet(data_path)
    prev_state = f"{policy.path}/ds_state" if policy.version > 0 else None
    return UpdateRequest(
        model_path=policy.path,
        tmp_dir=str(tmp),
        data_path=str(data_path),
        resume_state=prev_state,
        seed=ctx.cfg.seed + iteration,
        engine=EngineSettings.for_policy(o, ctx.cfg.model, policy_lora(ctx)),
        ppo_epochs=o.ppo_epochs,
        minibatches=o.minibatches,
        warmup_steps=o.warmup_steps,
        first_step=(iteration - 1) * o.ppo_epochs * o.minibatches,
        loss=LossSettings.for_iteration(ctx.cfg, kl_beta=beta, entropy_coef=entropy),
        critic=critic_request(ctx, iteration, tmp),
        ptx=PtxRequest(coef=lc.ptx_coef, batch=lc.ptx_batch, data_path=str(ptx_file(ctx))) if lc.ptx_coef else None,
        crash_point=f"{'replay' if replay else 'optimize'}:{iteration}",
        final_dir=""
        if replay or not ctx.cfg.engines.defer_optimizer_state
        else str(ctx.layout.checkpoint_dir(iteration)),
        save_state=ctx.cfg.keeps_optimizer_state(iteration),
        state_id=replay,
        # Under the collective sync a weights-only update writes no weight files (its trainer sends them); a replay
        # writes them, for whatever needed the checkpoint on disk.
        save_weights=bool(replay) or ctx.cfg.keeps_optimizer_state(iteration) or ctx.cfg.engines.weight_sync == "file",
    )


def restore_state(ctx: RunContext, iteration: int, files: bool = False) -> None:
    """Make the optimizer state after update `iteration` available to the next update: on disk (a full checkpoint),
    being written by this run's trainer (pending: it finishes it before it takes another request), or held by it.
    Otherwise (a weights-only checkpoint, or a state removed by engines.keep_optimizer_states, and a trainer started
    since) replay the updates after the last checkpoint with a state from their cached tables, each checked to give
    the weights it recorded. With `files` the checkpoint's weight files are wanted too: a replay writes them."""
    layout = ctx.layout
    ckpt = str(layout.checkpoint_dir(iteration))
    if iteration == 0 or Path(ckpt, "ds_state").exists() or state_pending(ckpt):
        return
    if not files and trainer_holds(layout, ctx.cfg.engines, ckpt):
        return
    restore_state(ctx, iteration - 1)
    manifest = read_manifest(layout, SPEC.name, iteration, verify=False)
    policy = weights_after(ctx, iteration - 1)
    if manifest is None or "state_id" not in manifest["extra"]:
        raise NotFound(
            f"the optimizer state after update {iteration} is gone and the update cannot be replayed (it is not "
            f"complete, or an older rlpipe wrote it): iteration {iteration + 1} cannot be redone"
        )
    changed = changed_inputs(layout, manifest, iteration, SPEC.reads)
    if changed or manifest["inputs"].get("policy") != policy.fingerprint:
        raise NotFound(
            f"update {iteration} cannot be replayed: {', '.join(changed) or 'the weights before it'} changed since it "
            f"was written, and the optimizer state after it is gone"
        )
    final = layout.checkpoint_dir(iteration)
    tmp = temp_dir_for(final)
    request = update_request(
        ctx,
        iteration,
        policy,
        tmp,
        beta=kl_beta(ctx, iteration),
        entropy=entropy_coef(ctx, iteration),
        replay=manifest["extra"]["state_id"],
    )
    t0 = time.time()
    call_trainer(layout, ctx.cfg.engines, request, f"replay-{iteration:05d}")
    Path(request.data_path).unlink()
    if probe_digest(tmp) != manifest["extra"]["probe_sha256"]:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(
            f"replaying update {iteration} gave other weights than it wrote (its sync probe's logprobs differ): the "
            f"run's optimizer state cannot be rebuilt exactly here (another thread count, or other library versions?)"
        )
    commit_dir(tmp, final)
    print(f"replayed update {iteration} from its cached tables in {time.time() - t0:.1f}s", flush=True)


def probe_digest(checkpoint: Path) -> str:
    """The sha256 of a checkpoint's sync probe (the trainer's logprobs on fixed sequences): equal probes mean the
    replayed weights are the recorded ones, checked in milliseconds where hashing the weights takes seconds."""
    return sha256_file(checkpoint / PROBE_FILE)


@stage_task("optimize")
def optimize_task(storage_root: str, run_id: str, iteration: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    policy_fp = weights_fingerprint(ctx, iteration - 1)
    beta, coef = kl_beta(ctx, iteration), entropy_coef(ctx, iteration)
    ptx_fp = ptx_fingerprint(ctx) if ctx.cfg.loss.ptx_coef else ""

    def compute():
        restore_state(ctx, iteration - 1)
        policy = weights_after(ctx, iteration - 1)
        final = ctx.layout.checkpoint_dir(iteration)
        tmp = temp_dir_for(final)
        shutil.rmtree(state_dir_for(final), ignore_errors=True)  # a stopped command's unpublished optimizer state
        request = update_request(ctx, iteration, policy, tmp, beta=beta, entropy=coef)
        ensure_free(final.parent, checkpoint_bytes(ctx, policy, request), f"the checkpoint of iteration {iteration}")
        resp = call_trainer(ctx.layout, ctx.cfg.engines, request, f"optimize-{iteration:05d}")
        digest = probe_digest(tmp)
        commit_dir(tmp, final)
        samples = pl.read_parquet(request.data_path, columns=["loss_mask"])
        Path(request.data_path).unlink()
        rollouts, advantages = (
            read_stage(ctx.layout, "rollouts", iteration),
            read_stage(ctx.layout, "advantages", iteration),
        )
        logprobs = read_stage(ctx.layout, "logprobs", iteration)
        critic_metrics = {"explained_variance": explained_variance(advantages, logprobs)} if ctx.cfg.uses_critic else {}
        row = {
            "iteration": iteration,
            "policy_version": iteration,
            **resp["metrics"],
            **critic_metrics,
            "kl_beta": beta,
            "entropy_coef": coef,
            "loss_masked_fraction": float((samples["loss_mask"] == 0).mean()),
            **rollout_metrics(
                rollouts, read_stage(ctx.layout, "scores", iteration), read_stage(ctx.layout, "batch", iteration)
            ),
            **advantage_metrics(advantages),
            # With π_old from the sampler there is no trainer pass to compare with (the weight-sync probe still is),
            # and with LoRA, top_p or min_tokens at T ≠ 1 the two score different distributions.
            "sampler_logprob_gap": sampler_gap(rollouts, logprobs)
            if ctx.cfg.loss.old_logprobs == "trainer" and ctx.cfg.sampler_logprobs_comparable
            else float("nan"),
            "seconds_optimize": resp["train_seconds"],
            **stage_metrics(ctx, iteration),
            "trainer_engines_reused": float(resp.get("reused_engine", 0)),
        }
        frame = pl.DataFrame([row]).with_columns(
            pl.col("iteration", "policy_version").cast(pl.Int32),
            pl.col("optimizer_steps").cast(pl.Int32),
            pl.col("loss").cast(pl.Float64),
        )
        return Computed(
            frame,
            engines={"deepspeed": resp["deepspeed_version"], "zero_stage": resp["zero_stage"]},
            extra={
                "checkpoint": str(final),
                # What a replay of this update must reproduce (restore_state), and the id it gives the checkpoint.
                "state_id": resp["state_id"],
                "probe_sha256": digest,
                "full_checkpoint": request.save_state,
                "weight_files": request.save_weights,
                **({"adapter": describe(str(final))} if is_adapter(final) else {}),
            },
        )

    out = run_stage(
        ctx,
        iteration,
        salt=f"beta={beta:.12g}" + (f",entropy_coef={coef:.12g}" if ctx.cfg.loss.entropy_target is not None else ""),
        compute=compute,
        inputs={**upstream, "policy": policy_fp, "ptx": ptx_fp},
        # A command stopped while its trainer wrote this update's optimizer state (tasks/engines/workers/
        # deferred_state.py): the update is redone from the state before it, which gives the same weights.
        recompute=state_pending(str(ctx.layout.checkpoint_dir(iteration))),
    )
    prune_checkpoints(
        ctx.layout, iteration, ctx.cfg.engines.keep_optimizer_states
    )  # after the manifest: until then the last complete checkpoint is the one before
    return out


# The update: its table is train_metrics, its other output the checkpoint (whose manifest is train_metrics').
SPEC = StageSpec(
    "train_metrics",
    reads=("advantages", "logprobs"),
    also_reads=("rollouts", "scores", "batch", "sft_data"),  # fixed by the two above; PPO-ptx's data: `ptx`
    sections=("optim", "loss", "kl", "critic", "model", "lora", "rollout", "advantage"),
    scope="iteration",
    also_writes=("checkpoints",),
    aliases=("optimize",),
    task=optimize_task,
    rerunnable=True,
)
