"""optim.micro_batch_tokens in the real update loop: the DeepSpeed engine, the trainer's own micro-step
(policy_update.PolicyUpdate), one optimizer step's gradient with token-budget micro-batches against sample-count ones,
for every aggregation mode, on one rank and on two (gloo, each rank its own process, gradients averaged by DeepSpeed).
Samples stay whole and every aggregation divides by the minibatch's normalisers, so the two must agree to float
rounding (1e-6 relative)."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = r"""
import copy, json, os, random
from types import SimpleNamespace

import polars as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from schemas.config import LossConfig
from schemas.requests import EngineSettings, LossSettings
from tasks.algos.losses import AGGREGATIONS
from tasks.engines.workers import data_parallel
from tasks.engines.workers.micro_batches import groups_of
from tasks.engines.workers.policy_update import PolicyUpdate
from tasks.engines.workers.training import deepspeed_engine

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=128)
base = LlamaForCausalLM(cfg)
rnd = random.Random(0)
rows = []
for g in range(5):  # 5 groups of 3, responses of 1 to 30 tokens (a long tail)
    prompt = [rnd.randrange(1, 40) for _ in range(rnd.randint(2, 6))]
    for _ in range(3):
        n = rnd.choice([1, 3, 8, 30])
        rows.append({
            "prompt_token_ids": prompt, "token_ids": [rnd.randrange(1, 40) for _ in range(n)],
            "old_logprobs": [-rnd.random() * 3 for _ in range(n)],
            "ref_logprobs": [-rnd.random() * 3 for _ in range(n)],
            "sampler_logprobs": [-rnd.random() * 3 for _ in range(n)],
            "token_advantages": [rnd.uniform(-1, 1)] * n, "loss_mask": 0.0 if len(rows) == 4 else 1.0,
            "action_mask": [int(j % 5 != 2) for j in range(n)],  # some tokens are context, not actions
        })
data = pl.DataFrame(rows)
tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=0)
out = {}
cases = [(aggregation, budget, None) for aggregation in sorted(AGGREGATIONS) for budget in (None, 40)]
for aggregation, budget, mask_threshold in cases + [("token-mean", 40, 0.3)]:  # the last: off-policy masking on
    settings = EngineSettings(zero_stage=0, lr=1e-3, weight_decay=0.0, grad_clip=1e9, micro_batch_size=2,
                              dtype="float32", gradient_checkpointing=False, lora=None, micro_batch_tokens=budget)
    loss = LossSettings(loss=LossConfig(aggregation=aggregation, clip_eps_high=0.28,
                                        off_policy_mask_threshold=mask_threshold),
                        kl_beta=0.04, entropy_coef=0.01, max_tokens=30)
    update = PolicyUpdate(SimpleNamespace(loss=loss, engine=settings), tokenizer, data)
    engine, _ = deepspeed_engine(copy.deepcopy(base), settings, gas=4)
    grads, step = [], engine.step

    def record():
        if engine.is_gradient_accumulation_boundary():  # the ranks' averaged gradient, before the step
            grads.append(torch.cat([p.grad.detach().flatten().clone() for p in engine.module.parameters()]))
        step()

    engine.step = record
    minibatch = [i for group in groups_of(list(range(data.height)), update.prompts) for i in group]
    norm, parts = update.norm(minibatch), update.micro_batches(minibatch, 4)
    for k, idx, scale in data_parallel.micro_steps(minibatch, parts):
        engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
        update.micro_step(engine, idx, norm, None, scale)
    out[f"{aggregation}/{budget}" + (f"/masked{mask_threshold}" if mask_threshold else "")] = {
        "grad": grads[-1].tolist(), "parts": parts, "loss": update.totals["loss"],
        "masked": update.totals.get("off_policy_masked_fraction", 0.0) / update.totals["tokens"],
    }
if data_parallel.rank() == 0:
    print("RESULT " + json.dumps(out))
"""


def run_ranks(world: int, tmp_path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    for rank in range(world):
        rank_env = dict(env)
        if world > 1:
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo")
            rank_env["RLPIPE_RENDEZVOUS"] = f"file://{tmp_path}/rendezvous"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", SCRIPT], env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    line = next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("world", [1, 2])
def test_token_budget_micro_batches_give_the_sample_count_gradient(world, tmp_path):
    import torch

    from tasks.algos.losses import AGGREGATIONS

    out = run_ranks(world, tmp_path)
    for aggregation in sorted(AGGREGATIONS):
        by_samples, by_tokens = out[f"{aggregation}/None"], out[f"{aggregation}/40"]
        assert by_samples["parts"] != by_tokens["parts"]  # the two really split the minibatch differently
        a, b = torch.tensor(by_samples["grad"]), torch.tensor(by_tokens["grad"])
        assert a.abs().max() > 0
        assert float((a - b).abs().max() / a.abs().max()) <= 1e-6, aggregation
    # The off-policy sequence mask through the same loop: some responses masked, so another loss (their tokens are
    # clipped here, far from π_old, so the gradient is the same).
    masked = out["token-mean/40/masked0.3"]
    assert 0 < masked["masked"] < 1 and masked["loss"] != pytest.approx(out["token-mean/40"]["loss"], rel=1e-3)
