"""Logprobs worker: old (policy before this update) and ref logprobs, and entropy, recomputed by torch.

Request: policy_path, ref_path, samples_path (prompt_id, sample_idx, prompt_token_ids, token_ids), out_path,
micro_batch_size; optional critic_path and critic_fresh (PPO). Writes prompt_id, sample_idx, old_logprobs,
ref_logprobs, entropy and values (list<float32>; values null without a critic).
"""

from __future__ import annotations

import time

from tasks.engines.launch import worker_main


def _score(model, prompts, responses, pad_id, micro, with_entropy):
    import torch

    from tasks.engines.token_batch import chunks, pack, token_logprobs, unalign

    logps, ents = [], []
    with torch.no_grad():
        for idx in chunks(list(range(len(prompts))), micro):
            p = [prompts[i] for i in idx]
            r = [responses[i] for i in idx]
            ids, attn, _ = pack(p, r, pad_id)
            lp, ent = token_logprobs(model, ids, attn, with_entropy)
            plen, rlen = [len(x) for x in p], [len(x) for x in r]
            logps += unalign(lp, plen, rlen)
            ents += unalign(ent, plen, rlen) if with_entropy else [[] for _ in idx]
    return logps, ents


def _values(critic, prompts, responses, pad_id, micro):
    import torch

    from tasks.engines.critic import token_values
    from tasks.engines.token_batch import chunks, pack, unalign

    out = []
    with torch.no_grad():
        for idx in chunks(list(range(len(prompts))), micro):
            p, r = [prompts[i] for i in idx], [responses[i] for i in idx]
            ids, attn, _ = pack(p, r, pad_id)
            out += unalign(token_values(critic, ids, attn), [len(x) for x in p], [len(x) for x in r])
    return out


def handle(request: dict) -> dict:
    import polars as pl
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    samples = pl.read_parquet(request["samples_path"])
    prompts = samples["prompt_token_ids"].to_list()
    responses = samples["token_ids"].to_list()
    micro = request.get("micro_batch_size", 64)
    t0 = time.time()
    policy = AutoModelForCausalLM.from_pretrained(request["policy_path"], dtype=torch.float32).eval()
    pad_id = policy.config.pad_token_id if policy.config.pad_token_id is not None else 0
    old, entropy = _score(policy, prompts, responses, pad_id, micro, True)
    if request["ref_path"] == request["policy_path"]:
        ref = old  # iteration 1: the policy is the reference, no second pass needed
    else:
        del policy
        ref_model = AutoModelForCausalLM.from_pretrained(request["ref_path"], dtype=torch.float32).eval()
        ref, _ = _score(ref_model, prompts, responses, pad_id, micro, False)
    values = None
    if request.get("critic_path"):
        from tasks.engines.critic import load_critic

        critic = load_critic(request["critic_path"], request.get("critic_fresh", False)).eval()
        values = _values(critic, prompts, responses, pad_id, micro)
    lst = pl.List(pl.Float32)
    samples.select("prompt_id", "sample_idx").with_columns(
        pl.Series("old_logprobs", old, dtype=lst),
        pl.Series("ref_logprobs", ref, dtype=lst),
        pl.Series("entropy", entropy, dtype=lst),
        pl.Series("values", values if values is not None else [None] * samples.height, dtype=lst),
    ).write_parquet(request["out_path"])
    return {"forward_seconds": time.time() - t0}


if __name__ == "__main__":
    worker_main(handle)
