"""Experiment tracking end to end: a 2-iteration run with `tracking: [tensorboard, mlflow]`, read back with
TensorBoard's event reader and MLflow's client; killed inside iteration 2's scores and resumed, the same MLflow run
with no step twice."""

import json
import math
from pathlib import Path

import pytest

from storage import RunLayout
from tasks.stages.tracking import flat_params, scalars
from tests.conftest import read_table, rlpipe, run_until_killed

TRACKING = ["--set", "tracking=[tensorboard, mlflow]"]


def test_scalars_and_params_are_what_a_chart_and_a_param_table_take():
    assert scalars({"a": 1, "b": 2.5, "c": float("nan"), "d": "x", "e": [1.0], "f": True, "g": None}) == {
        "a": 1.0,
        "b": 2.5,
    }
    assert flat_params({"optim": {"lr": 0.1, "zero_stage": 1}, "tracking": ["mlflow"], "task": None, "seed": 3}) == {
        "optim.lr": "0.1",
        "optim.zero_stage": "1",
        "tracking": '["mlflow"]',
        "task": "null",
        "seed": "3",
    }


def tensorboard_steps(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.e2e
def test_a_tracked_run_is_read_back_and_a_resumed_one_has_no_duplicate_steps(tiny_sft):
    from mlflow.tracking import MlflowClient

    workspace, cfg = tiny_sft
    run_until_killed(workspace, cfg, "tracked", "scores:2", "run", *TRACKING)  # after its part, before its manifest
    layout = RunLayout(workspace / "runs", "tracked")
    assert layout.part_path("scores", 2, 0).exists() and not layout.manifest_path("scores", 2).exists()
    assert (
        json.loads((layout.run_dir / "tracking.json").read_text())["train"] == 1
    )  # iteration 1 logged before the kill
    rlpipe("run", str(cfg), "--run-id", "tracked", *TRACKING, cwd=workspace)
    state = json.loads((layout.run_dir / "tracking.json").read_text())
    rows = {it: read_table(layout, "train_metrics", it).row(0, named=True) for it in (1, 2)}
    summary = json.loads(layout.summary_path.read_text())

    board = tensorboard_steps(layout.run_dir)
    assert [s for s, _ in board["train/loss"]] == [1, 2]
    assert all(math.isclose(v, rows[s]["loss"], rel_tol=1e-6) for s, v in board["train/loss"])
    assert [s for s, _ in board["eval/accuracy"]] == [0, 2]

    client = MlflowClient(tracking_uri=f"sqlite:///{(layout.run_dir / 'mlflow.db').resolve()}")
    runs = client.search_runs([client.get_experiment_by_name("rlpipe").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == state["mlflow_run_id"] and runs[0].info.run_name == "tracked"
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["rollout.group_size"] == "4"
    downloaded = client.download_artifacts(state["mlflow_run_id"], "summary.json", str(workspace))
    assert json.loads(Path(downloaded).read_text()) == summary
    for key in ("train/loss", "train/kl_ref", "train/seconds_rollouts"):
        history = client.get_metric_history(state["mlflow_run_id"], key)
        assert sorted(m.step for m in history) == [1, 2], key  # each step once: none logged twice across the resume
        column = key.split("/", 1)[1]
        assert all(math.isclose(m.value, rows[m.step][column], rel_tol=1e-6) for m in history)
    evals = client.get_metric_history(state["mlflow_run_id"], "eval/accuracy")
    assert sorted((m.step, m.value) for m in evals) == [
        (0, summary["eval_accuracy_start"]),
        (2, summary["eval_accuracy_final"]),
    ]
