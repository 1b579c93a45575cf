"""LoRA against full-weight training on the real model (`make bench ARGS=lora`): the demo config (SmolLM2-135M-Instruct,
GRPO 16 prompts × 8 samples, 10 iterations, the demo's reward file), once training every weight at the demo's learning
rate and once with `lora.rank` set at the learning rate LoRA wants (LORA below), each `rlpipe run` in its own process,
one after the other (two 2-thread processes on 2 cores would slow each other).

Rows (ratio: the LoRA side's value over full training's; smaller is better for memory, sync and seconds):
- lora_trainer_memory_ratio: the resident trainer's peak resident memory (train_metrics.trainer_peak_rss_gib, the
  largest over the iterations), LoRA over full;
- lora_sync_vs_full: seconds to bring the sampler to the new weights (weight_sync_seconds, mean over iterations 2..N),
  LoRA (load the adapter) over full (reload every weight in place); the bytes moved are printed;
- lora_iteration_seconds: mean wall seconds of an iteration's stages (iterations 2..N);
- lora_heldout_accuracy: greedy accuracy on the 256 held-out prompts after the same optimizer steps;
- lora_checkpointed_memory_ratio, lora_checkpointed_iteration_seconds: the same two figures for LoRA with gradient
  checkpointing (LORA_CHECKPOINTED) against full weights without it. At the demo's micro-batches of 32 samples the
  activations kept for the backward pass are most of the trainer's memory, and they are the same with or without an
  adapter; checkpointing is what removes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl

from tests.benchmarks import result_row

CONFIG = "infra/configs/demo.yaml"
ROOT = Path("runs/bench/lora")
ITERATIONS = 10
# LoRA's settings: rank 16 on every linear layer, alpha 32, and 10× the full-weight learning rate (an adapter's
# update is scaled by alpha/rank from B = 0; LoRA's best RL learning rate is about 10× full fine-tuning's, Schulman et
# al. 2025, "LoRA Without Regret").
LORA = ["lora.rank=16", "lora.alpha=32", "lora.target_modules=all-linear", "optim.lr=1.0e-4"]
# LoRA as a small machine runs it: the same adapter with gradient checkpointing (model.gradient_checkpointing), which
# recomputes each decoder layer's activations in the backward pass instead of keeping them.
LORA_CHECKPOINTED = [*LORA, "model.gradient_checkpointing=true"]
BASELINE = "full-weight GRPO (same config)"


def _run(run_id: str, extra: list[str]) -> tuple[pl.DataFrame, dict]:
    sets = [f"storage_root={ROOT}", f"rl.iterations={ITERATIONS}", *extra]
    cmd = [sys.executable, "-m", "flows.cli", "run", CONFIG, "--algo", "grpo", "--run-id", run_id]
    subprocess.run(cmd + [arg for s in sets for arg in ("--set", s)], check=True)
    run_dir = ROOT / run_id
    metrics = pl.read_parquet(run_dir / "train_metrics" / "*" / "*.parquet").sort("iteration")
    return metrics, json.loads((run_dir / "summary.json").read_text())


def _weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


STAGE_SECONDS = [
    "seconds_prompts",
    "seconds_rollouts",
    "seconds_scores",
    "seconds_batch",
    "seconds_logprobs",
    "seconds_advantages",
    "seconds_optimize",
]


def side(m: pl.DataFrame, summary: dict, checkpoint: Path) -> dict:
    """One side's figures: iterations 2..N (the first pays the engines' start); a sync is counted where one happened
    (after an interim eval the sampler already holds the new weights)."""
    later = m.filter(pl.col("iteration") > 1)
    synced = later.filter(pl.col("weight_sync_seconds") > 0)
    cols = [c for c in STAGE_SECONDS if c in m.columns]
    return {
        "rss": float(m["trainer_peak_rss_gib"].max()),
        "sync": float(synced["weight_sync_seconds"].mean()),
        "gap": float(m["weight_sync_logprob_gap"].max()),
        "iteration": float(later.select(pl.sum_horizontal(cols)).to_series().mean()),
        "optimize": float(later["seconds_optimize"].mean()),
        "rollouts": float(later["seconds_rollouts"].mean()),
        "logprobs": float(later["seconds_logprobs"].mean()),
        "accuracy": summary["eval_accuracy_final"],
        "start": summary["eval_accuracy_start"],
        "bytes": _weight_bytes(checkpoint),
    }


def rows(out: dict) -> list[dict]:
    for name, r in out.items():
        print(
            f"lora bench {name}: trainer peak RSS {r['rss']:.2f} GiB, sync {r['sync']:.3f} s ({r['bytes'] / 2**20:.1f} "
            f"MiB of weights, probe gap {r['gap']:.2g}), iteration {r['iteration']:.1f} s "
            f"(rollouts {r['rollouts']:.1f}, "
            f"logprobs {r['logprobs']:.1f}, optimize {r['optimize']:.1f}), held-out greedy {r['start']:.3f} -> "
            f"{r['accuracy']:.3f}"
        )
    full, lora, checkpointed = out["full"], out["lora"], out["lora_checkpointed"]
    # Each ratio is LoRA's value over full's: smaller is better for memory, sync and seconds (targets ≤ 0.6 and ≤ 0.2).
    return [
        result_row("lora_trainer_memory_ratio", BASELINE, full["rss"], lora["rss"], "GiB trainer peak RSS (LoRA/full)"),
        result_row("lora_sync_vs_full", BASELINE, full["sync"], lora["sync"], "s weight sync (LoRA/full)"),
        result_row(
            "lora_iteration_seconds", BASELINE, full["iteration"], lora["iteration"], "s per iteration (LoRA/full)"
        ),
        result_row("lora_heldout_accuracy", BASELINE, full["accuracy"], lora["accuracy"], "greedy held-out accuracy"),
        result_row(
            "lora_checkpointed_memory_ratio",
            BASELINE,
            full["rss"],
            checkpointed["rss"],
            "GiB trainer peak RSS (LoRA + gradient checkpointing/full)",
        ),
        result_row(
            "lora_checkpointed_iteration_seconds",
            BASELINE,
            full["iteration"],
            checkpointed["iteration"],
            "s per iteration (LoRA + gradient checkpointing/full)",
        ),
    ]


def run() -> list[dict]:
    sides = {  # LoRA first: a failure shows early
        "lora": _run("lora", LORA),
        "lora_checkpointed": _run("lora_checkpointed", LORA_CHECKPOINTED),
        "full": _run("full", []),
    }
    checkpoint = f"iter={ITERATIONS:05d}"
    return rows(
        {name: side(m, summary, ROOT / name / "checkpoints" / checkpoint) for name, (m, summary) in sides.items()}
    )
