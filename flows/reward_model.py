"""The reward-model flow: preference data → pairs → optimize (Bradley–Terry, DeepSpeed) → held-out eval,
then summary.json with `rm_pairwise_accuracy`. Under reward_model.objective process: step-labelled samples → optimize
(a process reward model) → held-out eval, with the PRM's step accuracy and AUC. The stages are its graphs
(tasks/stages/graph.py `REWARD_MODEL`, `PROCESS_REWARD_MODEL`); every stage is skipped when complete, so a rerun
resumes."""

from __future__ import annotations

from prefect import flow

from tasks.stages.graph import PROCESS_REWARD_MODEL, REWARD_MODEL, run_stages, split
from tasks.stages.process_model import rm_objective_task
from tasks.stages.rollouts import release_engines_task
from tasks.stages.summary import summary_task


def trained(stages: tuple, sampled_by: str, storage_root: str, run_id: str) -> dict:
    """Run a reward model's graph: the stages up to `sampled_by`, the engine freed, then the training and its eval."""
    data, training = split(stages, after=sampled_by)
    try:
        run_stages(data, storage_root, run_id)
    finally:
        release_engines_task()  # generation is over: free the engine's memory for training
    return run_stages(training, storage_root, run_id)


@flow(name="reward-model", flow_run_name="{run_id}")
def reward_model_flow(run_id: str, storage_root: str = "runs") -> dict:
    if rm_objective_task(storage_root, run_id) == "process":
        return process_model_flow(run_id, storage_root)
    out = trained(REWARD_MODEL, "preference_rankings", storage_root, run_id)
    evaluated = out["rm_eval"].extra
    return summary_task(
        storage_root,
        run_id,
        extra={
            "kind": "reward_model",
            "rm_pairwise_accuracy": evaluated["pairwise_accuracy"],
            "rm_heldout_pairs": evaluated["pairs"],
            "reward_model_path": out["rm_metrics"].extra["exported_to"],
        },
    )


def process_model_flow(run_id: str, storage_root: str) -> dict:
    out = trained(PROCESS_REWARD_MODEL, "prm_steps", storage_root, run_id)
    return summary_task(
        storage_root,
        run_id,
        extra={
            "kind": "process_reward_model",
            **{f"prm_{k}": v for k, v in out["prm_eval"].extra.items()},
            "reward_model_path": out["prm_metrics"].extra["exported_to"],
        },
    )
