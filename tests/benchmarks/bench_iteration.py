"""Iteration overhead at demo scale: the fraction of an RL iteration's wall time not spent generating (vLLM) or in
forward and backward passes (the logprobs pass and the update), i.e. orchestration, Parquet I/O, scoring,
checkpointing and weight sync.

The demo config (GRPO, 64 groups × 8 samples, 8 optimizer steps) from the demo's SFT model, run iteration by
iteration as Prefect flow runs, twice: with the resident trainer (rlpipe's default) and with a worker process per
logprobs and optimize stage that loads everything from disk (`engines.resident_trainer=false`, the restart
figure). The vLLM engine is resident in both. Iteration 1 pays the one-off starts (Prefect's API, vLLM,
DeepSpeed's op build) and is not counted; the figure is over the iterations after it. The `prefect_floor` row is
Prefect's own floor per iteration, a flow run of no-op tasks (tests/benchmarks/prefect_floor.py), with rlpipe's local
settings against Prefect's defaults.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl

from tests.benchmarks import prefect_floor

# The 1M-parameter arithmetic model (built from its recipe, then SFT): demo scale for the orchestration benchmarks.
TINY_CONFIG = "infra/configs/arithmetic_tiny.yaml"
ITERATIONS = 5  # 1 warm-up + 4 measured
ROOT = Path("runs/bench/iteration")
ENGINE_SECONDS = ("seconds_generate", "seconds_logprobs_forward", "seconds_forward_backward")


def ensure_tiny_model() -> None:
    from schemas.config import load_config

    if not (Path(load_config(TINY_CONFIG).model.path) / "config.json").exists():  # built as `rlpipe demo --config` does
        for args in (["init-model", "--config", TINY_CONFIG], ["sft", TINY_CONFIG, "--run-id", "sft"]):
            subprocess.run([sys.executable, "-m", "flows.cli", *args], check=True)


def iteration_profile(resident: bool) -> pl.DataFrame:
    """Per measured iteration: wall seconds (the flow run, measured here) and engine seconds (from train_metrics)."""
    from storage import read_stage
    from tests.benchmarks.trl_match import run_iterations

    run_id = "resident" if resident else "one-shot"
    layout, ends = run_iterations(
        TINY_CONFIG,
        [
            f"storage_root={ROOT}",
            f"engines.resident_trainer={str(resident).lower()}",
            f"engines.weight_sync={'collective' if resident else 'file'}",
        ],
        run_id,
        ITERATIONS,
    )
    rows = []
    for k in range(2, ITERATIONS + 1):
        m = read_stage(layout, "train_metrics", k).row(0, named=True)
        rows.append(
            {
                "iteration": k,
                "wall": ends[k - 1] - ends[k - 2],
                **{c: m[c] for c in ENGINE_SECONDS},
                **{c: m[c] for c in m if c.startswith("seconds_") and c not in ENGINE_SECONDS},
            }
        )
    return pl.DataFrame(rows)


def overhead_fraction(profile: pl.DataFrame) -> float:
    engine = profile.select(pl.sum_horizontal(*ENGINE_SECONDS).sum()).item()
    return 1.0 - engine / profile["wall"].sum()


def run() -> list[dict]:
    ensure_tiny_model()
    profiles = {mode: iteration_profile(mode == "resident") for mode in ("resident", "one-shot")}
    for mode, profile in profiles.items():
        print(f"iteration profile, {mode} trainer (seconds):")
        print(profile.mean().drop("iteration").transpose(include_header=True, column_names=["mean"]))
    resident, restarts = (overhead_fraction(profiles[m]) for m in ("resident", "one-shot"))
    defaults, floor = prefect_floor.measure(defaults=True), prefect_floor.measure(defaults=False)
    wall = profiles["resident"]["wall"].mean()
    print(
        f"Prefect's own cost: {floor:.3f}s per flow run of 8 no-op tasks (Prefect's defaults: {defaults:.3f}s) = "
        f"{floor / wall:.3f} of a resident iteration ({wall:.2f}s); overhead fraction {resident:.2f}"
    )
    # The ratio of this benchmark is the overhead fraction itself (lower is better), not an advantage.
    return [
        {
            "benchmark": "iteration_overhead",
            "baseline": "one-shot trainer workers (restart per stage)",
            "baseline_value": restarts,
            "rlpipe_value": resident,
            "unit": "fraction of iteration wall",
            "ratio": resident,
        },
        {
            "benchmark": "prefect_floor",
            "baseline": "Prefect's defaults (database file, heartbeats)",
            "baseline_value": defaults,
            "rlpipe_value": floor,
            "unit": "seconds per flow run of 8 no-op tasks",
            "ratio": defaults / floor,
        },
    ]
