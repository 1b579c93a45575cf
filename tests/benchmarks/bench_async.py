"""One step off-policy against on-policy on the real model (`make bench ARGS=async`): the demo config (SmolLM2-135M-
Instruct, GRPO 16 prompts × 8 samples, 10 iterations, the final eval on the 256 held-out prompts) twice, one after the
other in this process: `rl.max_staleness` 1, then 0 (iteration k samples with the weights after update k − 2, and its
generation runs while update k − 1 trains). Both with token-level truncated importance sampling (`--algo
grpo,token_is`), the correction the stale side needs, so that the two differ in the staleness alone.

Rows:
- async_iteration_seconds: wall seconds an iteration, iterations 2..N (the first pays the engines' start), staleness 1
  over 0 (smaller is better);
- async_heldout_accuracy: greedy accuracy on the held-out prompts after the N iterations, staleness 1 and 0.

Printed beside them: each side's stage seconds (the generation's and the training's, from train_metrics), from which
what the overlap can gain is read: on 2 shared cores the two halves compete for the same cores; with the rollout and
the trainer on separate GPUs an iteration would take about max(generation, training) instead of their sum, each as the
on-policy side measured it alone.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tests.benchmarks import result_row, run_with_evals

CONFIG = "infra/configs/demo.yaml"
ROOT = Path("runs/bench/async")
ITERATIONS = 10
GENERATION = ["seconds_prompts", "seconds_rollouts", "seconds_scores", "seconds_batch"]
TRAINING = ["seconds_logprobs", "seconds_advantages", "seconds_optimize"]


def measure(staleness: int) -> dict:
    run_id = f"staleness-{staleness}"
    overrides = [f"storage_root={ROOT}", f"rl.max_staleness={staleness}", "rl.eval_every=1000"]
    layout, _, ends = run_with_evals(CONFIG, overrides, run_id, ITERATIONS, "grpo,token_is")
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
    off, on = measure(1), measure(0)  # the overlapping side first: it alone uses the generation task
    # From the on-policy side's stage times, each measured alone: with the sampler and the trainer on devices of
    # their own, the generation hides behind the training, and what is outside both stays.
    rest = on["iteration"] - on["generation"] - on["training"]
    ideal = max(on["generation"], on["training"]) + rest
    print(
        f"async: with the rollout and the trainer on separate devices an iteration would take about max(generation "
        f"{on['generation']:.1f}, training {on['training']:.1f}) + the rest {rest:.1f} = {ideal:.1f} s against "
        f"{on['iteration']:.1f} s on-policy ({ideal / on['iteration']:.2f}x); here the two halves shared 2 cores: "
        f"{off['iteration']:.1f} s ({off['iteration'] / on['iteration']:.2f}x)"
    )
    return [
        result_row(
            "async_iteration_seconds", "rl.max_staleness=0", on["iteration"], off["iteration"], "seconds an iteration"
        ),
        result_row(
            "async_heldout_accuracy", "rl.max_staleness=0", on["accuracy"], off["accuracy"], "held-out greedy accuracy"
        ),
    ]
