"""Whole iterations on the long-response workload (`make bench ARGS=long_iteration`): infra/configs/long_reasoning.yaml
(SmolLM2-135M-Instruct, step-by-step arithmetic, answers of up to 512 tokens, one round of 8 prompts × 8 an
iteration, the groups that are not all right or all wrong trained) run for 10 iterations twice, one after the other in
this process, nothing else running:

- defaults: every response generated whole, π_old from the trainer's own pass (`loss.old_logprobs: trainer`);
- partial: `rollout.partial_tokens: 256` (unfinished sequences carried into the next round or iteration, at most 2
  updates old: `rl.max_staleness: 2`; up to 4 rounds to fill the 8 groups; ended groups over the batch's 8 carried
  into the next batch: `rollout.carry_surplus`) and π_old from the sampler (`loss.old_logprobs: sampler`: the
  logprobs stage runs only the reference pass the KL needs).

Both keep the config's token-budget micro-batches and gradient checkpointing, so the two differ in those two settings
alone. The final eval is greedy plus one sample on the 128 held-out prompts (eval.samples 1).

Rows:
- long_iteration_samples: samples trained a second over iterations 2..9 (the first pays the engines' start, the last
  the final eval), partial against defaults;
- long_iteration_accuracy: held-out greedy accuracy after the 10 iterations, partial against defaults.

Printed beside them: each side's stage seconds an iteration, responses ended a second, and generated tokens.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tests.benchmarks import result_row, run_with_evals

CONFIG = "infra/configs/long_reasoning.yaml"
ROOT = Path("runs/bench/long_iteration")
ITERATIONS = 10  # 46-65 minutes here, both sides, with the machine's speed of the day
# batch.drop_zero_variance again after the `grpo` preset (which turns it off): only groups with a reward spread are
# trained. Without it the partial side's batch is the first 8 groups to end, all-right and all-wrong ones included,
# while groups with a spread that ended later wait as surplus (measured: 34 of its 80 trained groups had a spread,
# against 40 of 80 on the defaults side, and accuracy 0.312 vs 0.414).
COMMON = [
    f"storage_root={ROOT}",
    "rl.eval_every=1000",
    "eval.samples=1",
    "eval.pass_k=1",
    "batch.drop_zero_variance=true",
]
SIDES = {
    "defaults": ["loss.old_logprobs=trainer"],
    # Up to 4 rounds of 256 tokens a sequence to fill the batch (a group ends when all 8 of its responses have, so one
    # round may end too few). 256, not 128: generation alone ran at 257 tokens/s against 242 (64: 197; fewer rounds,
    # fewer prefixes re-read), and this bench gave 1.20x against 1.17x (docs/long-responses.md).
    # The ended groups a round leaves over the batch's 8 are trained by the next update (rollout.carry_surplus).
    "partial": [
        "loss.old_logprobs=sampler",
        "rollout.partial_tokens=256",
        "rl.max_staleness=2",
        "batch.max_rounds=4",
        "rollout.carry_surplus=true",
    ],
}
STAGES = ("rollouts", "scores", "batch", "logprobs", "advantages", "optimize")


def generated(layout, k: int, surplus: bool) -> pl.DataFrame:
    """Iteration k's rollouts but the groups carried, ended already, from the batch before (rollout.carry_surplus),
    which iteration k − 1's rows counted (a prompt_id is a group's key within an iteration); `surplus`: whether the
    side carries them."""
    from storage import read_stage

    rows = read_stage(layout, "rollouts", k)
    if not surplus:
        return rows
    before = read_stage(layout, "batch", k - 1).filter(pl.col("filter_reason") == "over_target")["prompt_id"]
    carried = (pl.col("round") == 0) & pl.col("prompt_id").is_in(before.implode())
    return rows.filter(~carried)


def measure(side: str) -> dict:
    from storage import read_stage

    layout, start, ends = run_with_evals(CONFIG, [*COMMON, *SIDES[side]], side, ITERATIONS, "grpo")
    measured = range(2, ITERATIONS)  # iteration 1 starts the engines; the last one's end includes the final eval
    walls = [ends[k - 1] - ends[k - 2] for k in measured]
    m = pl.concat([read_stage(layout, "train_metrics", k) for k in measured], how="diagonal")
    surplus = "rollout.carry_surplus=true" in SIDES[side]
    ended = pl.concat([generated(layout, k, surplus) for k in measured], how="diagonal_relaxed")
    tokens = int(ended["length"].sum())
    evals = read_stage(layout, "eval", ITERATIONS)
    out = {
        "side": side,
        "seconds": sum(walls) / len(walls),
        "samples_per_s": float(m["samples"].sum()) / sum(walls),
        "ended_per_s": ended.height / sum(walls),
        "tokens": tokens,
        "accuracy": float(evals["greedy_correct"].mean()),
        "stages": {s: float(m[f"seconds_{s}"].mean()) for s in STAGES if f"seconds_{s}" in m.columns},
        "generate": float(m["seconds_generate"].mean()),
    }
    stages = ", ".join(f"{s} {v:.1f}" for s, v in out["stages"].items())
    print(
        f"long_iteration {side}: {out['seconds']:.1f} s an iteration over iterations 2-{ITERATIONS - 1} "
        f"({stages}; vLLM generating {out['generate']:.1f}); {out['samples_per_s']:.3f} samples trained/s, "
        f"{out['ended_per_s']:.3f} responses ended/s, {tokens} tokens in the ended responses; held-out greedy "
        f"accuracy {out['accuracy']:.3f}; {ends[-1] - start:.0f} s in all, the final eval included"
    )
    if "surplus_groups" in m.columns:  # partial rollouts' pool, summed over the measured iterations
        pool = {k: int(m[k].sum()) for k in ("admitted_groups", "ended_groups", "surplus_groups", "stale_groups")}
        print(f"long_iteration {side}: groups {pool}; samples trained {int(m['samples'].sum())}")
    return out


def run() -> list[dict]:
    defaults, partial = measure("defaults"), measure("partial")
    return [
        result_row(
            "long_iteration_samples",
            "defaults (whole responses, π_old from the trainer)",
            defaults["samples_per_s"],
            partial["samples_per_s"],
            "samples trained/s",
        ),
        result_row(
            "long_iteration_accuracy",
            "defaults (whole responses, π_old from the trainer)",
            defaults["accuracy"],
            partial["accuracy"],
            "held-out greedy accuracy",
        ),
    ]
