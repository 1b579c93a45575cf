"""Sync probe: the trainer's logprobs on a few fixed sequences, saved next to every policy checkpoint, so the
sampler can check an in-place weight sync against them (DESIGN §4: vLLM's in-place reload has been wrong
before, silently).

`sync_probe.json` = {"token_ids": [[...], ...], "logprobs": [[...], ...]}: logprobs[i][t] is
log π(token_ids[i][t+1] | token_ids[i][:t+1]). No Prefect import: the trainer and vLLM workers load this.
"""

from __future__ import annotations

import json
import os

PROBE_FILE = "sync_probe.json"
PROBE_LENGTHS = (8, 12, 16, 24)  # within every context window we train; a handful of sequences is enough


def probe_token_ids(vocab_size: int, max_positions: int, seed: int = 0) -> list[list[int]]:
    """Fixed pseudo-random token sequences (any ids: a logprob comparison needs no meaningful text)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = [min(n, max_positions) for n in PROBE_LENGTHS]
    return [torch.randint(vocab_size, (n,), generator=g).tolist() for n in lengths]


def trainer_logprobs(model, token_ids: list[list[int]]) -> list[list[float]]:
    import torch

    from tasks.engines.workers.token_batch import eval_mode, token_logprobs

    with eval_mode(model), torch.no_grad():  # one sequence at a time: no padding, the same positions vLLM scores
        return [token_logprobs(model, torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long), with_entropy=False)[0][0].tolist()
                for seq in token_ids]


def write_probe(model, out_dir: str) -> None:
    """Save the probe for a causal LM (a reward model has no token logprobs and gets none)."""
    if not hasattr(model, "lm_head"):
        return
    cfg = model.config
    ids = probe_token_ids(cfg.vocab_size, getattr(cfg, "max_position_embeddings", 64))
    with open(os.path.join(out_dir, PROBE_FILE), "w") as f:
        json.dump({"token_ids": ids, "logprobs": trainer_logprobs(model, ids)}, f)


def read_probe(model_dir: str) -> dict | None:
    path = os.path.join(model_dir, PROBE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def mean_abs_gap(a: list[list[float]], b: list[list[float]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(abs(x - y) for x, y in pairs) / max(len(pairs), 1)
