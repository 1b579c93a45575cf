"""The stage graph: every stage's declaration (each module's SPEC). The iteration's stage order (a topological order of
the declared reads), the fingerprints each stage's task is handed (its `reads`), what `rlpipe rerun` can recompute
and from what, what a rerun makes stale, `show`'s order and what a config change invalidates are all derived from
here; nothing else lists the stages. Adding a stage to an RL iteration is its module (its task and its SPEC), its
table's schema and one line below; a second table is its schema, the stage's `also_writes` and one line below.
"""

from __future__ import annotations

import inspect

from tasks.stages import (
    advantages,
    batch,
    dataset,
    dpo,
    evaluate,
    logprobs,
    optimize,
    preference_data,
    process_model,
    prompts,
    reward_model,
    rollouts,
    scores,
    sft,
)
from tasks.stages.spec import StageSpec


def in_data_order(specs: tuple[StageSpec, ...]) -> tuple[StageSpec, ...]:
    """The stages, each after every stage whose table it reads: a stable topological sort (the declaration order where
    the reads leave a choice). Reads of tables outside `specs` (the run's dataset) do not order them."""
    names = {s.name for s in specs}
    order, placed, pending = [], set(), list(specs)
    while pending:
        ready = next((s for s in pending if set(s.all_reads) & names <= placed), None)
        if ready is None:
            raise ValueError(f"the stages {[s.name for s in pending]} read each other in a cycle")
        order.append(ready)
        placed.add(ready.name)
        pending.remove(ready)
    return tuple(order)


PROMPT_STATS = advantages.STATS_SPEC
TURNS = rollouts.TURNS_SPEC
CARRY = rollouts.CARRY_SPEC

# Once per run, before any iteration (iteration 0).
RUN_STAGES = (dataset.SPEC, sft.SPEC, sft.TRAIN_SPEC)
# One RL iteration, in data order; prompt_stats is advantages' second table; eval reads the iteration's checkpoint.
RL_ITERATION = in_data_order(
    (
        prompts.SPEC,
        rollouts.SPEC,
        TURNS,
        CARRY,
        scores.SPEC,
        batch.SPEC,
        logprobs.SPEC,
        advantages.SPEC,
        PROMPT_STATS,
        optimize.SPEC,
        evaluate.SPEC,
    )
)
PREFERENCE_STAGES = (
    preference_data.SPEC,
    preference_data.PAIRS_SPEC,
    dpo.REF_SPEC,
    dpo.TRAIN_SPEC,
    dpo.EVAL_SPEC,
    reward_model.TRAIN_SPEC,
    reward_model.EVAL_SPEC,
    process_model.STEPS_SPEC,
    process_model.TRAIN_SPEC,
    process_model.EVAL_SPEC,
)
STAGES = RUN_STAGES + RL_ITERATION + PREFERENCE_STAGES


def stage(name: str) -> StageSpec:
    """A stage by its table's name or an alias (`optimize`)."""
    for spec in STAGES:
        if name == spec.name or name in spec.aliases:
            return spec
    raise KeyError(name)


def rerunnable() -> list[StageSpec]:
    return [s for s in RL_ITERATION if s.rerunnable]


def downstream_tables(name: str) -> list[str]:
    """The tables of one iteration that recomputing `name` makes stale: it and everything after it in data order."""
    names = [s.name for s in RL_ITERATION]
    return names[names.index(stage(name).name) :]


def with_readers(names: set[str]) -> set[str]:
    """The stages named and every stage that reads one of them, transitively."""
    stale = set(names)
    while more := {s.name for s in STAGES if s.name not in stale and stale & {*s.all_reads, *s.reads_previous}}:
        stale |= more
    return stale


def invalidated_by(section: str) -> list[str]:
    """The stages a change to one config section recomputes: those that declare it, and every stage that reads one of
    them, transitively."""
    stale = with_readers({s.name for s in STAGES if section in s.sections or s.keys_of(section)})
    return [s.name for s in STAGES if s.name in stale]


# What a stage's task may be handed, by the name of its parameter (StageSpec's docstring).
CONTEXT_PARAMETERS = ("storage_root", "run_id", "iteration", "round_", "upstream")


def upstream(spec: StageSpec, round_: int, fingerprints: dict[str, list[str]], every_round: set[str]) -> dict:
    """The fingerprints of the tables `spec` reads, as its fingerprint's inputs: table → its fingerprint (a per-round
    stage: its own round's), or for a per-round table that a per-iteration stage reads, `<table>_round<i>` → each
    round's. `fingerprints`: table → its fingerprints, one per round for a per-round table (`every_round`)."""
    out = {}
    for table in spec.reads:
        fps = fingerprints[table]
        if table in every_round and spec.scope == "iteration":
            out.update({f"{table}_round{i}": fp for i, fp in enumerate(fps)})
        else:
            out[table] = fps[round_ if table in every_round else -1]
    return out


def task_arguments(
    spec: StageSpec,
    storage_root: str,
    run_id: str,
    iteration: int,
    round_: int,
    fingerprints: dict[str, list[str]],
    every_round: set[str],
) -> dict:
    """Keyword arguments for `spec.task`: the context it asks for by name, and `upstream`. `fingerprints`: table → its
    fingerprints in this iteration, one per round for the per-round tables (`every_round`); a table read from the
    run's iteration 0 (the dataset) is taken from its manifest."""
    from tasks.stages.common import upstream_fingerprint

    known = dict(fingerprints)
    for table in spec.reads:
        if table not in known:
            if table not in {s.name for s in RUN_STAGES}:
                raise KeyError(f"stage {spec.name!r} reads {table!r}, which nothing before it in the iteration wrote")
            known[table] = [upstream_fingerprint(storage_root, run_id, table, 0)]
    args = {"storage_root": storage_root, "run_id": run_id, "iteration": iteration, "round_": round_}
    args["upstream"] = upstream(spec, round_, known, every_round)
    params = inspect.signature(spec.task).parameters
    return {name: value for name, value in args.items() if name in params}


def _check_task(spec: StageSpec, tables: dict[str, StageSpec]) -> None:
    """A task's parameters must be bindable, and a per-round stage may read only per-round tables: a developer's
    mistake here fails at import, naming it."""
    for name, param in inspect.signature(spec.task).parameters.items():
        if name not in CONTEXT_PARAMETERS and param.default is inspect.Parameter.empty:
            raise TypeError(f"stage {spec.name!r}: task parameter {name!r} is not one the graph hands a task")
    if spec.scope == "round" and any(tables[t].scope != "round" for t in spec.reads if t in tables):
        raise TypeError(f"stage {spec.name!r} runs every round but reads a table written once per iteration")


def checked(specs: tuple[StageSpec, ...]) -> tuple[StageSpec, ...]:
    """The stages, once each task's parameters are checked bindable."""
    tables = {s.name: s for s in specs}
    for spec in specs:
        _check_task(spec, tables)
    return specs


# The stages an RL iteration's flow run calls, in data order: every round's, then the iteration's.
ITERATION_TASKS = checked(tuple(s for s in RL_ITERATION if s.task is not None))


def generation(specs: tuple[StageSpec, ...]) -> tuple[StageSpec, ...]:
    """The stages that sample and gather an iteration's rounds, without the policy being trained: the per-round ones,
    and the per-iteration ones that read nothing but per-round tables (the batch). One step off-policy, these run for
    iteration k + 1 while the rest of iteration k (logprobs, advantages, the update) trains."""
    per_round = {s.name for s in specs if s.scope == "round" and not s.reads_previous}
    return tuple(
        s for s in specs if s.name in per_round or (s.reads and set(s.reads) <= per_round and not s.reads_previous)
    )


GENERATION_TASKS = generation(ITERATION_TASKS)
