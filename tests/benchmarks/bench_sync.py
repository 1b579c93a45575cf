"""Weights to the sampler without files (`make bench ARGS=sync`): the demo config (SmolLM2-135M-Instruct, fp32) for
ITERATIONS iterations at the default checkpoint.every (10: full checkpoint at the last iteration only), with small
batches (what a sync costs does not depend on the batch), four runs one after the other in this process: full weights
and LoRA (rank 16, every linear layer), each with `engines.weight_sync` collective (the default: trainer rank 0
sends through vLLM's weight-transfer API, over rlpipe's gloo engine here; weights-only checkpoints hold no weight
files) and file (each checkpoint holds its weights, the sampler reloads them from disk).

An update's weights reach the sampler in two parts, both timed per iteration: the trainer writing them
(`seconds_save_weights`: with file the safetensors; with collective only the model's config in their place) and the
sync inside the next rollouts (`weight_sync_seconds`: the file path's in-place reload from disk; the collective path's
vLLM calls on the replica, from its start to its finish: receive and in-place load, while the trainer gathers and
broadcasts). The probe check after either, and the tokenizer and probe the checkpoint gets either way, are apart.
Medians over the weights-only iterations 2..N−1: the first sync of a run also makes the group and its buffers (printed
apart).

Rows (ratio: collective over the baseline; smaller is better):
- sync_seconds_full, sync_seconds_lora: weights written + sync, collective over file;
- sync_bytes_per_update_full, sync_bytes_per_update_lora: what an update writes on average (as `rlpipe show` counts
  it), collective with the default interval over the file path with a full checkpoint every update (what every update
  wrote before sparse checkpoints: one full checkpoint's weights and optimizer state).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tests.benchmarks import result_row

CONFIG = "infra/configs/demo.yaml"
ROOT = Path("runs/bench/sync")
ITERATIONS = 10
SMALL = [
    f"storage_root={ROOT}",
    "rollout.prompts_per_round=4",
    "rollout.group_size=4",
    "batch.target_groups=4",
    "batch.drop_zero_variance=false",
    "eval.max_prompts=8",
    "rl.eval_every=1000",
]
LORA = ["lora.rank=16", "lora.alpha=32", "lora.target_modules=all-linear", "optim.lr=1.0e-4"]


def measure(run_id: str, overrides: list[str]) -> dict:
    from storage import folder_bytes, read_stage
    from tasks.analysis.show import checkpoint_bytes_written, disk_use
    from tests.benchmarks.trl_match import run_iterations

    layout, _ = run_iterations(CONFIG, [*SMALL, *overrides], run_id, ITERATIONS, "grpo")
    m = pl.concat([read_stage(layout, "train_metrics", k) for k in range(1, ITERATIONS + 1)], how="diagonal")
    # Update k's checkpoint is synced at iteration k + 1's rollouts: pair them.
    save = m.filter(pl.col("iteration").is_between(1, ITERATIONS - 2))["seconds_save_weights"]
    sync = m.filter(pl.col("iteration").is_between(2, ITERATIONS - 1))
    out = {
        "save": float(save.median()),
        "sync": float(sync["weight_sync_seconds"].median()),
        "first_sync": float(sync["weight_sync_seconds"][0]),
        "sync_bytes": float(sync["weight_sync_bytes"].mean()),
        "gap": float(sync["weight_sync_logprob_gap"].max()),
        "written": checkpoint_bytes_written(layout, disk_use(layout)["checkpoints"]),
        "full_checkpoint": float(folder_bytes(layout.checkpoint_dir(ITERATIONS))),
    }
    print(
        f"sync {run_id}: weights written {out['save']:.3f} s + sync {out['sync']:.3f} s an update (the first sync: "
        f"{out['first_sync']:.3f} s); "
        f"{out['sync_bytes'] / 2**20:.1f} MiB over the group; gap {out['gap']:.2g}; written per update "
        f"{out['written'] / 1e9:.3f} GB (a full checkpoint: {out['full_checkpoint'] / 1e9:.3f} GB)"
    )
    return out


def run() -> list[dict]:
    rows = []
    for kind, extra in (("full", []), ("lora", LORA)):
        collective = measure(f"{kind}-collective", extra)
        file = measure(f"{kind}-file", [*extra, "engines.weight_sync=file"])
        rows.append(
            result_row(
                f"sync_seconds_{kind}",
                "engines.weight_sync=file",
                file["save"] + file["sync"],
                collective["save"] + collective["sync"],
                "seconds an update (weights written + sync)",
            )
        )
        rows.append(
            result_row(
                f"sync_bytes_per_update_{kind}",
                "a full checkpoint every update, file sync",
                collective["full_checkpoint"],
                collective["written"],
                "bytes written an update",
            )
        )
    return rows
