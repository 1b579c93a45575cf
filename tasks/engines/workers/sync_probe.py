"""Sync probe: the trainer's logprobs on a few fixed sequences, saved next to every policy checkpoint, so the
sampler can check an in-place weight sync against them (vLLM's in-place reload has been wrong
before, silently).

`sync_probe.json` = {"token_ids": [[...], ...], "logprobs": [[...], ...]}: logprobs[i][t] is
log π(token_ids[i][t+1] | token_ids[i][:t+1]). No Prefect import: the trainer and vLLM workers load this.
Imports: torch is imported inside the functions that compute: the vLLM client reads probes in the Prefect process.
"""

from __future__ import annotations

import json
import os

PROBE_FILE = "sync_probe.json"
PROBE_LENGTHS = (8, 12, 16, 24)  # within every context window we train; a handful of sequences is enough


PROBE_TEXT = "The quick brown fox, 12+34=46; \\boxed{7} #### 8388. Question: what is 7*6? Answer: 42."


def probe_token_ids(tokenizer, max_positions: int, seed: int = 0) -> list[list[int]]:
    """Fixed token sequences in the model's own vocabulary: the tokenizer's encoding of a fixed text, topped up with
    seeded random ids below the tokenizer's size (a config's vocab_size may count untrained padding rows)."""
    import torch

    text_ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (min(n, max_positions) for n in PROBE_LENGTHS):
        filler = torch.randint(len(tokenizer), (n,), generator=g).tolist()
        out.append((text_ids + filler)[:n] if len(out) % 2 == 0 else filler)  # half text, half random
    return out


def trainer_logprobs(model, token_ids: list[list[int]]) -> list[list[float]]:
    import torch

    from tasks.engines.workers.token_batch import eval_mode, token_logprobs

    with eval_mode(model), torch.no_grad():  # one sequence at a time: no padding, the same positions vLLM scores
        return [
            token_logprobs(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), with_entropy=False)[
                0
            ][0].tolist()
            for seq in token_ids
        ]


def write_probe(model, tokenizer, out_dir: str, write: bool = True) -> None:
    """Save the probe for a causal LM (a reward model or a critic has no token logprobs and gets none). Every trainer
    rank computes it (a ZeRO-3 forward needs them all); only the one with `write` saves it."""
    if not hasattr(model, "lm_head"):
        return
    ids = probe_token_ids(tokenizer, getattr(model.config, "max_position_embeddings", 64) or 64)
    logprobs = trainer_logprobs(model, ids)
    if write:
        with open(os.path.join(out_dir, PROBE_FILE), "w") as f:
            json.dump({"token_ids": ids, "logprobs": logprobs}, f)


def read_probe(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, PROBE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def mean_abs_gap(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(abs(x - y) for x, y in pairs) / max(len(pairs), 1)
