"""Logprobs worker: old (policy before this update) and ref logprobs, and entropy, recomputed by torch; a
distillation teacher's logprobs of the same tokens when the request names one.

Request: schemas.requests.LogprobsRequest; the samples file holds prompt_id, sample_idx, prompt_token_ids, token_ids.
Run as a one-shot worker, or inside the resident trainer (tasks/engines/workers/trainer_server.py). Writes prompt_id,
sample_idx, old_logprobs, ref_logprobs, entropy and values (list<float32>; values null without a critic), and
teacher_logprobs with a teacher."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext

import polars as pl
import torch

from schemas.requests import LogprobsRequest
from tasks.engines.launch import peak_rss_gib
from tasks.engines.workers import data_parallel
from tasks.engines.workers.critic import load_critic, token_values
from tasks.engines.workers.lora import base_path_of, load_causal_lm
from tasks.engines.workers.token_batch import batched, batched_responses, eval_mode


def _score(model, prompts, responses, pad_id, micro, with_entropy, totals, micro_tokens=None, temperature=1.0):
    return batched_responses(
        model,
        prompts,
        responses,
        pad_id,
        micro,
        with_entropy,
        totals,
        micro_tokens=micro_tokens,
        temperature=temperature,
    )  # each group's prompt computed once


def _values(critic, prompts, responses, pad_id, micro, micro_tokens=None):
    return batched(
        lambda batch, lens: [row[:n] for row, n in zip(token_values(critic, batch).tolist(), lens)],
        prompts,
        responses,
        pad_id,
        micro,
        micro_tokens=micro_tokens,
    )


def _pad_id(model) -> int:
    return model.config.pad_token_id if model.config.pad_token_id is not None else 0


def load_lm(path: str, dtype: str):
    """A causal LM for forward passes only (the reference, the starting policy): a model folder, or an adapter
    checkpoint on its base model."""

    return load_causal_lm(path, dtype).eval()


@contextmanager
def scoring(model, adapter_off: bool):
    """The model in eval mode, with its LoRA adapter switched off when `adapter_off` (then it is its base model)."""

    with eval_mode(model), model.disable_adapter() if adapter_off else nullcontext():
        yield model


def handle(request: LogprobsRequest, cache=None) -> dict:
    """One request. With `cache` (the resident trainer's EngineCache), the policy and critic come from the engines
    that wrote their checkpoints and the reference is loaded once, so no weights are read from disk in steady state."""

    torch.manual_seed(0)
    samples = pl.read_parquet(request.samples_path)
    prompts = samples["prompt_token_ids"].to_list()
    responses = samples["token_ids"].to_list()
    micro, tokens, temp = request.micro_batch_size, request.micro_batch_tokens, request.temperature
    policy_path, ref_path = request.policy_path, request.ref_path

    def model_at(role, path, frozen, load=None):
        """(model, adapter_off) for `path`. role: the trainer engine that may hold it (None for the reference)."""
        kept = cache.engine_module(role, path) if cache and role else None
        if kept is not None:
            return kept, False
        # LoRA: a causal LM that is the base model of a kept engine is that engine's model with its adapter off.
        host = cache.adapter_host(path) if cache and role != "critic" else None
        if host is not None:
            return host, True
        load = load or (lambda: load_lm(path, request.dtype))
        return (cache.frozen(path, load) if cache and frozen else load()), False

    t0 = time.time()
    forward, counts = 0.0, {}
    policy = None
    if request.old_from_sampler:  # π_old is vLLM's: no policy pass, so no entropy either
        old, entropy = samples["sampler_logprobs"].to_list(), [[] for _ in responses]
    else:  # the starting policy is the reference: kept frozen. Later policies come from the trainer's engine.
        policy, off = model_at("policy", policy_path, frozen=policy_path == ref_path)
        t1 = time.time()
        with scoring(policy, off):
            old, entropy = _score(policy, prompts, responses, _pad_id(policy), micro, True, counts, tokens, temp)
        forward += time.time() - t1
    if not request.with_ref:
        ref = None
    elif ref_path == policy_path and policy is not None:
        ref = old  # iteration 1: the policy is the reference, no second pass needed
    else:
        if policy is not None and base_path_of(policy) == os.path.abspath(ref_path):  # LoRA: the policy, adapter off
            ref_model, off = policy, True
        else:
            del policy
            ref_model, off = model_at(None, ref_path, frozen=True)
        t1 = time.time()
        with scoring(ref_model, off):
            ref, _ = _score(ref_model, prompts, responses, _pad_id(ref_model), micro, False, counts, tokens, temp)
        forward += time.time() - t1
    teacher = None
    if request.teacher_path:  # frozen, as the reference: loaded once by a resident trainer
        teacher_model, _ = model_at(None, request.teacher_path, frozen=True)
        t1 = time.time()
        with scoring(teacher_model, False):
            teacher, _ = _score(teacher_model, prompts, responses, _pad_id(teacher_model), micro, False, counts, tokens)
        forward += time.time() - t1
    values = None
    if request.critic_path:
        critic_path, fresh = request.critic_path, request.critic_fresh
        critic = (
            load_critic(critic_path, True, request.dtype)
            if fresh
            else model_at("critic", critic_path, False, lambda: load_critic(critic_path, False, request.dtype))[0]
        )
        t1 = time.time()
        with eval_mode(critic):
            values = _values(critic, prompts, responses, _pad_id(critic), micro, tokens)
        forward += time.time() - t1
    counts = data_parallel.sum_over_ranks(
        counts
    )  # the policy passes' work, over the ranks (the critic's is not counted)
    if data_parallel.rank() != 0:  # every rank holds all the rows; one writes them
        return {}
    _write(samples, request.out_path, old, ref, entropy, values, teacher)
    return {"forward_seconds": forward, "logprobs_seconds": time.time() - t0, "peak_rss_gib": peak_rss_gib(), **counts}


def _write(samples: pl.DataFrame, out_path: str, old, ref, entropy, values, teacher) -> None:
    """The logprobs table: a row per sample; ref_logprobs and values null where no pass computed them, and
    teacher_logprobs only with a teacher."""
    lst = pl.List(pl.Float32)
    samples.select("prompt_id", "sample_idx").with_columns(
        pl.Series("old_logprobs", old, dtype=lst),
        pl.Series("ref_logprobs", ref if ref is not None else [None] * samples.height, dtype=lst),
        pl.Series("entropy", entropy, dtype=lst),
        pl.Series("values", values if values is not None else [None] * samples.height, dtype=lst),
        *([pl.Series("teacher_logprobs", teacher, dtype=lst)] if teacher is not None else []),
    ).write_parquet(out_path)
