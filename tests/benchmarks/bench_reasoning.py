"""SmolLM2-135M-Instruct on reasoning-gym's tasks before any training, as a run's start eval evaluates its starting
model (greedy, and one sample at temperature 1, up to 512 tokens), each task a source of 32 held-out prompts scored by
the task's own scorer. Prints the table docs/reasoning-tasks.md holds: per task the greedy accuracy (a response is
correct at score 1, eval.judge_threshold), its label prior, the sampled one and the mean greedy response length, from
which the tasks it can learn (start between 0.05 and 0.6) with long responses (≥ 60 tokens) are chosen.

- `make bench ARGS=reasoning_baseline`: infra/configs/reasoning_baseline.yaml, ten tasks at their default settings
  with reasoning-gym's default prompt (the answer in <answer> tags);
- `make bench ARGS=reasoning_easy`: infra/configs/reasoning_easy.yaml, ten tasks at easy settings, the answer the
  phrase the model ends with ("The answer is 12.", answer_format: pattern);
- `make bench ARGS=reasoning_steps`: infra/configs/reasoning_steps.yaml, ten tasks at easy settings with a prompt that
  asks for each step in a sentence, sampled at temperature 0.7;
- `make bench ARGS=reasoning_candidates`: infra/configs/reasoning_candidates.yaml, ten harder settings and more tasks
  with that prompt, for a third task to mix with lcm and syllogism.

Rows: reasoning_baseline_accuracy, reasoning_easy_accuracy, reasoning_steps_accuracy, reasoning_candidates_accuracy
(the mean over the tasks; absolute: the ratio is the value).
"""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl


def evaluate_start(config: str, run_id: str) -> tuple[pl.DataFrame, dict, float]:
    """The start eval of a fresh run of config (its dataset, then eval 0), its per-prompt table, figures, seconds."""
    import shutil

    from flows.deployments import prepare_checked_run
    from flows.local_prefect import local_flow_settings
    from schemas.config import load_config
    from storage import RunLayout, read_manifest, read_stage
    from tasks.engines.resident import close_all
    from tasks.stages.dataset import dataset_task
    from tasks.stages.evaluate import eval_task

    shutil.rmtree(Path(load_config(config).storage_root) / run_id, ignore_errors=True)
    try:
        root = prepare_checked_run(config, [], run_id, None)
        t0 = time.time()
        with local_flow_settings():
            dataset_task(root, run_id)
            eval_task(root, run_id, 0)
        seconds = time.time() - t0
    finally:
        close_all()
    layout = RunLayout(Path(root), run_id)
    return read_stage(layout, "eval", 0), read_manifest(layout, "eval", 0)["extra"], seconds


def run(name: str) -> list[dict]:
    """The table for infra/configs/reasoning_{name}.yaml."""
    _, figures, seconds = evaluate_start(f"infra/configs/reasoning_{name}.yaml", name)
    tasks = sorted(k.split("/", 1)[1] for k in figures if k.startswith("accuracy/"))
    print(f"reasoning_{name}: {len(tasks)} tasks, start eval in {seconds:.0f} s")
    print("| task | greedy accuracy | label prior | sampled accuracy | mean greedy length (tokens) | prompts |")
    print("|---|---|---|---|---|---|")
    for t in tasks:
        print(
            f"| `{t}` | {figures[f'accuracy/{t}']:.3f} | {figures.get(f'label_prior/{t}', float('nan')):.3f} | "
            f"{figures.get(f'pass_at_1/{t}', float('nan')):.3f} | {figures[f'mean_length/{t}']:.0f} | "
            f"{figures[f'prompts/{t}']} |"
        )
    mean = sum(figures[f"accuracy/{t}"] for t in tasks) / len(tasks)
    return [
        {
            "benchmark": f"reasoning_{name}_accuracy",
            "baseline": "none (absolute)",
            "baseline_value": 1.0,
            "rlpipe_value": mean,
            "unit": "greedy accuracy, mean over the tasks",
            "ratio": mean,
        }
    ]
