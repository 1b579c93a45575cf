"""The reward-model flow: preference data → pairs → optimize (Bradley–Terry, DeepSpeed) → held-out eval,
then summary.json with `rm_pairwise_accuracy`. Under reward_model.objective process: step-labelled samples → optimize
(a process reward model) → held-out eval, with the PRM's step accuracy and AUC. Every stage is skipped when complete,
so a rerun resumes."""

from __future__ import annotations

from prefect import flow

from tasks.stages.preference_data import preference_pairs_task, preference_rankings_task
from tasks.stages.process_model import prm_eval_task, prm_optimize_task, prm_steps_task, rm_objective_task
from tasks.stages.reward_model import rm_eval_task, rm_optimize_task
from tasks.stages.rollouts import release_engines_task
from tasks.stages.summary import summary_task


@flow(name="reward-model", flow_run_name="{run_id}")
def reward_model_flow(run_id: str, storage_root: str = "runs") -> dict:
    if rm_objective_task(storage_root, run_id) == "process":
        return process_model_flow(run_id, storage_root)
    try:
        rankings = preference_rankings_task(storage_root, run_id)
    finally:
        release_engines_task()  # generation is over: free the engine's memory for training
    pairs = preference_pairs_task(storage_root, run_id, rankings.fingerprint)
    trained = rm_optimize_task(storage_root, run_id, rankings.fingerprint)
    evaluated = rm_eval_task(storage_root, run_id, pairs.fingerprint, trained.fingerprint)
    return summary_task(
        storage_root,
        run_id,
        extra={
            "kind": "reward_model",
            "rm_pairwise_accuracy": evaluated.extra["pairwise_accuracy"],
            "rm_heldout_pairs": evaluated.extra["pairs"],
            "reward_model_path": trained.extra["exported_to"],
        },
    )


def process_model_flow(run_id: str, storage_root: str) -> dict:
    try:
        steps = prm_steps_task(storage_root, run_id)
    finally:
        release_engines_task()  # generation is over: free the engine's memory for training
    trained = prm_optimize_task(storage_root, run_id, steps.fingerprint)
    evaluated = prm_eval_task(storage_root, run_id, steps.fingerprint, trained.fingerprint)
    return summary_task(
        storage_root,
        run_id,
        extra={
            "kind": "process_reward_model",
            **{f"prm_{k}": v for k, v in evaluated.extra.items()},
            "reward_model_path": trained.extra["exported_to"],
        },
    )
