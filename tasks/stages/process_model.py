"""Stages of the reward-model flow under reward_model.objective process (a process reward model, PRM):

`prm_steps` (iteration 0): `preference.k` samples of each of `preference.n_prompts` train prompts from model.path
(vLLM), split into steps by reward.steps, each step labelled right (1) or wrong (0) by a per_step reward function (its
step score ≥ 0.5; reward_model.step_label); a seeded `preference.heldout_fraction` of the prompts is held out.
`prm_metrics` (iteration 1): a token-classification head trained with DeepSpeed on the train split (binary
cross-entropy at each step's last token), exported to reward_model.out_path. `prm_eval` (iteration 1): the trained
PRM's step probabilities on the held-out responses; its manifest has the step accuracy against the majority label, the
step AUC, and whether the weakest step (min) tells right responses from wrong ones.
"""

from __future__ import annotations

import polars as pl

from schemas.config import step_label_function
from schemas.errors import UserError
from storage import StageOutput, read_stage
from storage.model_ids import model_fingerprint
from tasks.algos.metrics import prm_summary
from tasks.data.preferences import assign_splits
from tasks.rewards.loader import source_hash, specs_from_config
from tasks.rewards.scoring import score_frame
from tasks.stages.common import Computed, load_run, run_stage, score_frame_worker, stage_task
from tasks.stages.prompts import split_of
from tasks.stages.reward_model import ensure_exported, trained_model
from tasks.stages.rollouts import generate, sampling_job
from tasks.stages.scores import step_ends
from tasks.stages.spec import StageSpec


class ProcessDataError(UserError, ValueError):
    pass


@stage_task("rm_objective")
def rm_objective_task(storage_root: str, run_id: str) -> str:
    """The reward-model flow's branch: bradley_terry or process (flows read no config themselves)."""
    return load_run(storage_root, run_id).cfg.reward_model.objective


def step_labels(label: str) -> pl.Expr:
    """Each step right (1.0) when the labelling function's step score is at least 0.5, else wrong (0.0)."""
    return pl.col(f"steps_{label}").list.eval((pl.element() >= 0.5).cast(pl.Float64)).alias("step_labels")


@stage_task("prm_steps")
def prm_steps_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, STEPS_SPEC)
    p, label = ctx.cfg.preference, step_label_function(ctx.cfg.reward, ctx.cfg.reward_model)

    def compute():
        train = split_of(ctx, "train").head(p.n_prompts)
        job = sampling_job(ctx, p.k, p.temperature, ctx.cfg.seed)
        (samples,), resp = generate(ctx, ctx.cfg.model.path, train, [job], "prm-samples")
        # The rule functions only: a reward model, a judge or the PRM being trained add nothing to the labels.
        stamp = (pl.lit(0, pl.Int32).alias("iteration"), pl.lit(0, pl.Int32).alias("round"))
        scores = score_frame(
            samples.with_columns(*stamp), train, ctx.cfg.reward, ctx.cfg.rollout.max_tokens, ctx.cfg.data.answer_key
        ).select("prompt_id", "sample_idx", f"steps_{label}", f"error_{label}")
        scored = samples.join(scores, on=["prompt_id", "sample_idx"], validate="1:1", maintain_order="left")
        scored = scored.with_columns(step_ends(ctx, samples))
        errors = scored.filter(pl.col(f"error_{label}").is_not_null())
        if errors.height == scored.height:
            raise ProcessDataError(
                f"reward function {label!r} failed on every sample, e.g. {errors[f'error_{label}'][0]}: no step labels"
            )
        steps = (
            scored.filter(pl.col(f"error_{label}").is_null() & (pl.col("length") > 0))
            .with_columns(step_labels(label))
            .select(
                "prompt_id",
                "sample_idx",
                "prompt_token_ids",
                pl.col("text").alias("response"),
                pl.col("token_ids").alias("response_token_ids"),
                "step_ends",
                "step_labels",
            )
        )
        mismatch = steps.filter(pl.col("step_ends").list.len() != pl.col("step_labels").list.len()).head(1)
        if mismatch.height:
            raise ProcessDataError(
                f"reward function {label!r} returned {mismatch['step_labels'][0].len()} step scores for a response "
                f"that reward.steps splits into {mismatch['step_ends'][0].len()} steps (prompt "
                f"{mismatch['prompt_id'][0]!r}): a per_step function returns one score per step it is given"
            )
        if steps["prompt_id"].n_unique() < 2:
            raise ProcessDataError(
                f"prm_steps: {steps.height} labelled responses from {steps['prompt_id'].n_unique()} prompt(s); a train "
                "and a held-out split need at least 2 (raise preference.n_prompts)"
            )
        steps = assign_splits(steps, p.heldout_fraction, ctx.cfg.seed)
        flat = steps.select(pl.col("step_labels").explode())["step_labels"]
        extra = {
            "prompts": train.height,
            "samples": samples.height,
            "responses": steps.height,
            "steps": flat.len(),
            "right_step_share": float(flat.mean()) if flat.len() else None,
            "label_function": label,
        }
        return Computed(steps, engines={"vllm": resp.vllm_version}, extra=extra)

    inputs = {"model": model_fingerprint(ctx.cfg.model.path), "dataset": upstream["dataset"]}
    return run_stage(ctx, 0, salt=source_hash(specs_from_config(ctx.cfg.reward)), inputs=inputs, compute=compute)


@stage_task("prm_optimize")
def prm_optimize_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, TRAIN_SPEC)
    r = ctx.cfg.reward_model

    def compute():
        train = read_stage(ctx.layout, "prm_steps", 0).filter(pl.col("split") == "train")
        return trained_model(ctx, "prm", train, r, "responses")

    out = run_stage(
        ctx, 1, compute=compute, inputs={"steps": upstream["prm_steps"], "base": model_fingerprint(ctx.cfg.model.path)}
    )
    ensure_exported(ctx.layout.checkpoint_dir(1), r.out_path)
    return out


@stage_task("prm_eval")
def prm_eval_task(storage_root: str, run_id: str, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, EVAL_SPEC)

    def compute():
        held = read_stage(ctx.layout, "prm_steps", 0).filter(pl.col("split") == "heldout")
        scored = score_frame_worker(
            ctx, "prm_score", str(ctx.layout.checkpoint_dir(1)), ctx.cfg.reward_model.micro_batch_size,
            held.select("prompt_id", "sample_idx", "prompt_token_ids", "response_token_ids", "step_ends"), "prm_eval",
        )  # fmt: skip
        df = held.select("prompt_id", "sample_idx", "step_labels").join(
            scored.select("prompt_id", "sample_idx", "step_scores"), on=["prompt_id", "sample_idx"], validate="1:1"
        )
        return Computed(df, extra=prm_summary(df))

    return run_stage(ctx, 1, inputs={"steps": upstream["prm_steps"], "prm": upstream["prm_metrics"]}, compute=compute)


STEPS_SPEC = StageSpec(
    "prm_steps",
    reads=("dataset",),
    scope="run",
    sections=("preference", "prompt", "rollout", "reward", "reward_model", "model", "data", "lora", "optim"),
    task=prm_steps_task,
)
TRAIN_SPEC = StageSpec(
    "prm_metrics",
    reads=("prm_steps",),
    sections=("reward_model", "model", "prompt"),
    scope="run",
    also_writes=("checkpoints",),
    task=prm_optimize_task,
)
EVAL_SPEC = StageSpec(
    "prm_eval", reads=("prm_steps", "prm_metrics"), sections=("reward_model", "model"), scope="run", task=prm_eval_task
)
