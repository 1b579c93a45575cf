"""Stage `advantages`: the configured estimator (tasks/algos/advantages.py) over the iteration's tables.

Reads `batch` (kept groups), `scores` (rewards), `rollouts` (lengths) and `logprobs` (old/ref logprobs for a
KL in the reward, critic values for GAE); writes `advantages`. Under dcpo it also reads the previous
iteration's `prompt_stats` snapshot and writes this iteration's (before the advantages manifest, which
marks both complete).
"""

from __future__ import annotations

import polars as pl

from schemas.errors import NotFound
from storage import StageOutput, read_manifest, read_stage
from tasks.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputError,
    AdvantageSettings,
    compute_advantages,
    empty_prompt_stats,
    tree_mean_advantages,
    update_prompt_stats,
)
from tasks.rewards.sources import outcome_parts
from tasks.stages.common import Computed, RunContext, load_run, run_stage, stage_task
from tasks.stages.kl_control import kl_beta
from tasks.stages.spec import StageSpec

KEYS = ["prompt_id", "sample_idx"]


def advantage_inputs(
    ctx: RunContext,
    iteration: int,
    kept_only: bool = True,
    components: bool | None = None,
    steps: bool | None = None,
) -> pl.DataFrame:
    """One row per response: prompt_id, sample_idx, reward, length (and a multi-turn rollout's action_mask), the
    reward's components (`components`), the process rewards' step ends and scores (`steps`), each by default when the
    run's estimator reads them, and the logprobs table's lists."""
    needs = ADVANTAGE_ESTIMATORS.entry(ctx.cfg.advantage.estimator)
    components = needs.needs_components if components is None else components
    steps = needs.needs_steps if steps is None else steps
    reward = ctx.cfg.reward
    parts = [column for column, _ in reward.weighted_parts()] if components else []
    if steps:  # grpo_process: the step ends and scores, and the outcome parts it adds on the last step
        if not reward.weighted_step_parts():
            raise AdvantageInputError(
                f"grpo_process needs process rewards (a reward function with per_step: true, or "
                f"reward.process_model), and run {ctx.layout.run_id!r} has none"
            )
        parts += ["step_ends", *(c for c, _ in reward.weighted_step_parts()), *(c for c, _ in outcome_parts(reward))]
        parts = list(dict.fromkeys(parts))
    scores = read_stage(ctx.layout, "scores", iteration).select("iteration", *KEYS, "reward", *parts)
    if kept_only:
        kept = read_stage(ctx.layout, "batch", iteration).filter("kept").select("prompt_id")
        scores = scores.join(kept, on="prompt_id", how="semi")
    rollouts = read_stage(ctx.layout, "rollouts", iteration)
    actions = ["action_mask"] if "action_mask" in rollouts.columns else []  # multi-turn: GAE skips observations
    lengths = rollouts.select(*KEYS, "length", *actions)
    df = scores.join(lengths, on=KEYS, how="inner", validate="1:1", maintain_order="left")
    if kept_only:
        teacher = ["teacher_logprobs"] if needs.needs_teacher else []
        lists = read_stage(ctx.layout, "logprobs", iteration).select(
            *KEYS, "old_logprobs", "ref_logprobs", "values", *teacher
        )
        df = df.join(lists, on=KEYS, how="inner", validate="1:1", maintain_order="left")
    return df


def settings_from(cfg, kl_beta: float = 0.0) -> AdvantageSettings:
    """The estimators' settings from a run's config (its advantage, kl and reward sections) and the iteration's β of a
    KL in the reward (0: none)."""
    a = cfg.advantage
    return AdvantageSettings(
        eps=a.eps,
        gamma=a.gamma,
        lam=a.lam,
        kl_beta=kl_beta,
        kl_estimator=cfg.kl.estimator,
        pass_k=a.pass_k,
        correct_at=a.correct_at,
        components=cfg.reward.weighted_parts(),
        step_parts=cfg.reward.weighted_step_parts(),
        outcome_parts=outcome_parts(cfg.reward),
    )


def advantage_settings(ctx: RunContext, iteration: int) -> AdvantageSettings:
    in_reward = ctx.cfg.kl.placement == "reward"  # a KL in the loss is the trainer's
    return settings_from(ctx.cfg, kl_beta(ctx, iteration) if in_reward else 0.0)


def prompt_history(ctx: RunContext, iteration: int) -> tuple[pl.DataFrame, str]:
    """The prompt_stats snapshot after iteration − 1 (empty before the first) and its fingerprint."""
    if iteration <= 1:
        return empty_prompt_stats(), ""
    manifest = read_manifest(ctx.layout, "prompt_stats", iteration - 1)
    if manifest is None:
        raise NotFound(f"dcpo needs the prompt_stats of iteration {iteration - 1}, which is missing")
    return read_stage(ctx.layout, "prompt_stats", iteration - 1), manifest["fingerprint"]


@stage_task("advantages")
def advantages_task(storage_root: str, run_id: str, iteration: int, upstream: dict) -> StageOutput:
    ctx = load_run(storage_root, run_id, SPEC)
    estimator = ADVANTAGE_ESTIMATORS.entry(ctx.cfg.advantage.estimator)
    settings = advantage_settings(ctx, iteration)
    history, history_fp = prompt_history(ctx, iteration) if estimator.keeps_prompt_state else (None, "")
    inputs = {**upstream, "prompt_stats": history_fp}

    def compute():
        df = advantage_inputs(ctx, iteration)
        if estimator.needs_critic and df["values"].null_count():
            raise ValueError(
                f"advantage.estimator={estimator.name} needs critic values, but the logprobs stage wrote none"
            )
        out = compute_advantages(df, estimator.name, settings, history)
        if ctx.cfg.advantage.branch_attribution == "hard":  # ARPO's: shared tokens get their trajectories' mean
            tree = read_stage(ctx.layout, "rollouts", iteration)
            if "parent_sample_idx" not in tree.columns:
                raise AdvantageInputError(
                    f"advantage.branch_attribution hard: iteration {iteration}'s rollouts hold no branching tree (they "
                    "were sampled without agent.branching)"
                )
            tree = tree.select(*KEYS, "parent_sample_idx", "branch_point")
            out = tree_mean_advantages(out.join(tree, on=KEYS, how="left", maintain_order="left"))
        stats = {"prompt_stats": update_prompt_stats(history, df, iteration)} if estimator.keeps_prompt_state else {}
        nonzero = float((out["advantage"] != 0).mean())
        return Computed(
            out.select("iteration", *KEYS, "reward", "advantage", "token_advantages", "returns"),
            tables=stats,
            extra={"nonzero_advantage_fraction": nonzero, "kl_beta": settings.kl_beta},
        )

    return run_stage(ctx, iteration, inputs=inputs, compute=compute, salt=f"beta={settings.kl_beta:.12g}")


SPEC = StageSpec(
    "advantages",
    reads=("logprobs", "batch"),
    also_reads=("scores", "rollouts"),  # the batch's rewards and lengths
    sections=("advantage", "kl", "reward"),  # reward: its weights, which gdpo applies to the normalised components
    scope="iteration",
    also_writes=("prompt_stats",),
    reads_previous=("prompt_stats", "train_metrics"),  # DCPO's history; the adaptive KL's β
    task=advantages_task,
    rerunnable=True,
)
# DCPO's per-prompt history, advantages' second table.
STATS_SPEC = StageSpec("prompt_stats", reads=("advantages",), sections=SPEC.sections, scope="iteration")
