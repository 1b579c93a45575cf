"""End to end against TRL: TRL's GRPOTrainer (trl==1.16.0, CPU, HF generate) and `rlpipe --algo grpo` on the demo
config, from the same demo SFT model, for the same number of optimizer steps.

Matched settings: the task's train prompts, G = 8, max_tokens = 6, temperature 1, lr 2e-4 with 8 linear warmup steps
then constant, AdamW (0.9, 0.999) without weight decay, grad clip 1, clip ε 0.2, k3 KL to the SFT model with β 0.04
in the loss, token-mean loss over each minibatch (TRL's "dapo"), group-normalised advantages, and per 512 trained
samples 2 epochs × 4 minibatches = 8 optimizer steps; the reward is rlpipe's rule reward (math-verify accuracy +
0.1 × format) on both sides, and 64 prompts a round with every group trained (rlpipe's dynamic filtering off, as
TRL has none). samples/s counts trained samples over the whole
wall time of training, start-up included on both sides (rlpipe: Prefect's API, vLLM and the DeepSpeed trainer;
TRL: loading the policy and the reference). Accuracy: greedy, on the 256 held-out prompts, by the same HF
generate and the same judge for both final models.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import polars as pl

from tests.benchmarks import result_row
from tests.benchmarks.bench_iteration import DEMO_CONFIG, ensure_demo_model

ITERATIONS = 10  # × 8 optimizer steps
WORK = Path("runs/bench/trl")


def rlpipe_training(run_id: str = "rlpipe") -> tuple[float, int, str]:
    """(wall seconds, samples trained, final checkpoint) of `rlpipe --algo grpo` on the demo config."""
    from flows.deployments import prepare_checked_run
    from flows.rl import rl_iteration
    from storage import RunLayout, read_stage
    from tasks.engines.resident import close_all

    shutil.rmtree(WORK / run_id, ignore_errors=True)
    t0 = time.perf_counter()
    # TRL's sampling: 64 prompts a round, every group trained (no dynamic filtering, no second round).
    overrides = [f"storage_root={WORK}", f"rl.iterations={ITERATIONS}", "rollout.prompts_per_round=64",
                 "batch.target_groups=64", "batch.drop_zero_variance=false"]
    root = prepare_checked_run(DEMO_CONFIG, overrides, run_id, "grpo")
    try:
        for k in range(1, ITERATIONS + 1):
            rl_iteration(run_id, k, root)
    finally:
        close_all()
    wall = time.perf_counter() - t0
    layout = RunLayout(Path(root), run_id)
    samples = sum(int(read_stage(layout, "train_metrics", k)["samples"][0]) for k in range(1, ITERATIONS + 1))
    return wall, samples, str(layout.checkpoint_dir(ITERATIONS))


def trl_training(model_path: str, train: pl.DataFrame) -> tuple[float, int, str]:
    """(wall seconds, samples trained, saved model folder) of TRL's GRPOTrainer with the matched settings."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tasks.rewards.builtin import accuracy, format_ok

    out = WORK / "trl-model"
    shutil.rmtree(out, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = tokenizer.eos_token_id

    def accuracy_reward(prompts, completions, answer, **_):
        return [accuracy(response=c, ground_truth=a) for c, a in zip(completions, answer)]

    def format_reward(prompts, completions, completion_ids, **_):  # "stop" only when it emitted EOS
        return [format_ok(response=c, finish_reason="stop" if eos in ids else "length") for c, ids in zip(completions, completion_ids)]

    minibatch, minibatches, epochs, group = 128, 4, 2, 8
    args = GRPOConfig(
        output_dir=str(WORK / "trl-out"), use_cpu=True, seed=0, report_to="none", save_strategy="no", logging_steps=8,
        learning_rate=2e-4, lr_scheduler_type="constant_with_warmup", warmup_steps=8, weight_decay=0.0,
        max_grad_norm=1.0, per_device_train_batch_size=minibatch, gradient_accumulation_steps=1,
        steps_per_generation=minibatches, num_iterations=epochs, num_generations=group, max_completion_length=6,
        temperature=1.0, top_p=1.0, top_k=0, beta=0.04, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        max_steps=ITERATIONS * minibatches * epochs, reward_weights=[1.0, 0.1], remove_unused_columns=False,
        bf16=False, dataloader_num_workers=0,
    )
    dataset = Dataset.from_dict({"prompt": train["prompt"].to_list(), "answer": train["answer"].to_list()})
    t0 = time.perf_counter()
    trainer = GRPOTrainer(model=model_path, reward_funcs=[accuracy_reward, format_reward], args=args,
                          train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    wall = time.perf_counter() - t0
    trainer.save_model(str(out))
    tokenizer.save_pretrained(out)
    return wall, ITERATIONS * minibatch * minibatches, str(out)


def greedy_accuracy(model_path: str, held_out: pl.DataFrame) -> float:
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
        out = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=6,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(accuracy(response=t, ground_truth=a) for t, a in zip(texts, held_out["answer"].to_list())) / held_out.height


def run() -> list[dict]:
    from schemas.config import load_config
    from tasks.data.example_tasks import ensure_task_files

    ensure_demo_model()
    cfg = load_config(DEMO_CONFIG)
    files = ensure_task_files(cfg.task)
    train, held_out = pl.read_parquet(files["train"]), pl.read_parquet(files["eval"])
    rl_wall, rl_samples, rl_model = rlpipe_training()
    trl_wall, trl_samples, trl_model = trl_training(cfg.model.path, train)
    accuracy = {name: greedy_accuracy(path, held_out) for name, path in
                (("sft", cfg.model.path), ("rlpipe", rl_model), ("trl", trl_model))}
    print(f"e2e_vs_trl: {ITERATIONS * 8} optimizer steps each; rlpipe {rl_samples} samples in {rl_wall:.1f}s, "
          f"TRL {trl_samples} samples in {trl_wall:.1f}s; greedy held-out accuracy SFT {accuracy['sft']:.3f}, "
          f"rlpipe {accuracy['rlpipe']:.3f}, TRL {accuracy['trl']:.3f}")
    row = result_row("e2e_vs_trl", "TRL 1.16.0 GRPOTrainer (CPU)", trl_samples / trl_wall, rl_samples / rl_wall, "samples/s")
    return [row, result_row("e2e_vs_trl_accuracy", "TRL 1.16.0 GRPOTrainer (CPU)", accuracy["trl"], accuracy["rlpipe"],
                            "greedy held-out accuracy")]
