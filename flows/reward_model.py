"""The reward-model flow: preference data → pairs → optimize (Bradley–Terry, DeepSpeed) → held-out eval,
then summary.json with `rm_pairwise_accuracy`. Every stage is skipped when complete, so a rerun resumes."""

from __future__ import annotations

from prefect import flow

from tasks.stages.preference_data import preference_pairs_task, preference_rankings_task
from tasks.stages.reward_model import rm_eval_task, rm_optimize_task
from tasks.stages.rollouts import release_engines_task
from tasks.stages.summary import summary_task


@flow(name="reward-model", flow_run_name="{run_id}")
def reward_model_flow(run_id: str, storage_root: str = "runs") -> dict:
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
