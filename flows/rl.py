"""The RL flow: one `rl-iteration` flow run per iteration, one task per stage (docs/architecture.md: the stage
contract).

Flows only order stages; the graph's runner (tasks/stages/graph.py `run_stages`) passes the fingerprints. Every stage
reads and writes through storage, so a restart of the same run skips what is complete and recomputes the rest.
"""

from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from tasks.stages.artifacts import artifacts_task
from tasks.stages.common import RunPlan, plan_task
from tasks.stages.dataset import dataset_task
from tasks.stages.evaluate import eval_task
from tasks.stages.graph import GENERATION_TASKS, ITERATION_TASKS, run_stages
from tasks.stages.rollouts import release_engines_task, sample_ahead_task
from tasks.stages.sft import sft_data_task
from tasks.stages.start_engines import start_engines
from tasks.stages.summary import summary_task
from tasks.stages.tracking import track_task
from tasks.stages.tripwires import TripwireStop, tripwires_task


@flow(name="rl-iteration", flow_run_name="{run_id}-iter-{iteration}")
def rl_iteration(run_id: str, iteration: int, storage_root: str = "runs") -> dict:
    outputs = run_stages(ITERATION_TASKS, storage_root, run_id, iteration)
    artifacts_task(storage_root, run_id, iteration)
    checkpoint = outputs["train_metrics"].extra.get("checkpoint")
    return {"iteration": iteration, "rounds": outputs["rounds"], "checkpoint": checkpoint}


@task(name="generation-ahead", cache_policy=NO_CACHE)
def generation_ahead(storage_root: str, run_id: str, iteration: int) -> int:
    """An iteration's generation (its rounds' prompts, rollouts and scores, and the batch: each its own task run), one
    step off-policy, beside the iteration before it; that iteration's flow run then finds these stages complete. A
    task submitted to the flow's task runner: a second flow run in a thread of its own waited for the iteration's."""
    return run_stages(GENERATION_TASKS, storage_root, run_id, iteration)["rounds"]


def iterations(run_id: str, storage_root: str, plan: RunPlan):
    """Run every iteration, each with its eval when one is due (every N and the last), yielding k after iteration k. One
    step off-policy (rl.max_staleness 1), iteration k + 1's generation runs while iteration k trains, once the sampler
    holds the weights it samples with (sample_ahead_task)."""
    n, every = plan.iterations, plan.eval_every
    for k in range(1, n + 1):
        ahead = plan.ahead and k < n and sample_ahead_task(storage_root, run_id, k + 1)
        running = generation_ahead.submit(storage_root, run_id, k + 1) if ahead else None
        rl_iteration(run_id, k, storage_root)
        if running is not None:
            running.result()  # before the eval syncs the sampler to update k
        if k % every == 0 or k == n:
            eval_task(storage_root, run_id, k, interim=k != n)  # the last eval sees every held-out prompt
        yield k


@flow(name="rl", flow_run_name="{run_id}")
def rl_run(run_id: str, storage_root: str = "runs") -> dict:
    """Eval the starting model, run every iteration (eval every N and at the end; a tripwire set to `stop` ends the run
    after the iteration it fires on), write summary.json."""
    start_engines(
        storage_root, run_id
    )  # the engines load while the first stages run (a no-op if the command started them)
    plan = plan_task(storage_root, run_id)
    dataset_task(storage_root, run_id)
    if plan.ptx:  # PPO-ptx: the sft section's demonstrations, formatted with the policy's tokenizer
        sft_data_task(storage_root, run_id, plan.model_path)
    try:
        eval_task(storage_root, run_id, 0)
        for k in iterations(run_id, storage_root, plan):
            stop = tripwires_task(storage_root, run_id, k)  # iteration k's tripwires: logged, and the line of a `stop`
            if plan.tracking:
                track_task(storage_root, run_id)  # iteration k's figures, with its eval and tripwires
            if stop:
                raise TripwireStop(stop)  # after iteration k's tables, eval and tracking are written
    finally:
        release_engines_task()
    summary = summary_task(storage_root, run_id)
    if plan.tracking:
        track_task(storage_root, run_id, summary)
    return summary
