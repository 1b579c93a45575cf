"""How close each heavy stage runs to this machine's limit, on the real model (`make bench ARGS=real`).

In one process: this machine's fp32 matmul throughput at the model's own GEMM shapes (torch, the trainer's thread
count; the mean of a measurement before and one after the runs), and ITERATIONS iterations of the demo config
(SmolLM2-135M-Instruct, from the pretrained model) as `rlpipe run` runs them. For the iterations after the first (the
first pays the engines' start), each heavy stage's useful FLOPs over its seconds, as a fraction of that peak:

- FLOPs are counted from the model's shapes and the tokens actually processed: 2 per weight of the decoder layers per
  token position, 2 per weight of the output layer per predicted token, and 4·heads·head_dim per (query, key) pair the
  attention mask allows, per layer (a forward pass); training is 3× its forward. Padding is not useful work.
- rollouts: vLLM's prefill (each prompt once: its G samples share it) and decode (every generated token), over
  `seconds_generate`;
- logprobs: the trainer's no-grad passes (old policy, reference), over `seconds_logprobs_forward`, from the counts the
  trainer reports (`logprobs_forward_*`);
- optimize: the update's forward and backward (`update_*`), over `seconds_forward_backward`.

Two runs, one after the other: `rlpipe run`'s own settings (sparse checkpoints, `checkpoint.every` 5: the optimizer
state written only at the last of the ITERATIONS), then a baseline with `checkpoint.every=1` (every update's
checkpoint full, its state written while the next rollouts run). Their breakdowns of an iteration are printed side by
side.

Rows (from the first run): real_rollout_peak_fraction, real_logprobs_peak_fraction, real_optimize_peak_fraction
(ratio: the fraction), real_padding_fraction (computed positions that are padding, trainer passes),
real_iteration_overhead (the fraction of an iteration outside generation, forward and backward passes),
real_samples_per_s; and against the baseline: real_sparse_checkpoint_samples_per_s (a state writer that slowed the
next generation down would show here, where the overhead row would count it as generation) and
real_checkpoint_bytes_per_update (what an update writes on average, as `rlpipe show` counts it).
"""

from __future__ import annotations

import time
from pathlib import Path

import polars as pl

CONFIG = "infra/configs/demo.yaml"
ITERATIONS = 4
ROOT = Path("runs/bench/real")


def model_shapes(path: str) -> dict:
    """Weights per token of the decoder layers and of the output layer, and attention's per-pair cost, from the
    config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    head = model.get_output_embeddings().weight
    layers = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and ".layers." in name)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {
        "layer_weights": layers,
        "head_weights": head.numel(),
        "hidden": cfg.hidden_size,
        "vocab": head.shape[0],
        "attention_per_pair": 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim,
        "gemms": [
            (cfg.hidden_size, cfg.num_attention_heads * head_dim),
            (cfg.hidden_size, cfg.num_key_value_heads * head_dim),
            (cfg.num_attention_heads * head_dim, cfg.hidden_size),
            (cfg.hidden_size, cfg.intermediate_size),
            (cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, head.shape[0]),
        ],
    }


def gemm_peak(shapes: dict, tokens: int = 512, seconds: float = 0.6) -> float:
    """FLOP/s of torch's fp32 matmul over the model's GEMM shapes (M = `tokens` rows), weighted as one token's pass
    weighs them, with the thread count the trainer uses (torch's default: every core)."""
    import torch

    flops = elapsed = 0.0
    for k, n in shapes["gemms"]:
        a, b = torch.randn(tokens, k), torch.randn(k, n)
        a @ b
        runs, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            a @ b
            runs += 1
        each = (time.perf_counter() - t0) / runs
        print(f"  matmul ({tokens}×{k}) @ ({k}×{n}): {2 * tokens * k * n / each / 1e9:.1f} GFLOP/s")
        flops, elapsed = flops + 2 * tokens * k * n, elapsed + each
    return flops / elapsed


def forward_flops(shapes: dict, counts: dict, prefix: str) -> float:
    """Useful FLOPs of the forward passes a stage's counts describe (packing.SharedPrefixBatch.counts)."""
    return (
        2 * shapes["layer_weights"] * counts[f"{prefix}_tokens"]
        + 2 * shapes["head_weights"] * counts[f"{prefix}_predicted_tokens"]
        + shapes["attention_per_pair"] * counts[f"{prefix}_attention_pairs"]
    )


def rollout_flops(shapes: dict, rollouts: pl.DataFrame, prompts: pl.DataFrame) -> float:
    """vLLM's useful work: each prompt's prefill once (its samples share it, prefix caching), every generated token, and
    the attention each token pays over its context."""
    plens = prompts.select(pl.col("prompt_token_ids").list.len()).to_series()
    prefill = float(plens.sum())
    prefill_pairs = float((plens * (plens + 1) / 2).sum())
    joined = rollouts.join(
        prompts.select("prompt_id", pl.col("prompt_token_ids").list.len().alias("p")), on="prompt_id"
    )
    generated = float(joined["length"].sum())
    # Token j of a response attends to the prompt and to tokens 0..j: Σ_j (P + j + 1).
    decode_pairs = float(
        joined.select(pl.col("length") * pl.col("p") + pl.col("length") * (pl.col("length") + 1) / 2).sum().item()
    )
    return (
        2 * shapes["layer_weights"] * (prefill + generated)
        + 2 * shapes["head_weights"] * (len(plens) + generated)
        + shapes["attention_per_pair"] * (prefill_pairs + decode_pairs)
    )


def overhead_breakdown(layout, ends: list[float]) -> pl.DataFrame:
    """Where each iteration's seconds outside generation, forward and backward go (iterations 2..N, means): every
    stage's wall time less the engine work inside it, the trainer's time around its passes (the update's preparation and
    the checkpoint it writes), the sampler's weight sync, and the time between stages (the flow: Prefect's task runs,
    the iteration's artifact)."""
    from storage import read_manifest, read_stage

    rows = []
    for k in range(2, len(ends) + 1):
        m = read_stage(layout, "train_metrics", k).row(0, named=True)
        walls = {
            name: m[f"seconds_{name}"] for name in ("prompts", "rollouts", "scores", "batch", "logprobs", "advantages")
        }
        optimize = float(read_manifest(layout, "train_metrics", k, verify=False)["wall_seconds"])
        between = (ends[k - 1] - ends[k - 2]) - optimize - sum(walls.values())
        rows.append(
            {
                "rollouts: generate": m["seconds_generate"],
                "rollouts: weight sync": m["weight_sync_seconds"],
                "rollouts: rest (probe, Parquet, task)": walls.pop("rollouts")
                - m["seconds_generate"]
                - m["weight_sync_seconds"],
                "logprobs: forward": m["seconds_logprobs_forward"],
                "logprobs: rest": walls.pop("logprobs") - m["seconds_logprobs_forward"],
                "optimize: forward+backward": m["seconds_forward_backward"],
                "optimize: trainer rest (load, prepare)": m["seconds_optimize"] - m["seconds_forward_backward"],
                "optimize: checkpoint before the answer (weights, probe; state unless deferred)": m[
                    "seconds_save_checkpoint"
                ],
                "optimize: client rest (frame, commit, metrics)": optimize
                - m["seconds_optimize"]
                - m["seconds_save_checkpoint"],
                **{f"{name}: stage": wall for name, wall in walls.items()},
                "between stages (flow)": between,
            }
        )
    means = pl.DataFrame(rows).mean()
    return means.transpose(include_header=True, header_name="seconds per iteration", column_names=["mean"])


def measure(shapes: dict, run_id: str, overrides: list[str]) -> tuple[dict, pl.DataFrame]:
    """A fresh run of ITERATIONS demo iterations: (totals over iterations 2..N, the breakdown of one iteration)."""
    from storage import read_stage
    from tasks.analysis.show import checkpoint_bytes_written, disk_use
    from tests.benchmarks.trl_match import run_iterations

    layout, ends = run_iterations(CONFIG, [f"storage_root={ROOT}", *overrides], run_id, ITERATIONS)
    keys = ("rollout_flops", "rollout_s", "logprobs_flops", "logprobs_s", "update_flops", "update_s")
    rows, totals = [], dict.fromkeys((*keys, "engine_s", "wall", "samples", "padding", "positions"), 0.0)
    for k in range(2, ITERATIONS + 1):
        m = read_stage(layout, "train_metrics", k).row(0, named=True)
        flops = {
            "rollout": rollout_flops(shapes, read_stage(layout, "rollouts", k), read_stage(layout, "prompts", k)),
            "logprobs": forward_flops(shapes, m, "logprobs_forward"),
            "update": 3 * forward_flops(shapes, m, "update"),
        }
        seconds = {
            "rollout": m["seconds_generate"],
            "logprobs": m["seconds_logprobs_forward"],
            "update": m["seconds_forward_backward"],
        }
        wall = ends[k - 1] - ends[k - 2]
        for key in flops:
            totals[f"{key}_flops"] += flops[key]
            totals[f"{key}_s"] += seconds[key]
        totals["engine_s"] += sum(seconds.values())
        totals["wall"] += wall
        totals["samples"] += float(read_stage(layout, "rollouts", k).height)
        for prefix in ("logprobs_forward", "update"):
            totals["positions"] += m[f"{prefix}_positions"]
            totals["padding"] += m[f"{prefix}_positions"] - m[f"{prefix}_tokens"]
        rows.append(
            {
                "iteration": k,
                "wall": wall,
                **{f"{s}_s": v for s, v in seconds.items()},
                **{f"{s}_gflop_s": flops[s] / seconds[s] / 1e9 for s in flops},
            }
        )
    with pl.Config(tbl_rows=-1, tbl_width_chars=120):
        print(f"real {run_id}:")
        print(pl.DataFrame(rows))
    totals["written"] = checkpoint_bytes_written(layout, disk_use(layout)["checkpoints"])
    return totals, overhead_breakdown(layout, ends)


def run() -> list[dict]:
    from schemas.config import load_config

    cfg = load_config(CONFIG)
    shapes = model_shapes(cfg.model.path)
    print(
        f"real: {cfg.model.path}: decoder weights {shapes['layer_weights'] / 1e6:.1f}M, output layer "
        f"{shapes['head_weights'] / 1e6:.1f}M"
    )
    first = gemm_peak(shapes)
    # The same run as `rlpipe run` makes it, then a baseline with the update's optimizer state written before the
    # optimize stage completes (instead of while the next rollouts run): one after the other, never side by side.
    totals, breakdown = measure(shapes, "real", [])
    base_totals, base_breakdown = measure(shapes, "real-every-1", ["checkpoint.every=1"])
    # This machine's speed drifts over minutes: the limit is the mean of two measurements, before and after the runs,
    # as the stages' rates are means over the time between them (one taken in a slow spell flattered the stages).
    last = gemm_peak(shapes)
    peak = (first + last) / 2
    print(
        f"real: fp32 matmul at the model's GEMM shapes: {peak / 1e9:.1f} GFLOP/s (the limit below; "
        f"{first / 1e9:.1f} before the runs, {last / 1e9:.1f} after)"
    )
    with pl.Config(tbl_rows=-1, fmt_str_lengths=60, tbl_width_chars=120):  # every row of the breakdown, unabridged
        print(
            breakdown.rename({"mean": "rlpipe"}).join(
                base_breakdown.rename({"mean": "full checkpoint every update"}),
                on="seconds per iteration",
                how="full",
                coalesce=True,
                maintain_order="left",
            )
        )
    fraction = {s: totals[f"{s}_flops"] / totals[f"{s}_s"] / peak for s in ("rollout", "logprobs", "update")}
    overhead = 1 - totals["engine_s"] / totals["wall"]
    base_overhead = 1 - base_totals["engine_s"] / base_totals["wall"]
    samples_per_s, base_samples_per_s = totals["samples"] / totals["wall"], base_totals["samples"] / base_totals["wall"]
    print(
        f"real: peak fractions rollouts {fraction['rollout']:.2f}, logprobs {fraction['logprobs']:.2f}, optimize "
        f"{fraction['update']:.2f}; padding {totals['padding'] / totals['positions']:.3f}; overhead {overhead:.3f} "
        f"({base_overhead:.3f} with a full checkpoint every update); {samples_per_s:.2f} samples/s "
        f"({base_samples_per_s:.2f}); checkpoints written per update {totals['written'] / 1e9:.2f} GB "
        f"({base_totals['written'] / 1e9:.2f} GB)"
    )

    def row(name, value, unit, target, baseline="target"):
        return {
            "benchmark": name,
            "baseline": baseline,
            "baseline_value": target,
            "rlpipe_value": value,
            "unit": unit,
            "ratio": value if baseline == "target" else value / target,
        }

    gflops = f"of {peak / 1e9:.0f} GFLOP/s (fp32 matmul, model shapes)"
    return [
        row("real_rollout_peak_fraction", fraction["rollout"], gflops, 0.3),
        row("real_logprobs_peak_fraction", fraction["logprobs"], gflops, 0.5),
        row("real_optimize_peak_fraction", fraction["update"], gflops, 0.5),
        row("real_padding_fraction", totals["padding"] / totals["positions"], "fraction of trainer positions", 0.05),
        row("real_iteration_overhead", overhead, "fraction of iteration wall", 0.05),
        row("real_samples_per_s", samples_per_s, "samples/s", float("nan")),
        row(
            "real_sparse_checkpoint_samples_per_s",
            samples_per_s,
            "samples/s",
            base_samples_per_s,
            baseline="checkpoint.every=1",
        ),
        row(
            "real_checkpoint_bytes_per_update",
            totals["written"],
            "bytes",
            base_totals["written"],
            baseline="checkpoint.every=1",
        ),
    ]
