"""Stage `logprobs`: old-policy and reference logprobs and entropy, recomputed by torch (as verl does).

Reads `batch` (kept groups) and `rollouts`; writes `logprobs` (list<float32> per response token), with the
critic's values when the run has one (PPO), and a distillation teacher's logprobs with advantage.teacher_path.
The sampler's own logprobs stay in `rollouts`; their gap to these is a metric.
"""

from __future__ import annotations

import polars as pl

from schemas.requests import LogprobsRequest
from storage import StageOutput, read_stage
from tasks.engines.trainer_client import call_trainer
from tasks.stages.common import (
    Computed,
    RunContext,
    load_run,
    run_stage,
    scratch_file,
    stage_task,
)
from tasks.stages.spec import StageSpec
from tasks.stages.weights import (
    critic_after,
    model_fingerprint,
    starting_weights,
    weights_after,
    weights_fingerprint,
)


def kept_rollouts(ctx: RunContext, iteration: int) -> pl.DataFrame:
    kept = read_stage(ctx.layout, "batch", iteration).filter("kept").select("prompt_id")
    return read_stage(ctx.layout, "rollouts", iteration).join(kept, on="prompt_id", how="semi")


@stage_task("logprobs")
def logprobs_task(storage_root: str, run_id: str, iteration: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    ref = starting_weights(ctx)
    teacher = ctx.cfg.advantage.teacher_path
    # loss.old_logprobs sampler: π_old is vLLM's, and without a KL nothing reads the reference: no pass at all.
    from_sampler = ctx.cfg.loss.old_logprobs == "sampler"
    with_ref = not from_sampler or ctx.cfg.kl.placement != "none"

    def compute():
        policy = weights_after(ctx, iteration - 1)
        sampler = ("sampler_logprobs",) if from_sampler else ()
        samples = kept_rollouts(ctx, iteration).select(
            "prompt_id", "sample_idx", "prompt_token_ids", "token_ids", *sampler
        )
        inp, out = scratch_file(ctx, "logprobs.in.parquet"), scratch_file(ctx, "logprobs.out.parquet")
        samples.write_parquet(inp)
        critic = critic_after(ctx, iteration - 1) if ctx.cfg.uses_critic else None
        request = LogprobsRequest(
            policy_path=policy.path,
            ref_path=ref.path,
            samples_path=str(inp),
            out_path=str(out),
            micro_batch_size=ctx.cfg.optim.micro_batch_size,
            micro_batch_tokens=ctx.cfg.optim.logprob_micro_batch_tokens or ctx.cfg.optim.micro_batch_tokens,
            dtype=ctx.cfg.model.dtype,
            critic_path=critic.path if critic else None,
            critic_fresh=bool(critic and critic.fresh),
            teacher_path=teacher,
            old_from_sampler=from_sampler,
            with_ref=with_ref,
            temperature=ctx.cfg.rollout.temperature,
        )
        resp = call_trainer(ctx.layout, ctx.cfg.engines, request, f"logprobs-{iteration:05d}")
        df = pl.read_parquet(out).with_columns(pl.lit(iteration, pl.Int32).alias("iteration"))
        inp.unlink(), out.unlink()
        return Computed(df, extra=resp)

    return run_stage(
        ctx,
        iteration,
        salt="critic" if ctx.cfg.uses_critic else "",
        inputs={
            **upstream,
            "policy": weights_fingerprint(ctx, iteration - 1),
            "ref": ref.fingerprint,
            **({"teacher": model_fingerprint(teacher)} if teacher else {}),
        },
        compute=compute,
    )


SPEC = StageSpec(
    "logprobs",
    reads=("batch",),
    also_reads=("rollouts",),  # the batch's kept samples
    sections=("optim", "model", "advantage"),
    keys=("loss.old_logprobs", "kl.placement", "rollout.temperature"),  # which passes run, and at what temperature
    scope="iteration",
    task=logprobs_task,
    rerunnable=True,
)
