"""The DPO flow: preference data → pairs → eval of the starting model → reference logprobs → optimize (DPO,
DeepSpeed) → held-out reward accuracy → eval of the trained policy, then summary.json with
`dpo_reward_accuracy`, `eval_accuracy_start` and `eval_accuracy_final`. Complete stages are skipped."""

from __future__ import annotations

from prefect import flow

from tasks.stages.dpo import dpo_eval_task, dpo_optimize_task, ref_logprobs_task
from tasks.stages.evaluate import eval_task
from tasks.stages.preference_data import preference_pairs_task, preference_rankings_task
from tasks.stages.rollouts import release_engines_task
from tasks.stages.summary import summary_task


@flow(name="dpo", flow_run_name="{run_id}")
def dpo_flow(run_id: str, storage_root: str = "runs") -> dict:
    try:
        rankings = preference_rankings_task(storage_root, run_id)
        eval_task(storage_root, run_id, 0)
    finally:
        release_engines_task()  # free the engine's memory for training; eval after it starts a fresh one
    pairs = preference_pairs_task(storage_root, run_id, rankings.fingerprint)
    ref = ref_logprobs_task(storage_root, run_id, pairs.fingerprint)
    trained = dpo_optimize_task(storage_root, run_id, pairs.fingerprint, ref.fingerprint)
    evaluated = dpo_eval_task(storage_root, run_id, pairs.fingerprint, ref.fingerprint, trained.fingerprint)
    try:
        eval_task(storage_root, run_id, 1, weights_stage="dpo_metrics")
    finally:
        release_engines_task()
    return summary_task(
        storage_root,
        run_id,
        extra={
            "kind": "dpo",
            "dpo_reward_accuracy": evaluated.extra["reward_accuracy"],
            "dpo_reward_margin": evaluated.extra["reward_margin"],
            "dpo_heldout_pairs": evaluated.extra["pairs"],
            "dpo_model_path": trained.extra["exported_to"],
        },
    )
