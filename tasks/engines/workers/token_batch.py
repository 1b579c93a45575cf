"""Pure torch helpers shared by the logprobs and training workers: packing and per-token logprobs.

Sequences are prompt + response, right-padded to L. Per-token response values live on the (N, L−1) grid of
next-token predictions: response token j of a sample with prompt length P sits at column P − 1 + j.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def pack(prompts: list[list[int]], responses: list[list[int]], pad_id: int):
    """Return input_ids (N, L), attention_mask (N, L) and response_mask (N, L−1)."""
    n = len(prompts)
    length = max(len(p) + len(r) for p, r in zip(prompts, responses))
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    response_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        seq = p + r
        input_ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
        response_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return input_ids, attention, response_mask


def align(values: list[list[float]], prompt_lens: list[int], width: int) -> torch.Tensor:
    """Place per-response-token values on the (N, width) next-token grid."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompt_lens)):
        if len(v):
            out[i, p - 1 : p - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def unalign(grid: torch.Tensor, prompt_lens: list[int], response_lens: list[int]) -> list[list[float]]:
    rows = grid.detach().float().cpu()
    return [rows[i, p - 1 : p - 1 + r].tolist() for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]


def token_logprobs(model, input_ids, attention_mask, with_entropy: bool = True):
    """log π(x_{t+1} | x_≤t) and the entropy of π(·|x_≤t), both (B, L−1)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]  # (B, L-1, V)
    logits = logits.float()
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # (B, L-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None  # (B, L-1)
    return logp, entropy


@contextmanager
def eval_mode(model):
    """The model in eval mode for the block, then back to its previous mode (a resident engine's module trains)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def chunks(indices: list[int], size: int) -> list[list[int]]:
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def batched(fn, prompts: list[list[int]], responses: list[list[int]], pad_id: int, micro_batch_size: int) -> list:
    """fn(input_ids, attention_mask, response_mask, prompt_lens, response_lens) over micro-batches of the sequences,
    without gradients; the per-sequence results concatenated in order. With several trainer ranks the micro-batches
    are shared among them and every rank gets all the results (tasks/engines/workers/data_parallel.py)."""
    import torch

    from tasks.engines.workers.data_parallel import map_in_order

    def one(idx: list[int]) -> list:
        p, r = [prompts[i] for i in idx], [responses[i] for i in idx]
        ids, attn, mask = pack(p, r, pad_id)
        return fn(ids, attn, mask, [len(x) for x in p], [len(x) for x in r])

    with torch.no_grad():
        return [row for part in map_in_order(one, chunks(list(range(len(prompts))), micro_batch_size)) for row in part]
