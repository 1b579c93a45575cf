"""End to end against TRL at demo scale: TRL's GRPOTrainer and `rlpipe --algo grpo` on the demo config from the demo SFT
model (a 1M-parameter model, 3-token answers), 10 rounds of 64 prompts × 8 with 2 epochs × 4 minibatches, with the
settings tests/benchmarks/trl_match.py matches, each side in a fresh process timed from its spawn. Accuracy: greedy, on
the 256 held-out prompts, by the same HF generate and the same judge for both final models."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from tests.benchmarks import result_row
from tests.benchmarks.bench_iteration import TINY_CONFIG, ensure_tiny_model
from tests.benchmarks.trl_match import in_fresh_process

ITERATIONS = 10  # × 8 optimizer steps
WORK = Path("runs/bench/trl")
# TRL's sampling: 64 prompts a round, every group trained (no dynamic filtering, no second round).
OVERRIDES = [
    f"storage_root={WORK}",
    "rollout.prompts_per_round=64",
    "batch.target_groups=64",
    "batch.drop_zero_variance=false",
]
BASELINE = "TRL 1.16.0 GRPOTrainer (CPU)"


def greedy_accuracy(model_path: str, held_out: pl.DataFrame, max_tokens: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.rewards.builtin import accuracy

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompts = [tok(t)["input_ids"] for t in held_out["prompt"].to_list()]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attn = (ids != tok.pad_token_id).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=False,
            max_new_tokens=max_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return (
        sum(accuracy(response=t, ground_truth=a) for t, a in zip(texts, held_out["answer"].to_list())) / held_out.height
    )


def run() -> list[dict]:
    from schemas.config import load_config
    from tasks.data.example_tasks import ensure_task_files

    ensure_tiny_model()
    cfg = load_config(TINY_CONFIG, OVERRIDES, "grpo")
    held_out = pl.read_parquet(ensure_task_files(cfg.task)["eval"])
    rl = in_fresh_process("rlpipe", TINY_CONFIG, OVERRIDES, "rlpipe", ITERATIONS)
    trl = in_fresh_process("trl", TINY_CONFIG, OVERRIDES, str(WORK / "trl-model"), ITERATIONS)
    accuracy = {
        name: greedy_accuracy(path, held_out, cfg.rollout.max_tokens)
        for name, path in (("sft", cfg.model.path), ("rlpipe", rl.model), ("trl", trl.model))
    }
    steps = ITERATIONS * cfg.optim.minibatches * cfg.optim.ppo_epochs
    print(
        f"e2e_vs_trl: {steps} optimizer steps each; rlpipe {rl.samples} samples in {rl.wall:.1f}s (start-up "
        f"{rl.startup:.1f}s), "
        f"TRL {trl.samples} samples in {trl.wall:.1f}s (start-up {trl.startup:.1f}s); greedy held-out accuracy "
        f"SFT {accuracy['sft']:.3f}, rlpipe {accuracy['rlpipe']:.3f}, TRL {accuracy['trl']:.3f}"
    )
    return [
        result_row("e2e_vs_trl", BASELINE, trl.samples / trl.wall, rl.samples / rl.wall, "samples/s"),
        result_row("e2e_vs_trl_accuracy", BASELINE, accuracy["trl"], accuracy["rlpipe"], "greedy held-out accuracy"),
    ]
