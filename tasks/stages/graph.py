"""The stage graph: every stage's declaration (each module's SPEC), in order. The iteration's stage order, what
`rlpipe rerun` can recompute, what a rerun makes stale, `show`'s order and what a config change invalidates are all
derived from here; nothing else lists the stages.
"""

from __future__ import annotations

from tasks.stages import (
    advantages,
    batch,
    dataset,
    dpo,
    evaluate,
    logprobs,
    optimize,
    preference_data,
    prompts,
    reward_model,
    rollouts,
    scores,
    sft,
)
from tasks.stages.spec import StageSpec

PROMPT_STATS = advantages.STATS_SPEC

# Once per run, before any iteration (iteration 0).
RUN_STAGES = (dataset.SPEC, sft.SPEC, sft.TRAIN_SPEC)
# One RL iteration, in data order; prompt_stats is advantages' second table; eval reads the iteration's checkpoint.
RL_ITERATION = (
    prompts.SPEC,
    rollouts.SPEC,
    scores.SPEC,
    batch.SPEC,
    logprobs.SPEC,
    advantages.SPEC,
    PROMPT_STATS,
    optimize.SPEC,
    evaluate.SPEC,
)
PREFERENCE_STAGES = (
    preference_data.SPEC,
    preference_data.PAIRS_SPEC,
    dpo.REF_SPEC,
    dpo.TRAIN_SPEC,
    dpo.EVAL_SPEC,
    reward_model.TRAIN_SPEC,
    reward_model.EVAL_SPEC,
)
STAGES = RUN_STAGES + RL_ITERATION + PREFERENCE_STAGES


def stage(name: str) -> StageSpec:
    """A stage by its table's name or an alias (`optimize`)."""
    for spec in STAGES:
        if name == spec.name or name in spec.aliases:
            return spec
    raise KeyError(name)


def rerunnable() -> list[StageSpec]:
    return [s for s in RL_ITERATION if s.recompute is not None]


def downstream_tables(name: str) -> list[str]:
    """The tables of one iteration that recomputing `name` makes stale: it and everything after it in data order."""
    names = [s.name for s in RL_ITERATION]
    return names[names.index(stage(name).name) :]


def with_readers(names: set[str]) -> set[str]:
    """The stages named and every stage that reads one of them, transitively."""
    stale = set(names)
    while more := {s.name for s in STAGES if s.name not in stale and stale & set(s.reads)}:
        stale |= more
    return stale


def invalidated_by(section: str) -> list[str]:
    """The stages a change to one config section recomputes: those that declare it, and every stage that reads one of
    them, transitively."""
    stale = with_readers({s.name for s in STAGES if section in s.sections})
    return [s.name for s in STAGES if s.name in stale]
