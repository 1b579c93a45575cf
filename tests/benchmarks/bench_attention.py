"""Attention over packed groups (`make bench ARGS=attention`): the dense-mask reference and the packed attention
(tasks/engines/workers/packed_attention.py) side by side, in one process, on the demo model (SmolLM2-135M-Instruct,
fp32, `make model`): groups of 8 responses after a 150-token prompt, forward and backward of the policy's logprobs
with gradient checkpointing and the output layer in chunks (as long responses train), timed on one micro-batch of a
token budget of MICRO_TOKENS (optim.micro_batch_tokens, so every length runs micro-batches of 8.3-8.8k tokens: four
groups of 256-token responses, one of 1,024, half a group of 2,048, a quarter of 4,096). The dense path lays groups out
as it did, in rows of up to 1,024 tokens (a longer group a row of its own).

Rows:
- attention_pairs_{n}: (query, key) pairs computed per pair the layout allows, at responses of n tokens: the dense
  mask computes the whole row (L²), the packed attention each segment's triangle (a count, no model run; target ≤ 1.3);
- attention_fwd_bwd_{n}: milliseconds a response token, dense against packed (n = 256 and 1,024; the dense path at
  2,048 and 4,096 would take tens of minutes here, its pair count above says how much more it computes);
- attention_growth: the packed path's milliseconds a token at 4,096-token responses against its own at 256 (target
  ≤ 1.7; causal attention still grows with the segment: the arithmetic alone gives about 1.46×).
"""

from __future__ import annotations

import random
import time
from dataclasses import fields

import torch

from tests.benchmarks.bench_memory import _row

MODEL = "models/smollm2-135m-instruct"
PROMPT, GROUP = 150, 8
LENGTHS = (256, 1024, 2048, 4096)
DENSE_UP_TO = 1024
MICRO_TOKENS = 8800


def _batch(length: int, dense: bool):
    """The first micro-batch of 32,768 response tokens in groups of 8 `length`-token responses under MICRO_TOKENS."""
    from tasks.engines.workers.micro_batches import token_micro_batches
    from tasks.engines.workers.packing import SharedPrefixBatch, pack_shared

    class DenseBatch(SharedPrefixBatch):
        """The reference path: transformers' SDPA under the layout's dense (1, 1, L, L) mask."""

        def model_inputs(self, model) -> dict:
            return {
                "input_ids": self.input_ids,
                "position_ids": self.position_ids,
                "attention_mask": self.dense_mask(),
                "use_cache": False,
            }

    rnd = random.Random(length)
    prompts, responses = [], []
    for _ in range(32768 // (GROUP * length)):
        prompt = [rnd.randrange(100, 40000) for _ in range(PROMPT)]
        prompts += [prompt] * GROUP
        responses += [[rnd.randrange(100, 40000) for _ in range(length)] for _ in range(GROUP)]
    idx = token_micro_batches(list(range(len(prompts))), prompts, responses, MICRO_TOKENS)[0][0]
    batch = pack_shared([prompts[i] for i in idx], [responses[i] for i in idx], 0, 1024 if dense else None)
    return DenseBatch(**{f.name: getattr(batch, f.name) for f in fields(batch)}) if dense else batch


def _ms_per_token(model, length: int, dense: bool) -> float:
    from tasks.engines.workers.token_batch import response_logprobs
    from tasks.engines.workers.training import checkpoint_layers

    batch = _batch(length, dense)
    model.zero_grad(set_to_none=True)
    checkpoint_layers(model)
    t0 = time.perf_counter()
    logp, _ = response_logprobs(model, batch, with_entropy=False)
    (logp * batch.mask).sum().backward()
    ms = 1000 * (time.perf_counter() - t0) / len(batch.targets)
    print(f"attention: {'dense' if dense else 'packed'} at {length}-token responses: {ms:.2f} ms a response token")
    return ms


def run() -> list[dict]:
    from transformers import AutoModelForCausalLM

    import tasks.engines.workers.token_batch as token_batch
    from tasks.engines.workers.packing import pack_shared

    token_batch.LOGITS_AT_ONCE_BYTES = 0  # the output layer in chunks at every length, so only attention differs
    rows = []
    for n in LENGTHS:  # one whole group: the dense path computes its row's every pair
        layout = pack_shared([list(range(3, PROMPT + 3))] * GROUP, [[5] * n] * GROUP, 0).layout
        dense, packed = (PROMPT + GROUP * n) ** 2 / layout.allowed_pairs, layout.computed_pairs / layout.allowed_pairs
        rows.append(_row(f"attention_pairs_{n}", "dense mask", dense, packed, "pairs computed per pair allowed"))
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _ms_per_token(model, 64, dense=False)  # warm-up: first-call allocations and thread pools
    packed = {n: _ms_per_token(model, n, dense=False) for n in LENGTHS}
    for n in (n for n in LENGTHS if n <= DENSE_UP_TO):
        rows.append(_row(f"attention_fwd_bwd_{n}", "dense mask", _ms_per_token(model, n, dense=True), packed[n],
                         "ms a response token, forward + backward (ratio: packed / dense)"))  # fmt: skip
    rows.append(_row("attention_growth", "packed at 256-token responses", packed[256], packed[4096],
                     "ms a response token at 4,096 (ratio: 4,096 / 256; target ≤ 1.7)"))  # fmt: skip
    return rows
