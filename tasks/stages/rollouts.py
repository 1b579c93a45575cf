"""Stage `rollouts`: G samples per prompt from vLLM, with the sampler's own logprobs.

Reads `prompts` (this round's part) and the policy weights; writes `rollouts`, one part per round.
The engine runs in its own resident process (tasks/engines/vllm_client.py), kept across rounds, iterations
and eval, and synced to the weights each request names.
"""

from __future__ import annotations

import polars as pl

from schemas.requests import GenerateRequest, GenerationJob, VLLMSettings
from storage import StageOutput, read_stage
from tasks.engines.launch import WorkerError
from tasks.engines.resident import close_all
from tasks.engines.vllm_client import resident_engine
from tasks.stages.common import Computed, RunContext, load_run, run_stage, scratch_file, stage_task, upstream_part_fingerprints
from tasks.stages.spec import StageSpec
from tasks.stages.weights import weights_after


def sampling_job(ctx: RunContext, n: int, temperature: float, seed: int, top_p: float = 1.0) -> dict:
    """One generation pass's sampling settings: the run's generation limit and stop conditions (the files are added
    by `generate`)."""
    r = ctx.cfg.rollout
    return {"n": n, "temperature": temperature, "top_p": top_p, "max_tokens": r.max_tokens, "seed": seed,
            "stop": tuple(r.stop), "stop_token_ids": tuple(r.stop_token_ids)}


def generate(ctx: RunContext, model_path: str, prompts: pl.DataFrame, jobs: list[dict], log_name: str) -> tuple[list[pl.DataFrame], dict]:
    """Run the resident vLLM engine over `jobs` for the prompts' token ids (formatted once, in the `dataset` stage);
    return one frame per job, each row with its prompt_token_ids."""
    inp = scratch_file(ctx, f"{log_name}.prompts.parquet")
    prompts.select("prompt_id", "prompt_token_ids").write_parquet(inp)
    outs = [scratch_file(ctx, f"{log_name}.out{i}.parquet") for i in range(len(jobs))]
    request = GenerateRequest(model_path, tuple(GenerationJob(str(inp), str(o), **j) for j, o in zip(jobs, outs)))
    engine = resident_engine(ctx.layout.run_id, ctx.layout.log_path("vllm"))
    resp = engine.generate(request, VLLMSettings.from_config(model_path, ctx.cfg.model, ctx.cfg.rollout, ctx.cfg.seed))
    gap, limit = resp["sync_logprob_gap"], ctx.cfg.rollout.max_sync_logprob_gap
    if gap is not None and not gap <= limit:
        raise WorkerError(f"the sampler's weights do not match the trainer's: mean logprob gap {gap:.3g} on the "
                          f"probe sequences of {model_path} (rollout.max_sync_logprob_gap = {limit:g})")
    frames = []
    for o in outs:
        frames.append(pl.read_parquet(o).join(pl.read_parquet(inp), on="prompt_id", how="left"))
        o.unlink()
    inp.unlink()
    return frames, resp


@stage_task("rollouts")
def rollouts_task(storage_root: str, run_id: str, iteration: int, round_: int, prompts_fp: str) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    policy = weights_after(ctx, iteration - 1)
    r = ctx.cfg.rollout

    def compute():
        prompts = read_stage(ctx.layout, "prompts", iteration).filter(pl.col("round") == round_)
        job = sampling_job(ctx, r.group_size, r.temperature, ctx.cfg.seed * 1_000_003 + iteration * 1009 + round_ * 101, r.top_p)
        (df,), resp = generate(ctx, policy.path, prompts, [job], f"rollouts-{iteration:05d}-{round_}")
        df = df.with_columns(
            pl.lit(iteration, pl.Int32).alias("iteration"), pl.lit(round_, pl.Int32).alias("round"),
            pl.lit(policy.version, pl.Int32).alias("policy_version"),
        )
        timing = resp["jobs"][0]
        return Computed(
            df, engines={"vllm": resp["vllm_version"]},
            extra={f"round{round_}": {"engine_start_seconds": resp["engine_start_seconds"],
                                      "sync_seconds": resp["sync_seconds"], "sync_logprob_gap": resp["sync_logprob_gap"],
                                      **timing}},
        )

    return run_stage(ctx, iteration, part=round_, inputs={"prompts": prompts_fp, "policy": policy.fingerprint}, compute=compute)


@stage_task("release_engines")
def release_engines_task() -> None:
    """Stop this process's resident vLLM engine (it also dies with the process)."""
    close_all()


def recompute(root: str, run_id: str, iteration: int) -> list[StageOutput]:
    """Every round again, from the saved prompts (then the engine is released: a rerun is one command)."""
    try:
        return [rollouts_task.fn(root, run_id, iteration, r, fp)
                for r, fp in enumerate(upstream_part_fingerprints(root, run_id, "prompts", iteration))]
    finally:
        release_engines_task.fn()


SPEC = StageSpec("rollouts", reads=("prompts",), sections=("rollout", "model"), scope="round", recompute=recompute)
