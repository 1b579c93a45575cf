"""Stage-level rerun, fork and resume: recompute one stage of one iteration from the cached upstream Parquet.

- `rerun RUN --iteration K --stage S [--through T] [--set ...]`: the run's config takes the overrides; S at iteration
  K and everything after it (later stages of K, every stage of later iterations, their checkpoints, the summary)
  are moved aside to `RUN/_superseded/{n}/` and recorded in `RUN/superseded.json`, never deleted. Then S is
  recomputed, and with `--through` every rerunnable stage of K after it up to T, in the flow's order, one command
  and one start of each engine (logprobs, advantages and optimize with a new loss setting). `rlpipe resume RUN`
  continues from there.
- A stage of a run-scope flow's graph (SFT, DPO, reward model, PRM: tasks/stages/graph.py `RUN_GRAPHS`), with
  `--iteration 0`: it and every stage of the run's graph that reads it are recomputed, in data order; what read a
  checkpoint they rewrite (the DPO flow's eval of the trained policy) and the summary are moved aside, and `rlpipe
  resume RUN` runs the run's own flow, which finds its stages complete.
- `--fork NEW`: RUN is left untouched. NEW gets the new config and hard links to everything upstream of S
  (files are shared, not copied; writers always replace files by rename, so a link is never written through).
  Then S is recomputed in NEW.

Stages are called as plain functions (`task.fn`), without a Prefect flow run: a rerun of advantages takes
well under a second and starts no engine.
Imports: The stage graph is imported on first use: it imports every stage module (2.7 s with torch), which `rlpipe
resume`'s checks and the deployments' config checks do not need.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from schemas.config import ConfigError, build_config, dump_config
from schemas.errors import AlreadyExists, NotFound
from storage import RunLayout, read_manifest, write_json_atomic
from storage.lock import acquire_run_lock
from storage.moves import link_tree, move_aside
from storage.stage_io import write_bytes_atomic


def _stages():
    from tasks.stages import graph  # the stage graph: the only list of stages (imports every stage module)

    return graph


def _stage_table(stage: str) -> str:
    return _stages().stage(stage).name


def downstream_of(layout, stage: str) -> set[str]:
    """The tables of the same iteration that `stage` and everything after it write; of a run-scope stage, those of the
    run's graph that read it (run_graph_stages)."""
    if _run_scope(stage):
        return set(run_graph_stages(layout, stage))
    return set(_stages().downstream_tables(stage))


def _run_scope(stage: str) -> bool:
    return _stages().stage(stage).scope == "run"


def run_graph(layout) -> tuple:
    """The run-scope graph whose tables the run holds (tasks/stages/graph.py RUN_GRAPHS); () for an RL run."""
    graph = _stages()
    return graph.RUN_GRAPHS.get(graph.run_graph_of(tables_of(layout)), ())


def tables_of(layout) -> set[str]:
    """The tables a run holds, has moved aside (superseded.json) or was forked to recompute (forked_from.json): what
    tells its flow even when a rerun of its first stage stopped before writing it again."""
    tables = set(layout.stages())
    if layout.superseded_log.exists():
        tables |= {name for record in json.loads(layout.superseded_log.read_text()) for name, _ in record["stages"]}
    if layout.forked_from_path.exists():
        tables.add(json.loads(layout.forked_from_path.read_text())["stage"])
    return tables


def run_graph_stages(layout, stage: str) -> list[str]:
    """A run-scope stage and every stage of the run's graph that reads it, transitively, in data order: what its rerun
    recomputes."""
    later = set(_stages().downstream_tables(stage))
    return [s.name for s in run_graph(layout) if s.name in later]


def stale_stages(layout, stage: str, iteration: int) -> list[tuple[str, int]]:
    """(stage, iteration) pairs that recomputing `stage` at `iteration` makes stale: of a run-scope stage, the tables of
    its graph after it, at whatever iteration they hold, and what read a stale checkpoint (the eval of its
    iteration)."""
    later = downstream_of(layout, stage)
    if _run_scope(stage):
        read_weights = set(stale_checkpoints(layout, stage, iteration))
        return [(n, k) for n in layout.stages() for k in layout.iterations(n) if n in later or k in read_weights]
    return [
        (name, k)
        for name in layout.stages()
        for k in layout.iterations(name)
        if k > iteration or (k == iteration and name in later)
    ]


def stale_checkpoints(layout, stage: str, iteration: int) -> list[int]:
    """Checkpoints written by a stale optimize: from `iteration` on when optimize itself is stale; of a run-scope
    stage, the trained model's when a stage that writes it (dpo_metrics, rm_metrics, prm_metrics) is stale."""
    if _run_scope(stage):
        return layout.checkpoint_iterations() if _writes(downstream_of(layout, stage), "checkpoints") else []
    first = iteration if "train_metrics" in downstream_of(layout, stage) else iteration + 1
    return [k for k in layout.checkpoint_iterations() if k >= first]


def _writes(tables: set[str], folder: str) -> bool:
    """Whether a stage that writes one of `tables` also writes `folder`: the iteration checkpoints (`checkpoints`), the
    SFT's (`checkpoints/sft`)."""
    graph = _stages()
    return any(folder in graph.stage(t).also_writes for t in tables & {s.name for s in graph.STAGES})


def affected(layout, stage: str, iteration: int) -> list[Path]:
    """Every path that recomputing `stage` at `iteration` makes stale, in the run folder."""
    out = [layout.stage_dir(name, k) for name, k in stale_stages(layout, stage, iteration)]
    out += [layout.checkpoint_dir(k) for k in stale_checkpoints(layout, stage, iteration)]
    if _writes(downstream_of(layout, stage), "checkpoints/sft") and layout.sft_checkpoint_dir.exists():
        out.append(layout.sft_checkpoint_dir)
    return out + ([layout.summary_path] if layout.summary_path.exists() else [])


def supersede(layout, stage: str, iteration: int, overrides: list[str]) -> dict:
    """Move what recomputing `stage` at `iteration` makes stale under `_superseded/{n}/` and log the move."""
    return move_aside(
        layout,
        stale_stages(layout, stage, iteration),
        affected(layout, stage, iteration),
        {"iteration": iteration, "stage": stage, "overrides": overrides},
    )


def changed_by(layout, cfg) -> list[tuple[str, int]]:
    """The complete (stage, iteration) whose fingerprinted config sections differ under `cfg` (what running the run
    with `cfg` would recompute, and overwrite)."""

    graph, out = _stages(), []
    for name in layout.stages():
        try:
            spec = graph.stage(name)
        except KeyError:
            continue
        new_hash = cfg.section_hash(*spec.sections, keys=spec.keys)
        for k in layout.iterations(name):
            manifest = read_manifest(layout, name, k, verify=False)
            if manifest and not manifest["config_hash"].startswith(new_hash):
                out.append((name, k))
    return out


def supersede_changed(layout, changed: list[tuple[str, int]], note: dict) -> dict:
    """Move aside the changed stages and everything that read them from their earliest iteration on (later
    iterations, checkpoints, the summary), as rerun does."""
    first = min(k for _, k in changed)
    readers = _stages().with_readers({name for name, _ in changed})
    stale = [
        (n, k)
        for n in layout.stages()
        for k in layout.iterations(n)
        if (n, k) in changed or (n in readers and k >= first)
    ]
    paths = [layout.stage_dir(n, k) for n, k in stale]
    if _writes(readers, "checkpoints"):
        paths += [layout.checkpoint_dir(k) for k in layout.checkpoint_iterations() if k >= first]
    if _writes(readers, "checkpoints/sft") and layout.sft_checkpoint_dir.exists():
        paths.append(layout.sft_checkpoint_dir)
    paths += [layout.summary_path] if layout.summary_path.exists() else []
    return move_aside(layout, stale, paths, note)


def fork(src_layout, dst_layout, stage: str, iteration: int) -> int:
    """Share (hard-link) everything of src that recomputing `stage` at `iteration` leaves valid."""
    stale = set(stale_stages(src_layout, stage, iteration))
    stale_ckpts = set(stale_checkpoints(src_layout, stage, iteration))
    linked = 0
    for name in src_layout.stages():
        for k in src_layout.iterations(name):
            if (name, k) not in stale:
                linked += link_tree(src_layout.stage_dir(name, k), dst_layout.stage_dir(name, k))
    for k in src_layout.checkpoint_iterations():
        if k not in stale_ckpts:
            linked += link_tree(src_layout.checkpoint_dir(k), dst_layout.checkpoint_dir(k))
    return linked


def recompute(root: str, run_id: str, stages: list[str], iteration: int) -> None:
    """Run each stage's task body, in order, on its cached inputs, handed as the flow hands them
    (tasks/stages/graph.py), their fingerprints read from their manifests (a stage's from the one before it has
    just written): a per-round stage recomputes every round its input has; a stage that gathers the rounds gets them
    all. Engines they started are released after the last (a rerun is one command)."""
    from tasks.engines.resident import close_all

    try:
        for stage in stages:
            _recompute_one(root, run_id, stage, iteration)
    finally:
        close_all()


def _recompute_one(root: str, run_id: str, stage: str, iteration: int) -> None:
    from tasks.stages.common import upstream_fingerprint, upstream_part_fingerprints

    graph = _stages()
    spec = graph.stage(stage)
    every_round = {s.name for s in graph.RL_ITERATION if s.scope == "round"}
    in_iteration = [t for t in spec.reads if t in {s.name for s in graph.RL_ITERATION}]  # the rest: the graph's
    fingerprints = {
        t: upstream_part_fingerprints(root, run_id, t, iteration)
        if t in every_round
        else [upstream_fingerprint(root, run_id, t, iteration)]
        for t in in_iteration
    }
    rounds = max((len(fingerprints[t]) for t in in_iteration if t in every_round), default=1)
    per_round = range(rounds) if spec.scope == "round" else [rounds - 1]
    for r in per_round:
        spec.task.fn(**graph.task_arguments(spec, root, run_id, iteration, r, fingerprints, every_round))


def check_sampler_logprobs(cfg, layout, iteration: int, regenerated: bool) -> None:
    """Refuse a rerun that would read cached sampler logprobs taken at another temperature than the new config's, as
    π_old or for a rollout correction: the rollouts of `iteration` when the rerun keeps them, and with partial
    rollouts the carried prefixes' iterations, up to RunConfig.carried_reach before. (A run or resume regenerates
    rollouts whose config changed; only a rerun reuses them.) Rollouts recorded before the temperature was are taken
    as they are."""
    if not cfg.loss.uses_sampler_logprobs:
        return
    want = cfg.sampler_logprobs_temperature
    for k in range(max(1, iteration - cfg.carried_reach), iteration + (0 if regenerated else 1)):
        manifest = read_manifest(layout, "rollouts", k, verify=False) or {}
        got = manifest.get("extra", {}).get("sampler_logprobs_temperature", want)
        if got != want:
            raise ConfigError(
                f"the rollouts of iteration {k} hold sampler logprobs at temperature {got}, this config's are at "
                f"{want} (rollout.temperature changed): rerun from --stage rollouts, or use loss.old_logprobs "
                "trainer without a rollout correction"
            )


def check_as_run(cfg, layout, stages: list[str], flow: str = "rl") -> None:
    """The checks `run` makes at its start (tasks/stages/preflight.py), of the rerun's config, before anything is moved
    or forked, so that a setting `run` refuses is refused here with the same line: all of them when a stage rerun
    reads the model (it starts an engine or loads the tokenizer: rollouts, scores, logprobs, optimize); the reward's
    alone for the advantages, which read its weights; none for the batch, which reads neither. A run-scope flow's
    stages (`flow` dpo or rm): the model's checks of that flow's start."""
    from tasks.stages.preflight import check_model, check_reward, check_saved_rl_run, dataset_columns

    sections = {section for name in stages for section in _stages().stage(name).sections}
    if flow != "rl":
        if "model" in sections and flow != "sft":  # the SFT trains model.base_path, which its start checks
            check_model(cfg, flow=flow)
    elif "model" in sections:
        check_saved_rl_run(cfg, layout)
    elif "reward" in sections:
        check_reward(cfg, dataset_columns(layout))


def _rerunnable() -> list[str]:
    graph = _stages()
    run_scope = [s.name for s in graph.SFT + graph.PREFERENCE_STAGES]
    return [name for s in graph.rerunnable() for name in (s.name, *s.aliases)] + run_scope


def check_choice(stage: str, through: str | None) -> None:
    for name, flag in ((stage, "--stage"), (through, "--through")):
        if name is not None and name not in _rerunnable():
            raise ConfigError(f"cannot rerun stage {name!r} ({flag}): choose one of {', '.join(_rerunnable())}")


def run_flow(layout) -> str:
    """The flow that wrote the run, the one `resume` runs: rl, or the run-scope graph's (sft, dpo, rm: the reward-model
    flow trains the PRM too)."""
    name = _stages().run_graph_of(tables_of(layout))
    return {None: "rl", "prm": "rm"}.get(name, name)


def graph_stages(layout, stage: str, iteration: int, through: str | None) -> list[str]:
    """What rerunning a stage of a run-scope flow's graph recomputes: it and the run's graph after it."""
    if through is not None:
        raise ConfigError(f"--through spans an RL iteration's stages: a rerun of {stage} recomputes its graph after it")
    if iteration != 0:
        raise ConfigError(f"stage {stage} is computed once per run: rerun it with --iteration 0")
    if stage not in {s.name for s in run_graph(layout)}:
        raise NotFound(f"run {layout.run_id!r} is not a run of the flow that computes {stage} ({run_flow(layout)})")
    return run_graph_stages(layout, stage)


def stages_through(stage: str, through: str | None) -> list[str]:
    """The rerunnable stages from `stage` to `through` (both included) in the flow's order; `stage` alone without
    `through`."""
    check_choice(stage, through)
    names = [s.name for s in _stages().rerunnable()]
    if through is not None and _stage_table(through) not in names:
        raise ConfigError(f"--through spans an RL iteration's stages: choose one of {', '.join(names)}")
    first, last = names.index(_stage_table(stage)), names.index(_stage_table(through or stage))
    if last < first:
        raise ConfigError(f"--through {through} comes before --stage {stage}: the order is {', '.join(names)}")
    return names[first : last + 1]


def rerun(
    run_id: str,
    iteration: int,
    stage: str,
    overrides: list[str],
    fork_id: str | None,
    root: str,
    through: str | None = None,
) -> dict:
    src = RunLayout(Path(root), run_id)
    check_choice(stage, through)
    if not src.config_path.exists():
        raise NotFound(f"run {run_id!r} not found under {root}")
    if _run_scope(stage):
        stages = graph_stages(src, stage, iteration, through)
    else:
        stages = stages_through(stage, through)
        if (
            read_manifest(src, _stage_table(stage), iteration, verify=False) is None
            and read_manifest(src, "batch", iteration, verify=False) is None
        ):
            raise NotFound(f"run {run_id!r} has no iteration {iteration} to rerun")
    cfg = build_config(yaml.safe_load(src.config_path.read_text()), overrides)
    check_as_run(cfg, src, stages, run_flow(src))
    check_sampler_logprobs(cfg, src, iteration, regenerated="rollouts" in stages)
    if fork_id is None:
        acquire_run_lock(src, "rerun")
        record = supersede(src, stage, iteration, overrides)
        write_bytes_atomic(src.config_path, dump_config(cfg).encode())
        target, extra = src, {"superseded": len(record["moved"]), "kept_in": record["kept_in"]}
    else:
        target = RunLayout(Path(root), fork_id)
        if target.run_dir.exists():
            raise AlreadyExists(f"fork target {fork_id!r} already exists under {root}")
        acquire_run_lock(target, "rerun")
        linked = fork(src, target, stage, iteration)
        write_bytes_atomic(target.config_path, dump_config(cfg).encode())
        write_json_atomic(
            target.forked_from_path,
            {"run": run_id, "iteration": iteration, "stage": stage, "overrides": overrides, "linked_files": linked},
        )
        extra = {"linked_files": linked}
    started = time.time()
    recompute(root, target.run_id, stages, iteration)
    return {
        "run": target.run_id,
        "stage": ",".join(stages),
        "iteration": iteration,
        "seconds": round(time.time() - started, 3),
        **extra,
    }
