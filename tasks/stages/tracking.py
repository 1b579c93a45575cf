"""Experiment tracking (opt-in, `tracking: [tensorboard, mlflow]`): the figures of each complete RL iteration, copied to
the tools users watch curves in. The Parquet tables stay the record; nothing here is read back by a stage.

- TensorBoard: scalars `train/<train_metrics column>`, `tripwire/<figure>` and `eval/<figure>` at step = the
  iteration, in event files under runs/RUN/tensorboard (torch's SummaryWriter).
- MLflow: one MLflow run per rlpipe run (named after it), its params the resolved config (flattened keys), its metrics
  the same scalars at step = the iteration, the summary logged as `summary.json` and the run ended with it. The store is
  `tracking_uri`, else $MLFLOW_TRACKING_URI, else SQLite in the run folder (runs/RUN/mlflow.db, artifacts beside it).

Resumable: `tracking.json` in the run folder holds the MLflow run's id and what is logged. A resumed run continues the
same MLflow run and logs only the iterations not yet logged; TensorBoard's `purge_step` hides anything a crash left
between writing a step and recording it.
Imports: MLflow (1.2 s) and TensorBoard are imported only when a run tracks with them.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from storage import RunLayout, read_manifest, read_stage
from storage.stage_io import write_bytes_atomic
from tasks.stages.common import load_run, stage_task


def scalars(row: dict) -> dict[str, float]:
    """The finite numbers of a row (a train_metrics row, an eval manifest's figures): what a scalar chart can plot."""
    out = {}
    for key, value in row.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def pending_steps(layout: RunLayout, logged: dict) -> list[tuple[int, dict[str, float]]]:
    """(iteration, {tag: value}) for every complete train_metrics row and eval not logged yet, in iteration order."""
    steps: dict[int, dict[str, float]] = {}
    for it in layout.iterations("train_metrics"):
        if it > logged.get("train", 0) and read_manifest(layout, "train_metrics", it, verify=False) is not None:
            row = read_stage(layout, "train_metrics", it).row(0, named=True)
            steps.setdefault(it, {}).update({f"train/{k}": v for k, v in scalars(row).items() if k != "iteration"})
    tripwires = json.loads(layout.tripwires_path.read_text()) if layout.tripwires_path.exists() else {}
    for it, step in steps.items():  # the tripwires' figures (tasks/stages/tripwires.py) beside the iteration's metrics
        figures = tripwires.get(str(it), {}).get("figures", {})
        step.update({f"tripwire/{k}": v for k, v in scalars(figures).items()})
    for it in (k for k in layout.iterations("eval") if k not in logged.get("eval", [])):
        manifest = read_manifest(layout, "eval", it, verify=False)
        if manifest is not None:
            steps.setdefault(it, {}).update({f"eval/{k}": v for k, v in scalars(manifest.get("extra", {})).items()})
    return sorted(steps.items())


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """The config as MLflow params: `section.key` → its value as text (lists and nulls as JSON)."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_params(value, name + "."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def default_store(layout: RunLayout) -> str:
    """The run's own MLflow store: SQLite in the run folder (MLflow refuses new folder stores)."""
    return f"sqlite:///{layout.mlflow_db_path.resolve()}"


def _tracking_uri(layout: RunLayout, configured: str | None) -> str:
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default_store(layout)


def _log_tensorboard(layout: RunLayout, steps: list[tuple[int, dict[str, float]]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(layout.tensorboard_dir), purge_step=steps[0][0])
    for step, values in steps:
        for tag, value in values.items():
            writer.add_scalar(tag, value, global_step=step)
    writer.close()


def _mlflow_run(client, state: dict, layout: RunLayout, config: dict) -> str:
    """The MLflow run of this rlpipe run: the recorded one, or a new one with the config as its params."""
    from mlflow.entities import Param

    if state.get("mlflow_run_id"):
        return state["mlflow_run_id"]
    experiment = client.get_experiment_by_name("rlpipe")
    # In the run's own store, artifacts (summary.json) go to the run folder too, not to the working directory.
    local = client.tracking_uri == default_store(layout)
    artifacts = layout.mlflow_artifacts_dir.resolve().as_uri() if local else None
    experiment_id = experiment.experiment_id if experiment else client.create_experiment("rlpipe", artifacts)
    run = client.create_run(
        experiment_id, run_name=layout.run_id, tags={"rlpipe.run_dir": str(layout.run_dir.resolve())}
    )
    params = [Param(k, v[:6000]) for k, v in flat_params(config).items()]
    for i in range(0, len(params), 100):  # MLflow's batch limit for params
        client.log_batch(run.info.run_id, params=params[i : i + 100])
    return run.info.run_id


def _log_mlflow(client, run_id: str, steps: list[tuple[int, dict[str, float]]]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(tag, value, now, step) for step, values in steps for tag, value in values.items()]
    for i in range(0, len(metrics), 1000):  # MLflow's batch limit for metrics
        client.log_batch(run_id, metrics=metrics[i : i + 1000])


@stage_task("track")
def track_task(storage_root: str, run_id: str, summary: dict | None = None) -> None:
    """Log what is complete and not logged yet; with `summary` (the run's end), log it and end the MLflow run."""
    ctx = load_run(storage_root, run_id)
    backends = ctx.cfg.tracking
    if not backends:
        return
    layout = ctx.layout
    path = layout.tracking_state_path
    state = json.loads(path.read_text()) if path.exists() else {"train": 0, "eval": []}
    steps = pending_steps(layout, state)
    client = None
    if "mlflow" in backends:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=_tracking_uri(layout, ctx.cfg.tracking_uri))
        state["mlflow_run_id"] = _mlflow_run(client, state, layout, ctx.cfg.model_dump(mode="json"))
        _write_state(path, state)  # the run id first: a crash below must not start a second MLflow run
    if steps:
        if "tensorboard" in backends:
            _log_tensorboard(layout, steps)
        if client is not None:
            _log_mlflow(client, state["mlflow_run_id"], steps)
        state["train"] = max([state["train"]] + [s for s, v in steps if any(k.startswith("train/") for k in v)])
        state["eval"] = sorted(set(state["eval"]) | {s for s, v in steps if any(k.startswith("eval/") for k in v)})
        _write_state(path, state)
    if summary is not None and client is not None and not state.get("ended"):
        client.log_dict(state["mlflow_run_id"], summary, "summary.json")
        client.set_terminated(state["mlflow_run_id"])
        state["ended"] = True
        _write_state(path, state)


def _write_state(path: Path, state: dict) -> None:
    write_bytes_atomic(path, json.dumps(state, indent=1).encode())
