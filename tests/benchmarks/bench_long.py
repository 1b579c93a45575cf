"""End to end against TRL where generation dominates (`make bench ARGS=e2e_long`): infra/configs/bench_long.yaml, the
long_addition prompts with the ~20M-parameter bench Llama and responses forced past 128 tokens (rollout.min_tokens;
TRL: min_new_tokens), 16 prompts × 8 a round, 1 epoch × 2 minibatches, k3 KL in the loss, with the settings
tests/benchmarks/trl_match.py matches, each side in a fresh process timed from its spawn. The model comes straight
from its recipe: it has not learned the task, and both sides start from the same weights, so this measures
throughput, not learning.

Rows: e2e_long_vs_trl (samples/s; also generated tokens/s), e2e_long_settings_vs_trl (rlpipe again, with the
settings docs/long-responses.md gives for long answers: LONG_SETTINGS), startup_seconds (each side's one-off cost:
the first round's wall minus the median of the later rounds'; ratio rlpipe's / TRL's) and iteration_overhead_long
(the fraction of rlpipe's iterations after the first spent outside generation and forward/backward passes).
"""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks import result_row
from tests.benchmarks.trl_match import in_fresh_process

CONFIG = "infra/configs/bench_long.yaml"
# What docs/long-responses.md has a user pick for long answers, where they apply here: π_old from the (fp32) sampler,
# micro-batches by tokens (about today's 64 samples of ~180 tokens). Not partial rollouts: the responses are forced to
# 128-160 tokens, so there is no tail for them to cut.
LONG_SETTINGS = [
    "loss.old_logprobs=sampler",
    "optim.micro_batch_tokens=12288",
    "optim.logprob_micro_batch_tokens=24576",
]
ITERATIONS = 6
BASELINE = "TRL 1.16.0 GRPOTrainer (CPU)"


def ensure_bench_model() -> None:
    from schemas.config import load_config
    from tasks.data.example_tasks import ensure_task_files
    from tasks.data.model_recipe import init_model

    cfg = load_config(CONFIG)
    ensure_task_files(cfg.task)
    init_model(cfg.model.recipe, cfg.model.base_path)


def run() -> list[dict]:
    from schemas.config import load_config

    ensure_bench_model()
    root = Path(load_config(CONFIG).storage_root)
    rl = in_fresh_process("rlpipe", CONFIG, [], "rlpipe", ITERATIONS)
    trl = in_fresh_process("trl", CONFIG, [], str(root / "trl-model"), ITERATIONS)
    tuned = in_fresh_process("rlpipe", CONFIG, LONG_SETTINGS, "rlpipe-long-settings", ITERATIONS)
    for name, side in (("rlpipe", rl), ("TRL", trl), ("rlpipe, long-answer settings", tuned)):
        print(
            f"e2e_long {name}: {side.samples} samples, {side.tokens} generated tokens "
            f"({side.tokens / side.samples:.1f} a "
            f"response) in {side.wall:.1f}s = {side.samples / side.wall:.2f} samples/s, "
            f"{side.tokens / side.wall:.0f} tokens/s; "
            f"start-up {side.startup:.1f}s; round ends {[round(t, 1) for t in side.round_ends]}"
        )
    print("e2e_long: the model has not learned the task (random weights from its recipe); both sides start from it.")
    return [
        result_row("e2e_long_vs_trl", BASELINE, trl.samples / trl.wall, rl.samples / rl.wall, "samples/s"),
        result_row(
            "e2e_long_settings_vs_trl", BASELINE, trl.samples / trl.wall, tuned.samples / tuned.wall, "samples/s"
        ),
        result_row(
            "e2e_long_tokens_vs_trl", BASELINE, trl.tokens / trl.wall, rl.tokens / rl.wall, "generated tokens/s"
        ),
        # These two rows' ratio is rlpipe's own figure against its target (lower is better), not an advantage.
        {
            "benchmark": "startup_seconds",
            "baseline": BASELINE,
            "baseline_value": trl.startup,
            "rlpipe_value": rl.startup,
            "unit": "seconds (ratio: rlpipe's / TRL's)",
            "ratio": rl.startup / trl.startup,
        },
        {
            "benchmark": "iteration_overhead_long",
            "baseline": "target",
            "baseline_value": 0.15,
            "rlpipe_value": rl.overhead,
            "unit": "fraction of iteration wall",
            "ratio": rl.overhead,
        },
    ]
