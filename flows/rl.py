"""The RL flow: one `rl-iteration` flow run per iteration, one task per stage (docs/architecture.md: the stage
contract).

Flows only order stages and pass fingerprints; every stage reads and writes through storage, so a restart
of the same run skips what is complete and recomputes the rest.
"""

from __future__ import annotations

from prefect import flow

from tasks.stages.advantages import advantages_task
from tasks.stages.artifacts import artifacts_task
from tasks.stages.batch import batch_task
from tasks.stages.common import plan_task
from tasks.stages.dataset import dataset_task
from tasks.stages.evaluate import eval_task
from tasks.stages.logprobs import logprobs_task
from tasks.stages.optimize import optimize_task
from tasks.stages.prompts import prompts_task
from tasks.stages.rollouts import release_engines_task, rollouts_task
from tasks.stages.scores import scores_task
from tasks.stages.sft import sft_data_task
from tasks.stages.start_engines import start_engines
from tasks.stages.summary import summary_task
from tasks.stages.tracking import track_task


@flow(name="rl-iteration", flow_run_name="{run_id}-iter-{iteration}")
def rl_iteration(run_id: str, iteration: int, storage_root: str = "runs") -> dict:
    # Dynamic sampling: rounds of prompts → rollouts → scores until the batch task says the batch is full
    # (it alone knows target_groups and max_rounds, and it returns None while another round is needed).
    scores_fps: list[str] = []
    round_ = 0
    while True:
        prompts = prompts_task(storage_root, run_id, iteration, round_)
        rollouts = rollouts_task(storage_root, run_id, iteration, round_, prompts.fingerprint)
        scores = scores_task(storage_root, run_id, iteration, round_, rollouts.fingerprint)
        scores_fps.append(scores.fingerprint)
        batch = batch_task(storage_root, run_id, iteration, round_, scores_fps)
        if batch is not None:
            break
        round_ += 1
    logprobs = logprobs_task(storage_root, run_id, iteration, batch.fingerprint)
    advantages = advantages_task(storage_root, run_id, iteration, logprobs.fingerprint, batch.fingerprint)
    metrics = optimize_task(storage_root, run_id, iteration, advantages.fingerprint, logprobs.fingerprint)
    artifacts_task(storage_root, run_id, iteration)
    return {"iteration": iteration, "rounds": round_ + 1, "checkpoint": metrics.extra.get("checkpoint")}


@flow(name="rl", flow_run_name="{run_id}")
def rl_run(run_id: str, storage_root: str = "runs") -> dict:
    """Eval the starting model, run every iteration (eval every N and at the end), write summary.json."""
    start_engines(
        storage_root, run_id
    )  # the engines load while the first stages run (a no-op if the command started them)
    plan = plan_task(storage_root, run_id)
    n, every = plan["iterations"], plan["eval_every"]
    dataset_task(storage_root, run_id)
    if plan["ptx"]:  # PPO-ptx: the sft section's demonstrations, formatted with the policy's tokenizer
        sft_data_task(storage_root, run_id, plan["model_path"])
    try:
        eval_task(storage_root, run_id, 0)
        for k in range(1, n + 1):
            rl_iteration(run_id, k, storage_root)
            if k % every == 0 or k == n:
                eval_task(storage_root, run_id, k, interim=k != n)  # the last eval sees every held-out prompt
            if plan["tracking"]:
                track_task(storage_root, run_id)  # iteration k's figures, with its eval
    finally:
        release_engines_task()
    summary = summary_task(storage_root, run_id)
    if plan["tracking"]:
        track_task(storage_root, run_id, summary)
    return summary
