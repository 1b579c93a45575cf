"""The objective frontier side by side on the real model (`make bench ARGS=frontier`): the demo config (SmolLM2-135M-
Instruct, 16 prompts × 8 samples an iteration, 10 iterations, seed 0) under every preset of docs/algorithms.md's 2026
rows, against GRPO and DAPO at the same settings, then the final eval on the 256 held-out prompts.

Each row is a run of its own under runs/bench/frontier/<row>; a row whose run is complete (its final eval and
result.json written) is read back, not rerun, so the table is built over several sessions of `make bench` (about 11
minutes a row on 2 cores; RLPIPE_FRONTIER_ROWS=grpo,cispo picks rows). Every row starts from the same model, whose
greedy accuracy is 0.375 and pass@4 0.449 (the demo's start eval, not repeated here).

On-policy distillation (`distill`) takes the GRPO row's final model as its teacher (exported to
runs/bench/frontier/teacher), and distils it into the untouched SmolLM2 with the same number of samples as GRPO.

Printed: the table (Markdown, also written to runs/bench/frontier/table.md for docs/frontier.md); rows of
results.parquet: each row's held-out greedy accuracy against GRPO's.
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from tests.benchmarks import run_rows, run_with_evals

CONFIG = "infra/configs/demo.yaml"
ROOT = Path("runs/bench/frontier")
ITERATIONS = 10
TEACHER = ROOT / "teacher"
# row: (--algo, overrides). The baselines first: distill needs GRPO's model.
JUDGE = {
    "weight": 1.0,
    "model_path": "models/smollm2-135m-instruct",
    "template": "Question: {prompt}\nCorrect answer: {ground_truth}\nStudent's response: {response}\n\n"
    "Does the student's response give the correct answer? Reply 1 for yes or 0 for no, with the digit alone.",
    "score": "logprobs",
    "scale": [0.0, 1.0],
}
ROWS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo", []),
    "dapo": ("dapo", []),
    "cispo": ("cispo", []),
    "sapo": ("sapo", []),
    "gmpo": ("gmpo", []),
    "clip_cov": ("clip_cov", []),
    "kl_cov": ("kl_cov", []),
    "gdpo": ("gdpo", []),
    "passk": ("passk", []),
    # TRL's top_entropy_quantile at the paper's 20%
    "top_entropy": ("grpo", ["loss.top_entropy_quantile=0.2"]),
    # the demo's entropy falls from about 2.1 nats as its responses shorten: hold it at about half of that
    "entropy_adaptive": ("grpo", ["loss.entropy_target=1.0", "loss.entropy_coef=0.0", "loss.entropy_coef_max=0.05"]),
    "token_is": ("grpo,token_is", []),
    "seq_is": ("grpo,seq_is", []),
    "seq_is_rs": ("grpo,seq_is_rs", []),
    "geo_rs": ("grpo,geo_rs", []),
    "geo_rs_seq_tis": ("grpo,geo_rs_seq_tis", []),
    "distill": ("distill", [f"advantage.teacher_path={TEACHER}"]),
    # RLAIF: the policy itself (SmolLM2-135M-Instruct, frozen) judges, with the reference answer, as G-Eval's
    # P(1)/(P(0)+P(1)); the rule reward `correct` is still scored but weighs nothing: it is the held-out check
    "judge": (
        "grpo",
        [
            "reward.functions.correct.weight=0.0",
            "reward.functions.concise.weight=0.0",
            f"reward.judges={json.dumps({'ref': JUDGE})}",
        ],
    ),
}
SHARES = {  # train_metrics columns, the mean over iterations
    "clip": ["clip_frac_low", "clip_frac_high"],
    "masked": ["entropy_masked_fraction", "rollout_rejected_fraction", "rollout_vetoed_fraction"],
    "is_capped": ["rollout_is_capped_fraction"],
}


def measure(row: str) -> dict:
    """The row's result: read back from a complete run, else run it (fresh) and write result.json last."""
    done = ROOT / row / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    algo, extra = ROWS[row]
    if row == "distill" and not (TEACHER / "config.json").exists():
        from tasks.stages.weights import export_run

        measure("grpo")
        export_run("grpo", str(ROOT), str(TEACHER))
    overrides = [f"storage_root={ROOT}", "rl.eval_every=1000", *extra]  # the config's seed, 0
    layout, start, ends = run_with_evals(CONFIG, overrides, row, ITERATIONS, algo)
    m = pl.concat(
        [pl.read_parquet(layout.stage_dir("train_metrics", k) / "*.parquet") for k in range(1, ITERATIONS + 1)],
        how="diagonal",
    )
    ev = pl.read_parquet(layout.stage_dir("eval", ITERATIONS) / "*.parquet")
    # the trained-on reward against the rule's on the same samples, an iteration each: where a judge is the reward,
    # the two drifting apart is reward hacking
    scores = [pl.read_parquet(layout.stage_dir("scores", k) / "*.parquet") for k in range(1, ITERATIONS + 1)]

    def share(columns):
        present = [c for c in columns if c in m.columns]
        return float(m.select(sum(pl.col(c) for c in present)).mean().item()) if present else None

    walls = [b - a for a, b in zip(ends, ends[1:])]
    result = {
        "row": row,
        "algo": " ".join([f"--algo {algo}", *extra]),
        "accuracy": float(ev["greedy_correct"].mean()),
        "pass_at_k": float(ev["pass_at_k"].mean()),
        "k": int(ev["n_samples"].max()),
        "entropy_first": float(m["entropy"][0]),
        "entropy_last": float(m["entropy"][-1]),
        **{name: share(columns) for name, columns in SHARES.items()},
        "response_tokens": float(m["response_length_mean"][-1]),
        "reward_by_iteration": [float(s["reward"].mean()) for s in scores],
        "rule_by_iteration": [float(s["score_correct"].mean()) for s in scores],
        "response_tokens_by_iteration": m["response_length_mean"].to_list(),
        "seconds_iteration": sum(walls) / len(walls),  # iterations 2..N: the first also starts the engines
        "seconds_total": ends[-1] - start,  # the 10 iterations and the final eval
    }
    done.write_text(json.dumps(result, indent=1))
    return result


def table(results: list[dict]) -> str:
    def pct(x):
        return "–" if x is None else f"{100 * x:.2f}%"

    lines = [
        "| row | how | greedy accuracy | pass@k | entropy, iteration 1 → 10 | clipped | masked | IS-capped "
        "| response tokens | s an iteration | wall, with the final eval |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['row']} | `{r['algo']}` | {r['accuracy']:.3f} | {r['pass_at_k']:.3f} (k={r['k']}) "
            f"| {r['entropy_first']:.2f} → {r['entropy_last']:.2f} | {pct(r['clip'])} | {pct(r['masked'])} "
            f"| {pct(r['is_capped'])} | {r['response_tokens']:.1f} | {r['seconds_iteration']:.0f} "
            f"| {r['seconds_total']:.0f} s |"
        )
    return "\n".join(lines)


def run() -> list[dict]:
    return run_rows("frontier", ROOT, list(ROWS), measure, table)
