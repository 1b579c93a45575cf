"""The DPO flow: preference data → pairs → eval of the starting model → reference logprobs → optimize (DPO,
DeepSpeed) → held-out reward accuracy → eval of the trained policy, then summary.json with
`dpo_reward_accuracy`, `eval_accuracy_start` and `eval_accuracy_final`. The stages are its graph
(tasks/stages/graph.py `DPO`); the evals and the summary are not stages of it. Complete stages are skipped."""

from __future__ import annotations

from prefect import flow

from tasks.stages.evaluate import eval_task
from tasks.stages.graph import DPO, run_stages, split
from tasks.stages.rollouts import release_engines_task
from tasks.stages.summary import summary_task


@flow(name="dpo", flow_run_name="{run_id}")
def dpo_flow(run_id: str, storage_root: str = "runs") -> dict:
    data, training = split(DPO, after="preference_rankings")
    try:
        run_stages(data, storage_root, run_id)
        eval_task(storage_root, run_id, 0)
    finally:
        release_engines_task()  # free the engine's memory for training; eval after it starts a fresh one
    out = run_stages(training, storage_root, run_id)
    try:
        eval_task(storage_root, run_id, 1, weights_stage="dpo_metrics")
    finally:
        release_engines_task()
    evaluated = out["dpo_eval"].extra
    return summary_task(
        storage_root,
        run_id,
        extra={
            "kind": "dpo",
            "dpo_reward_accuracy": evaluated["reward_accuracy"],
            "dpo_reward_margin": evaluated["reward_margin"],
            "dpo_heldout_pairs": evaluated["pairs"],
            "dpo_model_path": out["dpo_metrics"].extra["exported_to"],
        },
    )
