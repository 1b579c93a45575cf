"""Multi-turn trajectories: the tokens of tool results and environment messages are context, not actions. With an
`action_mask`, the DeepSpeed trainer's update ignores whatever the training frame says about them (their advantages,
their old and reference logprobs), on a tiny model, by the real trainer worker."""

import random

import polars as pl
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from schemas.requests import LossSettings, UpdateRequest
from tasks.data.model_recipe import char_tokenizer
from tasks.engines.resident import ResidentProcess
from tasks.engines.workers import TRAIN_WORKER
from tests.conftest import engine_settings


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    path = tmp_path_factory.mktemp("policy")
    tok = char_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path, len(tok)


def trajectories(vocab: int) -> pl.DataFrame:
    """Two groups of four samples: per sample, a model turn (5 tokens), an observation (4), a model turn (3)."""
    rnd = random.Random(0)
    rows = []
    for g in range(2):
        prompt = [rnd.randrange(4, vocab) for _ in range(4)]
        for k in range(4):
            tokens = [rnd.randrange(4, vocab) for _ in range(12)]
            rows.append(
                {
                    "prompt_id": f"p{g}",
                    "sample_idx": k,
                    "prompt_token_ids": prompt,
                    "token_ids": tokens,
                    "old_logprobs": [-2.0 - 0.1 * t for t in range(12)],
                    "ref_logprobs": [-2.1 - 0.1 * t for t in range(12)],
                    "token_advantages": [(1.0 if k % 2 else -1.0)] * 12,
                    "loss_mask": 1.0,
                    "action_mask": [1] * 5 + [0] * 4 + [1] * 3,
                }
            )
    return pl.DataFrame(rows)


def scrambled_observations(df: pl.DataFrame) -> pl.DataFrame:
    """What the frame says about the observation tokens (positions 5-8) replaced by large random values."""
    rnd = random.Random(1)

    def scramble(values: list[float]) -> list[float]:
        return [rnd.uniform(-30, 30) if 5 <= t < 9 else v for t, v in enumerate(values)]

    return df.with_columns(
        pl.Series(name, [scramble(v) for v in df[name].to_list()])
        for name in ("old_logprobs", "ref_logprobs", "token_advantages")
    )


def update(trainer: ResidentProcess, policy, frame: pl.DataFrame, out) -> dict:
    out.mkdir()
    frame.write_parquet(out / "frame.parquet")
    request = UpdateRequest(
        model_path=str(policy),
        tmp_dir=str(out / "ckpt"),
        data_path=str(out / "frame.parquet"),
        resume_state=None,
        seed=0,
        engine=engine_settings(zero_stage=0, lr=1e-2, micro_batch_size=4),
        ppo_epochs=1,
        minibatches=1,
        warmup_steps=0,
        first_step=0,
        loss=LossSettings(kl_beta=0.1, max_tokens=16),
        critic=None,
        ptx=None,
        crash_point="",
    )
    trainer.call(request)
    return load_file(out / "ckpt" / "model.safetensors")


def test_observation_tokens_get_no_loss_from_what_the_frame_says_about_them(tiny_policy, tmp_path):
    policy, vocab = tiny_policy
    frame = trajectories(vocab)
    # One trainer process answers the three updates, as a run's resident trainer answers its iterations: each
    # request builds its engine from the request alone.
    trainer = ResidentProcess(TRAIN_WORKER, tmp_path / "train.log")
    try:
        first = update(trainer, policy, frame, tmp_path / "a")
        scrambled = update(trainer, policy, scrambled_observations(frame), tmp_path / "b")
        # Without the mask the same scrambled values move the update: the comparison below can fail.
        unmasked = update(trainer, policy, scrambled_observations(frame).drop("action_mask"), tmp_path / "c")
    finally:
        trainer.kill()
    assert all(torch.equal(first[k], scrambled[k]) for k in first)  # the observations' loss terms weigh nothing
    assert max(float((first[k] - unmasked[k]).abs().max()) for k in first) > 1e-4
    start = load_file(policy / "model.safetensors")
    assert max(float((first[k] - start[k]).abs().max()) for k in first) > 1e-4  # and it did train
