"""One step off-policy against on-policy on the real model (`make bench ARGS=async`): the demo config (SmolLM2-135M-
Instruct, GRPO 16 prompts × 8 samples, 10 iterations, the final eval on the 256 held-out prompts) twice, one after the
other in this process: `rl.max_staleness` 0, then 1 (iteration k samples with the weights after update k − 2, and its
generation runs while update k − 1 trains). Both with token-level truncated importance sampling (`--algo
grpo,token_is`), the correction the stale side needs, so that the two differ in the staleness alone.

Rows:
- async_iteration_seconds: wall seconds an iteration, iterations 2..N (the first pays the engines' start), staleness 1
  over 0 (smaller is better);
- async_heldout_accuracy: greedy accuracy on the held-out prompts after the N iterations, staleness 1 and 0.

Printed beside them: each side's stage seconds (the generation's and the training's, from train_metrics), from which
what the overlap can gain is read: on 2 shared cores the two halves compete for the same cores, on a machine with the
rollout and trainer on separate GPUs an iteration would take about max(generation, training) instead of their sum.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tests.benchmarks import result_row

CONFIG = "infra/configs/demo.yaml"
ROOT = Path("runs/bench/async")
ITERATIONS = 10
GENERATION = ["seconds_prompts", "seconds_rollouts", "seconds_scores", "seconds_batch"]
TRAINING = ["seconds_logprobs", "seconds_advantages", "seconds_optimize"]


def run_loop(run_id: str, overrides: list[str]):
    """(layout, ends): a fresh run iterated as `rlpipe run` iterates it (flows.rl.iterations: the generation one step
    ahead when the config says so, the final eval), time.time() at the end of each iteration."""
    import shutil
    import time

    from flows.deployments import prepare_checked_run
    from flows.local_prefect import local_flow_settings
    from flows.rl import iterations
    from schemas.config import load_config
    from storage import RunLayout
    from tasks.engines.resident import close_all
    from tasks.stages.common import plan_task
    from tasks.stages.dataset import dataset_task

    algo = "grpo,token_is"
    shutil.rmtree(Path(load_config(CONFIG, overrides, algo).storage_root) / run_id, ignore_errors=True)
    ends = []
    try:
        root = prepare_checked_run(CONFIG, [*overrides, f"rl.iterations={ITERATIONS}"], run_id, algo)
        with local_flow_settings():
            dataset_task(root, run_id)
            for _ in iterations(run_id, root, plan_task(root, run_id)):
                ends.append(time.time())
    finally:
        close_all()
    return RunLayout(Path(root), run_id), ends


def measure(staleness: int) -> dict:
    run_id = f"staleness-{staleness}"
    layout, ends = run_loop(run_id, [f"storage_root={ROOT}", f"rl.max_staleness={staleness}", "rl.eval_every=1000"])
    m = pl.concat(
        [pl.read_parquet(layout.stage_dir("train_metrics", k) / "*.parquet") for k in range(2, ITERATIONS + 1)],
        how="diagonal",
    )
    walls = [b - a for a, b in zip(ends, ends[1:])]
    eval_final = pl.read_parquet(layout.stage_dir("eval", ITERATIONS) / "*.parquet")
    out = {
        "iteration": sum(walls) / len(walls),
        "generation": float(m.select(sum(pl.col(c) for c in GENERATION)).mean().item()),
        "training": float(m.select(sum(pl.col(c) for c in TRAINING if c in m.columns)).mean().item()),
        "accuracy": float(eval_final["greedy_correct"].mean()),
    }
    print(
        f"async staleness {staleness}: {out['iteration']:.1f} s an iteration (generation stages "
        f"{out['generation']:.1f} s, training stages {out['training']:.1f} s, each as its own wall time); held-out "
        f"greedy accuracy {out['accuracy']:.3f}"
    )
    return out


def run() -> list[dict]:
    on, off = measure(0), measure(1)
    ideal = max(off["generation"], off["training"])
    print(
        f"async: on separate devices an iteration would take about max(generation, training) = {ideal:.1f} s against "
        f"{on['iteration']:.1f} s on-policy; here the overlap ran on the same 2 cores: {off['iteration']:.1f} s"
    )
    return [
        result_row(
            "async_iteration_seconds", "rl.max_staleness=0", on["iteration"], off["iteration"], "seconds an iteration"
        ),
        result_row(
            "async_heldout_accuracy", "rl.max_staleness=0", on["accuracy"], off["accuracy"], "held-out greedy accuracy"
        ),
    ]
