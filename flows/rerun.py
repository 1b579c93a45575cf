"""Stage-level rerun, fork and resume: recompute one stage of one iteration from the cached upstream Parquet.

- `rerun RUN --iteration K --stage S [--set ...]`: the run's config takes the overrides; S at iteration K and
  everything after it (later stages of K, every stage of later iterations, their checkpoints, the summary)
  are moved aside to `RUN/_superseded/{n}/` and recorded in `RUN/superseded.json`, never deleted. Then S is
  recomputed. `rlpipe resume RUN` continues from there.
- `--fork NEW`: RUN is left untouched. NEW gets the new config and hard links to everything upstream of S
  (files are shared, not copied; writers always replace files by rename, so a link is never written through).
  Then S is recomputed in NEW.

Stages are called as plain functions (`task.fn`), without a Prefect flow run: a rerun of advantages takes
well under a second and starts no engine.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from schemas.config import ConfigError

# Data order within one iteration; eval reads the iteration's checkpoint (written with train_metrics).
ITERATION_STAGES = ("prompts", "rollouts", "scores", "batch", "logprobs", "advantages", "prompt_stats", "train_metrics", "eval")
# prompts is not here: re-drawing prompts is a new run.
RERUNNABLE = ("rollouts", "scores", "batch", "logprobs", "advantages", "optimize")


def _stage_table(stage: str) -> str:
    return "train_metrics" if stage == "optimize" else stage


def downstream_of(stage: str) -> set[str]:
    """The tables of the same iteration that `stage` and everything after it write."""
    return set(ITERATION_STAGES[ITERATION_STAGES.index(_stage_table(stage)):])  # advantages also writes prompt_stats


def affected(layout, stage: str, iteration: int) -> list[Path]:
    """Every path that recomputing `stage` at `iteration` makes stale, in the run folder."""
    out = []
    later = downstream_of(stage)
    for name in layout.stages():
        for it_dir in sorted(layout.stage_root(name).glob("iter=*")):
            k = int(it_dir.name.split("=")[1])
            if k > iteration or (k == iteration and name in later):
                out.append(it_dir)
    for ckpt in sorted((layout.run_dir / "checkpoints").glob("iter=*")):
        k = int(ckpt.name.split("=")[1].split(".")[0])
        if k > iteration or (k == iteration and "train_metrics" in later):
            out.append(ckpt)
    if layout.summary_path.exists():
        out.append(layout.summary_path)
    return out


def supersede(layout, stage: str, iteration: int, overrides: list[str]) -> dict:
    """Move the stale paths under `_superseded/{n}/` (same relative layout) and log the move."""
    base = layout.run_dir / "_superseded"
    n = len(list(base.glob("*"))) if base.exists() else 0
    target = base / f"{n:03d}"
    moved = []
    for path in affected(layout, stage, iteration):
        rel = path.relative_to(layout.run_dir)
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target / rel)
        moved.append(str(rel))
    record = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "iteration": iteration, "stage": stage,
              "overrides": overrides, "kept_in": str(target.relative_to(layout.run_dir)), "moved": moved}
    log = layout.run_dir / "superseded.json"
    history = json.loads(log.read_text()) if log.exists() else []
    from storage import write_json_atomic

    write_json_atomic(log, history + [record])
    return record


def _link_tree(src: Path, dst: Path) -> int:
    """Hard-link every file of src under dst (a file, or a folder recursively); returns the file count."""
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
        return 1
    count = 0
    for f in src.rglob("*"):
        if f.is_file():
            (dst / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            os.link(f, dst / f.relative_to(src))
            count += 1
    return count


def fork(src_layout, dst_layout, stage: str, iteration: int) -> int:
    """Share (hard-link) everything of src that recomputing `stage` at `iteration` leaves valid."""
    stale = set(affected(src_layout, stage, iteration))
    linked = 0
    for name in src_layout.stages():
        for it_dir in sorted(src_layout.stage_root(name).glob("iter=*")):
            if it_dir not in stale:
                linked += _link_tree(it_dir, dst_layout.run_dir / it_dir.relative_to(src_layout.run_dir))
    for ckpt in sorted((src_layout.run_dir / "checkpoints").glob("*")):
        if ckpt not in stale and not ckpt.name.endswith(".tmp"):
            linked += _link_tree(ckpt, dst_layout.run_dir / ckpt.relative_to(src_layout.run_dir))
    return linked


def _manifest(layout, stage: str, iteration: int) -> dict:
    from storage import read_manifest

    m = read_manifest(layout, stage, iteration)
    if m is None:
        raise FileNotFoundError(f"run {layout.run_id!r} has no complete {stage} for iteration {iteration}")
    return m


def recompute(root: str, run_id: str, stage: str, iteration: int):
    """Run one stage's task body on its cached inputs (their fingerprints come from their manifests)."""
    from storage import RunLayout
    from tasks.advantages import advantages_task
    from tasks.batch import batch_task
    from tasks.logprobs import logprobs_task
    from tasks.optimize import optimize_task
    from tasks.rollouts import release_engines_task, rollouts_task
    from tasks.scores import scores_task

    layout = RunLayout(Path(root), run_id)
    fp = lambda s: _manifest(layout, s, iteration)["fingerprint"]  # noqa: E731
    part_fps = lambda s: [p["fingerprint"] for p in _manifest(layout, s, iteration)["parts"]]  # noqa: E731
    if stage == "rollouts":
        try:
            return [rollouts_task.fn(root, run_id, iteration, r, f) for r, f in enumerate(part_fps("prompts"))]
        finally:
            release_engines_task.fn()
    if stage == "scores":
        return [scores_task.fn(root, run_id, iteration, r, f) for r, f in enumerate(part_fps("rollouts"))]
    if stage == "batch":
        fps = part_fps("scores")
        return batch_task.fn(root, run_id, iteration, len(fps) - 1, fps)
    if stage == "logprobs":
        return logprobs_task.fn(root, run_id, iteration, fp("batch"))
    if stage == "advantages":
        return advantages_task.fn(root, run_id, iteration, fp("logprobs"), fp("batch"))
    if stage == "optimize":
        return optimize_task.fn(root, run_id, iteration, fp("advantages"), fp("logprobs"))
    raise ConfigError(f"cannot rerun stage {stage!r}: choose one of {', '.join(RERUNNABLE)}")


def rerun(run_id: str, iteration: int, stage: str, overrides: list[str], fork_id: str | None, root: str) -> dict:
    import yaml

    from schemas.config import build_config, dump_config
    from storage import RunLayout, read_manifest
    from storage.stage_io import write_bytes_atomic

    if stage not in RERUNNABLE:
        raise ConfigError(f"cannot rerun stage {stage!r}: choose one of {', '.join(RERUNNABLE)}")
    src = RunLayout(Path(root), run_id)
    if not src.config_path.exists():
        raise FileNotFoundError(f"run {run_id!r} not found under {root}")
    if read_manifest(src, _stage_table(stage), iteration, verify=False) is None and read_manifest(src, "batch", iteration, verify=False) is None:
        raise FileNotFoundError(f"run {run_id!r} has no iteration {iteration} to rerun")
    cfg = build_config(yaml.safe_load(src.config_path.read_text()), overrides)
    if fork_id is None:
        record = supersede(src, stage, iteration, overrides)
        write_bytes_atomic(src.config_path, dump_config(cfg).encode())
        target, extra = src, {"superseded": len(record["moved"]), "kept_in": record["kept_in"]}
    else:
        target = RunLayout(Path(root), fork_id)
        if target.run_dir.exists():
            raise FileExistsError(f"fork target {fork_id!r} already exists under {root}")
        linked = fork(src, target, stage, iteration)
        write_bytes_atomic(target.config_path, dump_config(cfg).encode())
        (target.run_dir / "forked_from.json").write_text(json.dumps(
            {"run": run_id, "iteration": iteration, "stage": stage, "overrides": overrides, "linked_files": linked}, indent=1))
        extra = {"linked_files": linked}
    started = time.time()
    recompute(root, target.run_id, stage, iteration)
    return {"run": target.run_id, "stage": stage, "iteration": iteration, "seconds": round(time.time() - started, 3), **extra}
