"""Stage `rollouts`: G samples per prompt from vLLM, with the sampler's own logprobs.

Reads `prompts` (this round's part) and the policy weights; writes `rollouts`, one part per round.
The engine runs in its own resident Ray actor (tasks/engines/vllm_client.py), kept across rounds, iterations
and eval, and synced to the weights each request names.
"""

from __future__ import annotations

import dataclasses
import heapq
from concurrent.futures import ThreadPoolExecutor

import polars as pl

from schemas.requests import GenerateRequest, GenerationJob, GenerationReply, JobTiming, VLLMSettings
from storage import StageOutput, has_weight_files, read_stage
from tasks.engines.launch import WorkerError
from tasks.engines.ray_cluster import Placement
from tasks.engines.resident import close_all
from tasks.engines.vllm_client import resident_engine
from tasks.engines.weight_sync import backend, sync_replicas, unreported_sync
from tasks.stages import agent_rollouts, partial_rollouts, single_turn_rollouts  # noqa: F401 (each registers its mode)
from tasks.stages.common import (
    Computed,
    RunContext,
    load_run,
    run_stage,
    scratch_file,
    stage_task,
)
from tasks.stages.rollout_modes import ROLLOUT_MODES, SampledRound, Sampler
from tasks.stages.spec import StageSpec
from tasks.stages.weights import Weights, sampling_version, weights_after, weights_fingerprint


def sampling_job(ctx: RunContext, n: int, temperature: float, seed: int, top_p: float = 1.0) -> dict:
    """One generation pass's sampling settings: the run's generation limit and stop conditions (the files are added
    by `generate`)."""
    r = ctx.cfg.rollout
    return {
        "n": n,
        "temperature": temperature,
        "top_p": top_p,
        "max_tokens": r.max_tokens,
        "seed": seed,
        "stop": tuple(r.stop),
        "stop_token_ids": tuple(r.stop_token_ids),
        "min_tokens": r.min_tokens,
    }


def deal_by_tokens(groups: list[str], pending: list[int], replicas: int) -> list[list[int]]:
    """Row indices for each replica: a group's rows (those with the same key in `groups`) go to one replica, so its
    prefix cache serves them all; groups are dealt in decreasing order of their pending tokens (`pending`, per row),
    each to the replica with the fewest so far (ties: the first group, the lowest replica); each replica's rows in
    their order. Deterministic: the same rows, the same deal."""
    units: dict[str, list[int]] = {}
    for i, key in enumerate(groups):
        units.setdefault(key, []).append(i)
    order = sorted(units.values(), key=lambda rows: (-sum(pending[i] for i in rows), rows[0]))
    heap = [(0, k) for k in range(replicas)]
    shares: list[list[int]] = [[] for _ in range(replicas)]
    for rows in order:
        load, k = heapq.heappop(heap)
        shares[k] += rows
        heapq.heappush(heap, (load + sum(pending[i] for i in rows), k))
    return [sorted(rows) for rows in shares]


def generate(
    ctx: RunContext, model_path: str, prompts: pl.DataFrame, jobs: list[dict], log_name: str
) -> tuple[list[pl.DataFrame], GenerationReply]:
    """Run the resident vLLM engines over `jobs` for the prompts' token ids (formatted once, in the `dataset` stage);
    return one frame per job, each row with its prompt_token_ids, in the prompts' order.

    With `rollout.engines` replicas the prompts are dealt by pending tokens (deal_by_tokens: a group, the rows sharing
    a `group` value, or else a prompt with its n samples, on one replica) and generated concurrently. Row i samples
    with the seed `job seed + seed_offset`, its `seed_offset` column or else i, whichever replica samples it, so the
    table does not depend on the number of replicas. A prompts frame may also set a row's `max_tokens` and
    `min_tokens` (partial rollouts' continuations)."""
    settings = sampler_settings(ctx, model_path)
    engines = start_rollout_engines(ctx, model_path)
    sync_replicas(ctx.layout, ctx.cfg.engines, engines, model_path, settings)
    sync = unreported_sync(model_path)  # that one, or one made before (sample_ahead_task): reported once
    frame = prompts.with_row_index("_at")
    if "seed_offset" not in frame.columns:
        frame = frame.with_columns(pl.col("_at").cast(pl.Int64).alias("seed_offset"))
    own = [c for c in ("seed_offset", "max_tokens", "min_tokens") if c in frame.columns]
    longest = max(j["max_tokens"] for j in jobs)
    limits = frame["max_tokens"].to_list() if "max_tokens" in frame.columns else [longest] * frame.height
    pending = [sum(j["n"] for j in jobs) * limit for limit in limits]
    keys = frame["group" if "group" in frame.columns else "prompt_id"].to_list()
    calls = []
    for k, rows in enumerate(deal_by_tokens(keys, pending, len(engines))):
        if not rows:
            continue
        inp = scratch_file(ctx, f"{log_name}.prompts{k}.parquet")
        frame[rows].select("prompt_id", "prompt_token_ids", "_at", *own).write_parquet(inp)
        outs = [scratch_file(ctx, f"{log_name}.out{i}-{k}.parquet") for i in range(len(jobs))]
        request = GenerateRequest(
            model_path=model_path,
            jobs=tuple(GenerationJob(prompts_path=str(inp), out_path=str(o), **j) for j, o in zip(jobs, outs)),
        )
        calls.append((engines[k], request, inp, outs))
    with ThreadPoolExecutor(len(calls)) as pool:  # each replica is its own actor: they generate at the same time
        reply = merge_replies(list(pool.map(lambda c: c[0].generate(c[1], settings), calls)))
    if sync is not None:  # the weights came over the trainer's process group before the generation
        seconds = reply.sync_seconds + sync["sync_seconds"]
        reply = dataclasses.replace(reply, sync_seconds=seconds, sync_bytes=sync["sync_bytes"])
    gap, limit = reply.sync_logprob_gap, ctx.cfg.rollout.max_sync_logprob_gap
    if gap is not None and not gap <= limit:
        raise WorkerError(
            f"the sampler's weights do not match the trainer's: mean logprob gap {gap:.3g} on the "
            f"probe sequences of {model_path} (rollout.max_sync_logprob_gap = {limit:g})"
        )
    frames = []
    for i in range(len(jobs)):
        parts = [
            pl.read_parquet(outs[i]).join(
                pl.read_parquet(inp, columns=["prompt_id", "prompt_token_ids", "_at"]), on="prompt_id", how="left"
            )
            for _, _, inp, outs in calls
        ]
        frames.append(pl.concat(parts).sort("_at", maintain_order=True).drop("_at"))
    for _, _, inp, outs in calls:
        for o in outs:
            o.unlink()
        inp.unlink()
    return frames, reply


def start_rollout_engines(ctx: RunContext, model_path: str | None) -> list:
    """The run's `rollout.engines` vLLM replicas, each spawned (without waiting) unless it runs already, starting from
    `model_path` (a replica syncs in place to whatever weights a request names); with None, spawned held (importing
    vLLM until a later call gives them their weights: ResidentProcess.spawn). Call it from the thread that lives as
    long as they should (see ResidentProcess.spawn): the replicas then start at once. With `engines.rollout_bundle`
    the replicas share one placement group, so `engines.placement_strategy` SPREAD puts them on different nodes."""
    settings = sampler_settings(ctx, model_path) if model_path else None
    engines = rollout_engines(ctx)
    for engine in engines:
        if not engine.running:
            engine.spawn(settings, held=settings is None)
    return engines


def rollout_engines(ctx: RunContext) -> list:
    """This process's `rollout.engines` vLLM replicas of the run (made, not started)."""
    r, e = ctx.cfg.rollout, ctx.cfg.engines
    devices, tp = e.rollout_devices, r.tensor_parallel_size
    placement = Placement.from_config(e, e.rollout_bundle)
    engines = []
    for k in range(r.engines):
        log = ctx.layout.log_path("vllm" if k == 0 else f"vllm-engine{k}")
        where = dataclasses.replace(placement, share=f"{ctx.layout.run_id}/vllm", replicas=r.engines, index=k)
        engines.append(
            resident_engine(ctx.layout.run_id, log, where, k, devices[k * tp : (k + 1) * tp] if devices else None)
        )
    return engines


def sampling_weights(ctx: RunContext, version: int, fingerprint: str) -> Weights:
    """The weights after update `version`, to sample with: when every replica holds them already (one step
    off-policy, the generation runs beside the update that changes the trainer's copy: sample_ahead_task synced them
    before it began), nothing else is asked of the trainer or of disk."""
    if version:
        path = str(ctx.layout.checkpoint_dir(version))
        replicas = rollout_engines(ctx)
        if replicas and all(r.running and r.weights == path for r in replicas):
            return Weights(path, fingerprint, version)
    return weights_after(ctx, version)


def sampler_settings(ctx: RunContext, model_path: str) -> VLLMSettings:
    """How a replica starts for `model_path`: from its files, or, for a checkpoint written without them (the trainer
    sends its weights, engines.weight_sync collective), from the run's starting model (the same architecture), to be
    synced before it generates."""
    start = model_path if has_weight_files(model_path) else ctx.cfg.model.path
    cfg = ctx.cfg
    return VLLMSettings.from_config(
        model_path=start,
        model=cfg.model,
        rollout=cfg.rollout,
        seed=cfg.seed,
        lora=cfg.lora,
        sleep=cfg.engines.colocate_sleep,
        weight_transfer=backend(cfg.engines, lora=cfg.lora.rank is not None),
    )


def merge_replies(replies: list[GenerationReply]) -> GenerationReply:
    """One reply for the replicas' replies: the slowest start and sync, the worst probe gap, each job's wall seconds
    (the replicas ran at once) and total tokens, and per replica its jobs together."""
    gaps = [x.sync_logprob_gap for x in replies if x.sync_logprob_gap is not None]
    return GenerationReply(
        engine_start_seconds=max(x.engine_start_seconds for x in replies),
        sync_seconds=max(x.sync_seconds for x in replies),
        sync_logprob_gap=max(gaps) if gaps else None,
        jobs=tuple(_together(timings, max) for timings in zip(*(x.jobs for x in replies))),
        vllm_version=replies[0].vllm_version,
        peak_rss_gib=max(x.peak_rss_gib for x in replies),
        kv_cache_gib=replies[0].kv_cache_gib,
        per_engine=tuple(_together(x.jobs, sum) for x in replies),
    )


def _together(timings, seconds) -> JobTiming:
    """Timings of jobs that ran at once (`seconds` max) or one after the other (sum)."""
    return JobTiming(
        generate_seconds=seconds(t.generate_seconds for t in timings), tokens=sum(t.tokens for t in timings)
    )


def one_job(ctx: RunContext, model_path: str):
    """`generate` for one job, as the modes and the multi-turn loop call it: (frame, job, log name) → (frame, reply)."""

    def frames(frame: pl.DataFrame, job: dict, log_name: str):
        (df,), reply = generate(ctx, model_path, frame, [job], log_name)
        return df, reply

    return frames


def mode_of(cfg) -> str:
    """The rollout mode the config asks for (tasks/stages/rollout_modes.py): partial rollouts and multi-turn ones
    exclude each other (the config refuses both)."""
    if cfg.rollout.partial_tokens:
        return "partial"
    return "multi_turn" if cfg.agent.enabled else "single_turn"


@stage_task("rollouts")
def rollouts_task(storage_root: str, run_id: str, iteration: int, round_: int, upstream: dict) -> StageOutput:
    """One sampling round, by the rollout mode the config asks for (`mode_of`), on the policy's weights."""
    ctx = load_run(storage_root, run_id, SPEC)
    version = sampling_version(ctx.cfg, iteration)
    policy_fp = weights_fingerprint(ctx, version)  # a kept checkpoint's files are needed only to compute
    mode = ROLLOUT_MODES.entry(mode_of(ctx.cfg))
    r = ctx.cfg.rollout

    def compute():
        policy = sampling_weights(ctx, version, policy_fp)
        prompts = read_stage(ctx.layout, "prompts", iteration).filter(pl.col("round") == round_)
        seed, name = ctx.cfg.seed * 1_000_003 + iteration * 1009 + round_ * 101, f"rollouts-{iteration:05d}-{round_}"
        sampler = Sampler(lambda n, s: sampling_job(ctx, n, r.temperature, s, r.top_p), one_job(ctx, policy.path))
        sampled = mode.fn(
            ctx=ctx, prompts=prompts, policy=policy, iteration=iteration, round_=round_, seed=seed, name=name,
            sampler=sampler,
        )  # fmt: skip
        return round_written(ctx, sampled, policy, iteration, round_)

    inputs = {**upstream, "policy": policy_fp, **mode.inputs(ctx, iteration, round_)}
    return run_stage(ctx, iteration, part=round_, inputs=inputs, compute=compute)


def round_written(ctx: RunContext, sampled: SampledRound, policy: Weights, iteration: int, round_: int) -> Computed:
    """A mode's round as the stage writes it: its tables stamped with the iteration and round, its rows with the policy
    version they were sampled with (partial rollouts': the oldest of their tokens' versions, theirs already), the reply
    and the figures in the manifest."""
    stamp = (pl.lit(iteration, pl.Int32).alias("iteration"), pl.lit(round_, pl.Int32).alias("round"))
    df = sampled.rows.with_columns(*stamp)
    if "policy_version" not in df.columns:
        df = df.with_columns(pl.lit(policy.version, pl.Int32).alias("policy_version"))
    reply = sampled.reply
    per_engine = [
        {**dataclasses.asdict(e), "tokens_per_second": e.tokens / e.generate_seconds if e.generate_seconds > 0 else 0.0}
        for e in reply.per_engine
    ]
    return Computed(
        df,
        tables={name: table.with_columns(*stamp) for name, table in sampled.tables.items()},
        engines={"vllm": reply.vllm_version},
        extra={
            # What the rollouts' sampler_logprobs are the log-softmax of: logits / T. A rerun of a later stage
            # keeps these rollouts under its new config, and checks it (flows/rerun.py check_sampler_logprobs).
            "sampler_logprobs_temperature": ctx.cfg.sampler_logprobs_temperature,
            f"round{round_}": {
                "engine_start_seconds": reply.engine_start_seconds,
                "sync_seconds": reply.sync_seconds,
                "sync_bytes": reply.sync_bytes,
                "sync_logprob_gap": reply.sync_logprob_gap,
                "sampler_peak_rss_gib": reply.peak_rss_gib,
                "sampler_kv_cache_gib": reply.kv_cache_gib,
                **sampled.figures,
                "engines": per_engine,
            },
        },
    )


@stage_task("sample_ahead")
def sample_ahead_task(storage_root: str, run_id: str, iteration: int) -> bool:
    """Before iteration `iteration`'s generation runs beside the update before it (rl.max_staleness 1): whether it
    still has to run (its batch is not complete), and if so the rollout replicas brought to the weights it samples
    with now, while the trainer holds them (the update it runs beside changes them)."""
    from storage import read_manifest

    ctx = load_run(storage_root, run_id, SPEC)
    if read_manifest(ctx.layout, "batch", iteration, verify=False) is not None:
        return False  # complete (its flow run checks its fingerprints as for any stage)
    policy = weights_after(ctx, sampling_version(ctx.cfg, iteration))
    engines = start_rollout_engines(ctx, policy.path)
    sync_replicas(ctx.layout, ctx.cfg.engines, engines, policy.path, sampler_settings(ctx, policy.path))
    return True


@stage_task("release_engines")
def release_engines_task() -> None:
    """Stop this process's resident vLLM engine (it also dies with the process)."""
    close_all()


SPEC = StageSpec(
    "rollouts",
    reads=("prompts",),
    sections=("rollout", "model", "lora", "agent"),
    keys=("data.prompt_key", "data.id_key"),  # an environment's reset(row) gets those columns by their names
    key_inputs=(("rl.max_staleness", "rollout.partial_tokens"),),  # the age past which a carried group is dropped
    scope="round",
    also_writes=("turns", "carry"),
    task=rollouts_task,
    rerunnable=True,  # every round again, from the saved prompts
)
# Multi-turn rollouts' messages, the rollouts task's second table (written only under the agent section).
TURNS_SPEC = StageSpec("turns", reads=("rollouts",), sections=SPEC.sections, keys=SPEC.keys, scope="round")
# Partial rollouts' sequences in flight after each round (rollout.partial_tokens), the rollouts task's third table.
CARRY_SPEC = StageSpec("carry", reads=("rollouts",), sections=SPEC.sections, keys=SPEC.keys, scope="round")
