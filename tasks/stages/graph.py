"""The stage graph: every stage's declaration (each module's SPEC), in graphs: the RL iteration and the run-scope flows'
(SFT, DPO, reward model, process reward model), all run by `run_stages`. Each graph's stage order (a topological
order of the declared reads), the fingerprints each stage's task is handed (its `reads`), what `rlpipe rerun` can
recompute and from what, what a rerun makes stale, `show`'s order and what a config change invalidates are all
derived from here; nothing else lists the stages. Adding a stage to an RL iteration is its module (its task and its
SPEC), its table's schema and one line below; a second table is its schema, the stage's `also_writes` and one line
below; a run-scope stage is the same three, its line in its flow's graph.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from storage import RunLayout, StageOutput
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
from tasks.stages.spec import AnotherRound, StageSpec


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

# The run-scope flows, one graph each: once per run, their data at iteration 0, a trained model's metrics and eval at
# its checkpoint's iteration, 1 (the SFT's at 0: its checkpoint is the run's `checkpoints/sft`). A flow runs its graph
# in spans (`split`): the stages that sample with vLLM, then, the engine freed, the training and its eval.
SFT = in_data_order((sft.SPEC, sft.TRAIN_SPEC))
DPO = in_data_order((preference_data.SPEC, preference_data.PAIRS_SPEC, dpo.REF_SPEC, dpo.TRAIN_SPEC, dpo.EVAL_SPEC))
REWARD_MODEL = in_data_order(
    (preference_data.SPEC, preference_data.PAIRS_SPEC, reward_model.TRAIN_SPEC, reward_model.EVAL_SPEC)
)
PROCESS_REWARD_MODEL = in_data_order((process_model.STEPS_SPEC, process_model.TRAIN_SPEC, process_model.EVAL_SPEC))
RUN_GRAPHS = {"sft": SFT, "dpo": DPO, "rm": REWARD_MODEL, "prm": PROCESS_REWARD_MODEL}

# Once per run, before any iteration (iteration 0).
RUN_STAGES = (dataset.SPEC, *SFT)
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
PREFERENCE_STAGES = tuple({s.name: s for s in DPO + REWARD_MODEL + PROCESS_REWARD_MODEL}.values())
STAGES = RUN_STAGES + RL_ITERATION + PREFERENCE_STAGES
RUN_TABLES = {s.name for s in STAGES if s.scope == "run"}


def stage(name: str) -> StageSpec:
    """A stage by its table's name or an alias (`optimize`)."""
    for spec in STAGES:
        if name == spec.name or name in spec.aliases:
            return spec
    raise KeyError(name)


def rerunnable() -> list[StageSpec]:
    return [s for s in RL_ITERATION if s.rerunnable]


def downstream_tables(name: str) -> list[str]:
    """The tables that recomputing `name` makes stale: of one iteration, it and everything after it in data order; of a
    run-scope flow's graph, it and every stage of those graphs that reads it, transitively, in data order."""
    spec = stage(name)
    if spec.scope == "run":
        stale = with_readers({spec.name}, SFT + PREFERENCE_STAGES)  # the run-scope graphs' stages
        return [s.name for s in STAGES if s.name in stale]
    names = [s.name for s in RL_ITERATION]
    return names[names.index(spec.name) :]


def with_readers(names: set[str], specs: tuple[StageSpec, ...] = STAGES) -> set[str]:
    """The stages named and every stage of `specs` that reads one of them, transitively."""
    stale = set(names)
    while more := {s.name for s in specs if s.name not in stale and stale & {*s.all_reads, *s.reads_previous}}:
        stale |= more
    return stale


def run_graph_of(tables: set[str]) -> str | None:
    """The run-scope graph (RUN_GRAPHS) a run's tables come from: the one holding a table no other graph writes (DPO's
    ref_logprobs, the reward model's rm_metrics); None for an RL run (it holds its iterations' tables; their eval
    is the DPO flow's too) or a run that holds neither."""
    if tables & {s.name for s in RL_ITERATION if s.name != "eval"}:
        return None
    for name, specs in RUN_GRAPHS.items():
        others = {s.name for other, g in RUN_GRAPHS.items() if other != name for s in g}
        if tables & ({s.name for s in specs} - others):
            return name
    return None


def split(specs: tuple[StageSpec, ...], after: str) -> tuple[tuple[StageSpec, ...], tuple[StageSpec, ...]]:
    """A graph in two spans, for a flow to do something between them (free the sampler's memory before training):
    the stages up to `after`, included, and the rest."""
    names = [s.name for s in specs]
    cut = names.index(after) + 1
    return specs[:cut], specs[cut:]


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
    """Keyword arguments for `spec.task`: the context it asks for by name, and `upstream` if it asks for it.
    `fingerprints`: table → its fingerprints in this iteration, one per round for the per-round tables
    (`every_round`); a table written once per run that they lack (the dataset; a rerun's upstream in a run-scope
    graph) is taken from its manifest."""
    params = inspect.signature(spec.task).parameters
    args = {"storage_root": storage_root, "run_id": run_id, "iteration": iteration, "round_": round_}
    if "upstream" in params:
        known = dict(fingerprints)
        for table in (t for t in spec.reads if t not in known):
            if table not in RUN_TABLES:
                raise KeyError(f"stage {spec.name!r} reads {table!r}, which nothing before it in the iteration wrote")
            known[table] = [run_table_fingerprint(storage_root, run_id, table)]
        args["upstream"] = upstream(spec, round_, known, every_round)
    return {name: value for name, value in args.items() if name in params}


def run_table_fingerprint(storage_root: str, run_id: str, table: str) -> str:
    """The fingerprint of a complete table written once per run, in the one iteration folder it holds (0; a trained
    model's metrics and eval: 1, their checkpoint's)."""
    from tasks.stages.common import upstream_fingerprint

    held = RunLayout(Path(storage_root), run_id).iterations(table)
    return upstream_fingerprint(storage_root, run_id, table, held[-1] if held else 0)


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
for _specs in RUN_GRAPHS.values():  # the run-scope flows' tasks, checked as the iteration's are
    checked(_specs)


def run_stages(stages: tuple[StageSpec, ...], storage_root: str, run_id: str, iteration: int = 0) -> dict:
    """Call each stage's task in the graph's data order, handing each the fingerprints of the tables it reads (a table
    no stage of `stages` writes: from its manifest). The one runner of every flow: an RL iteration's, and the
    run-scope flows' graphs (iteration 0), each stage skipped when complete (its manifest is the cache).

    Dynamic sampling: the per-round stages (prompts → rollouts → scores) run again, one round more, while the stage
    that gathers their rounds (batch: it alone knows target_groups and max_rounds) returns AnotherRound.
    Returns table → its StageOutput (a per-round table's: its last round's) and `rounds`."""
    fingerprints: dict[str, list[str]] = {}
    outputs: dict[str, StageOutput] = {}
    every_round = {s.name for s in stages if s.scope == "round"}
    round_ = 0
    while True:
        for spec in (s for s in stages if s.scope == "round"):
            args = task_arguments(spec, storage_root, run_id, iteration, round_, fingerprints, every_round)
            outputs[spec.name] = spec.task(**args)
            fingerprints.setdefault(spec.name, []).append(outputs[spec.name].fingerprint)
        for spec in (s for s in stages if s.scope != "round"):
            out = spec.task(**task_arguments(spec, storage_root, run_id, iteration, round_, fingerprints, every_round))
            if isinstance(out, AnotherRound):
                break
            if out is None:
                raise RuntimeError(f"stage {spec.name!r} returned no output")
            outputs[spec.name], fingerprints[spec.name] = out, [out.fingerprint]
        else:
            return {**outputs, "rounds": round_ + 1}
        round_ += 1


def generation(specs: tuple[StageSpec, ...]) -> tuple[StageSpec, ...]:
    """The stages that sample and gather an iteration's rounds, without the policy being trained: the per-round ones,
    and the per-iteration ones that read nothing but per-round tables (the batch). One step off-policy, these run for
    iteration k + 1 while the rest of iteration k (logprobs, advantages, the update) trains."""
    per_round = {s.name for s in specs if s.scope == "round" and not s.reads_previous}
    return tuple(
        s for s in specs if s.name in per_round or (s.reads and set(s.reads) <= per_round and not s.reads_previous)
    )


GENERATION_TASKS = generation(ITERATION_TASKS)
