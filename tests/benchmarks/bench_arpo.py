"""ARPO against GRPO on the calculator example (`make bench ARGS=arpo`): SmolLM2-135M-Instruct after the example's
short SFT, 5 iterations of 16 prompts × 8 trajectories (at most 3 turns), rewarded for the final answer only; then
the greedy and sampled eval on the 128 held-out sums.

Rows: `grpo`, every trajectory from the prompt; `arpo`, agent.branching with 4 initial trajectories a prompt (α 0.5,
β 0.2, one copy a draw: the reference scripts' settings) and the soft attribution; `arpo_hard`, the same with the
hard one. A row whose run is complete (result.json) is read back, not rerun (RLPIPE_ARPO_ROWS=grpo,arpo picks rows).

Per row: held-out greedy accuracy, pass@2 and tool-call rate; over the training rollouts, the tokens sampled, the
share of trajectories that call the tool, the distinct tool-call paths a prompt (each trajectory's calls, name and
arguments in order; no call is a path too), and the branches made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

from tests.benchmarks import run_rows, run_with_evals

CONFIG = "examples/calculator_tools/config.yaml"
ROOT = Path("runs/bench/arpo")
SFT_MODEL = Path("models/calculator-sft")  # the config's model.path: what the example's SFT writes
ITERATIONS = 5
BRANCHING = "agent.branching={initial: 4, alpha: 0.5, beta: 0.2, copies: 1}"
ROWS: dict[str, list[str]] = {
    "grpo": [],
    "arpo": [BRANCHING],
    "arpo_hard": [BRANCHING, "advantage.branch_attribution=hard"],
}


def prepare() -> None:
    """The example's data and SFT model, as its docs make them (once)."""
    if not Path("data/calculator_tools/train.parquet").exists():
        subprocess.run([sys.executable, "examples/calculator_tools/make_data.py"], check=True)
    if not (SFT_MODEL / "config.json").exists():
        cli = [sys.executable, "-c", "from flows.cli import main; main()"]
        sft = [*cli, "sft", CONFIG, "--run-id", "calc-sft", "--set", f"storage_root={ROOT}"]
        subprocess.run(sft, check=True)


def tool_paths(turns: pl.DataFrame) -> pl.DataFrame:
    """Per prompt: its distinct tool-call paths (a trajectory's calls in order; no call at all is one path too)."""
    calls = (
        turns.filter(pl.col("role") == "tool")
        .with_columns((pl.col("tool_name") + pl.col("tool_arguments").fill_null("")).alias("call"))
        .group_by("prompt_id", "sample_idx", maintain_order=True)
        .agg(pl.col("call").str.join("|").alias("path"))
    )
    every = turns.select("prompt_id", "sample_idx").unique()
    paths = every.join(calls, on=["prompt_id", "sample_idx"], how="left").with_columns(pl.col("path").fill_null(""))
    return paths.group_by("prompt_id").agg(pl.col("path").n_unique().alias("paths"))


def measure(row: str) -> dict:
    done = ROOT / row / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    from storage import read_manifest, read_stage

    overrides = [f"storage_root={ROOT}", "rl.eval_every=1000", *ROWS[row]]
    layout, start, ends = run_with_evals(CONFIG, overrides, row, ITERATIONS, "grpo")
    per = []
    for k in range(1, ITERATIONS + 1):
        rollouts, turns = read_stage(layout, "rollouts", k), read_stage(layout, "turns", k)
        scores = read_stage(layout, "scores", k)
        extra = read_manifest(layout, "rollouts", k)["extra"]["round0"]
        branched = rollouts["parent_sample_idx"].is_not_null().sum() if "parent_sample_idx" in rollouts.columns else 0
        per.append(
            {
                "tokens": int(extra["tokens"]),
                "generate_calls": int(extra["turns"]),
                "tool_call_share": float((rollouts["tool_calls"] > 0).mean()),
                "paths": float(tool_paths(turns)["paths"].mean()),
                "branches": int(branched),
                "reward": float(scores["reward"].mean()),
            }
        )
    ev = read_stage(layout, "eval", ITERATIONS)
    summary = read_manifest(layout, "eval", ITERATIONS)["extra"]
    walls = [b - a for a, b in zip(ends, ends[1:])]
    result = {
        "row": row,
        "how": " ".join(ROWS[row]) or "GRPO",
        "accuracy": float(ev["greedy_correct"].mean()),
        "pass_at_k": float(ev["pass_at_k"].mean()),
        "tool_call_rate": float(summary["tool_call_rate"]),
        "tokens": sum(p["tokens"] for p in per),
        "per_iteration": per,
        "seconds_iteration": sum(walls) / len(walls),
        "seconds_total": ends[-1] - start,
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| row | greedy accuracy | pass@2 | tool-call rate (greedy) | tokens sampled | tool-call share, it. 1 → 5 "
        "| distinct tool paths a prompt, it. 1 → 5 | branches a iteration | mean reward, it. 1 → 5 | s an iteration |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["per_iteration"]

        def ends(key, fmt="{:.3f}"):
            return f"{fmt.format(p[0][key])} → {fmt.format(p[-1][key])}"

        lines.append(
            f"| {r['row']} | {r['accuracy']:.3f} | {r['pass_at_k']:.3f} | {r['tool_call_rate']:.3f} | {r['tokens']:,} "
            f"| {ends('tool_call_share')} | {ends('paths', '{:.2f}')} | {sum(x['branches'] for x in p) / len(p):.1f} "
            f"| {ends('reward')} | {r['seconds_iteration']:.0f} |"
        )
    return "\n".join(lines)


def run() -> list[dict]:
    prepare()
    return run_rows("arpo", ROOT, list(ROWS), measure, table)
