"""Experiment tracking's pure parts. End to end, a tracked run killed inside an update and resumed (replaying the update
before it) is read back with TensorBoard's event reader and MLflow's client: test_e2e.py,
test_sparse_checkpoints_and_one_step_off_policy_resume_to_the_same_bytes."""

from tasks.stages.tracking import flat_params, scalars


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
