"""A user's job end to end, from the files under examples/word_problems only (no rlpipe source edited or patched):
its script builds chat-formatted prompts in verl's layout offline, `rlpipe init-model` builds a tiny Qwen2 (tied
embeddings) with a byte-level BPE tokenizer and a ChatML template from its recipe, then SFT on its conversations,
2 PPO iterations scored by its own reward file (a critic built on the Qwen2 backbone), and eval, on real vLLM,
DeepSpeed and Prefect."""

import json
import shutil
import subprocess
import sys

import polars as pl
import pytest

from storage import RunLayout
from tests.conftest import ROOT, rlpipe

pytestmark = pytest.mark.e2e

EXAMPLE = "examples/word_problems"
# Sizes for a test on two cores; everything else is the example's own config.
SMALL = [
    "--set",
    "sft.steps=30",
    "--set",
    "rollout.prompts_per_round=16",
    "--set",
    "rollout.group_size=4",
    "--set",
    "batch.target_groups=8",
    "--set",
    "eval.max_prompts=32",
    "--set",
    "rl.iterations=2",
    "--set",
    "rl.eval_every=2",
]


def read(layout: RunLayout, stage: str, iteration: int) -> pl.DataFrame:
    return pl.read_parquet(layout.stage_dir(stage, iteration) / "*.parquet")


def test_the_example_job_runs_from_its_own_files(tmp_path):
    shutil.copytree(ROOT / EXAMPLE, tmp_path / EXAMPLE, ignore=shutil.ignore_patterns("data"))
    config = f"{EXAMPLE}/config.yaml"
    subprocess.run(
        [sys.executable, f"{EXAMPLE}/make_data.py", "--train", "600", "--eval", "64"], cwd=tmp_path, check=True
    )
    rlpipe("init-model", "--config", config, cwd=tmp_path)
    base = json.loads((tmp_path / "models/word-problems-base/config.json").read_text())
    assert base["architectures"] == ["Qwen2ForCausalLM"] and base["tie_word_embeddings"] is True
    assert (tmp_path / "models/word-problems-base/chat_template.jinja").exists()

    rlpipe("sft", config, "--run-id", "wp-sft", *SMALL, cwd=tmp_path)
    sft = RunLayout(tmp_path / "runs", "wp-sft")
    example = read(sft, "sft_data", 0).row(0, named=True)
    assert example["text"].endswith("<|im_start|>assistant\n") and "#### " in example["response"]
    assert read(sft, "sft_metrics", 0).height == 30

    rlpipe("run", config, "--run-id", "wp-ppo", "--algo", "ppo", *SMALL, cwd=tmp_path)
    run = RunLayout(tmp_path / "runs", "wp-ppo")
    prompts = read(run, "prompts", 1)
    assert prompts["text"][0].startswith("<|im_start|>system\nWrite the calculation")  # the config's system prompt
    assert prompts.schema["extra"].fields[0].name == "data_source"  # the dataset's own columns ride along
    scores = read(run, "scores", 1)
    for name in ("correct", "shows_work", "not_repetitive", "accuracy"):  # the user's file, per sample and batched
        assert scores[f"score_{name}"].null_count() == 0 and scores[f"error_{name}"].null_count() == scores.height
    assert (
        scores["reward"] - scores["score_correct"] - 0.1 * (scores["score_shows_work"] + scores["score_not_repetitive"])
    ).abs().max() < 1e-9
    for it in (1, 2):
        metrics = read(run, "train_metrics", it).row(0, named=True)
        assert (
            metrics["weight_sync_logprob_gap"] < 1e-3 and metrics["value_loss"] == metrics["value_loss"]
        )  # tied Qwen2 synced; critic trained
    assert (run.critic_dir(2) / "value_head.safetensors").exists()
    evals = json.loads(run.manifest_path("eval", 2).read_text())["extra"]
    assert (
        evals["prompts"] == 32
        and {"mean_reward", "sampled_mean_reward", "error_rate_correct", "error_rate_not_repetitive"} <= evals.keys()
    )
    summary = json.loads(run.summary_path.read_text())
    assert (
        summary["iterations"] == 2
        and summary["eval_accuracy_start"] is not None
        and summary["eval_accuracy_final"] is not None
    )
