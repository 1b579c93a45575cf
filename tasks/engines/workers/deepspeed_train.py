"""DeepSpeed trainer worker: SFT steps (SFTRequest) or one RL policy update (UpdateRequest), then a checkpoint.

The checkpoint folder (written under the request's tmp_dir, renamed into place by the caller's storage layer) holds
HF safetensors + tokenizer (what vLLM loads), `sync_probe.json` (the trainer's logprobs that the sampler checks its
weight sync against), `ds_state/` (optimizer state) and `trainer_state.json` (the id a resident trainer reuses its
engine by, tasks/engines/workers/engine_cache.py), plus `critic/` (the same) for PPO. The policy's loss on one
micro-batch is tasks/engines/workers/policy_update.py's.
No Prefect import: this runs in its own process.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import deepspeed
import polars as pl
import torch
from transformers import AutoTokenizer

from schemas.requests import CriticRequest, EngineSettings, LoraSettings, SFTRequest, UpdateRequest
from storage.crash import crash_point
from tasks.algos.losses import value_loss
from tasks.data.formatting import pad_id
from tasks.engines.launch import peak_rss_gib
from tasks.engines.workers import data_parallel
from tasks.engines.workers.critic import load_critic, token_values
from tasks.engines.workers.lora import adapter_stats, is_peft, load_causal_lm
from tasks.engines.workers.micro_batches import groups_of
from tasks.engines.workers.packing import pack_shared
from tasks.engines.workers.policy_update import PolicyUpdate
from tasks.engines.workers.token_batch import align_responses, response_logprobs
from tasks.engines.workers.training import (
    Progress,
    accumulation_steps,
    checkpoint_layers,
    deepspeed_engine,
    save_checkpoint,
    supervised_steps,
)


def load_policy(path: str, lora: LoraSettings | None = None):
    """The policy to train, in fp32 (DeepSpeed's bf16 keeps fp32 master weights): every weight, or with `lora` an
    adapter on the frozen model (a new one on a plain folder, the saved one on an adapter checkpoint)."""
    model = load_causal_lm(path, "float32", lora, trainable=lora is not None)
    model.config.use_cache = False
    return model


def _sft(request: SFTRequest, model, tokenizer):
    """Token-mean NLL of the response tokens over each whole batch, accumulated over micro-batches."""

    data = pl.read_parquet(request.data_path)
    prompts, responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
    s = request.schedule
    engine, optimizer = deepspeed_engine(model, request.engine, accumulation_steps(s, request.engine.micro_batch_size))
    rows, progress = [], Progress("sft", s.steps)
    for step, lr, batch, parts in supervised_steps(
        s, optimizer, request.engine.lr, len(prompts), request.seed, request.engine.micro_batch_size
    ):
        total_tokens = sum(len(responses[i]) for i in batch)
        loss_sum = 0.0
        for k, idx, scale in data_parallel.micro_steps(batch, parts):
            packed = pack_shared([prompts[i] for i in idx], [responses[i] for i in idx], pad_id(tokenizer))
            logp, _ = response_logprobs(engine, packed, with_entropy=False)  # (B, R): logits for response tokens only
            loss = -(logp * packed.mask).sum() / total_tokens  # token-mean over the whole batch
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss * scale, scale_wrt_gas=False)
            engine.step()
            loss_sum += float(loss.detach()) if scale else 0.0
        loss_sum = data_parallel.sum_over_ranks({"loss": loss_sum})["loss"]
        rows.append({"step": step, "loss": loss_sum, "lr": lr})
        progress.step(step + 1, {"loss": loss_sum})
    return engine, pl.DataFrame(rows, schema={"step": pl.Int32, "loss": pl.Float64, "lr": pl.Float64})


class _Ptx:
    """PPO-ptx: a batch of SFT demonstrations per optimizer step, γ_ptx · token-mean NLL."""

    def __init__(self, request: UpdateRequest, tokenizer):
        data = pl.read_parquet(request.ptx.data_path)
        self.prompts, self.responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
        self.coef, self.batch, self.pad = request.ptx.coef, request.ptx.batch, pad_id(tokenizer)
        self.gen = torch.Generator().manual_seed(request.seed)

    def loss(self, engine):
        idx = torch.randint(len(self.prompts), (self.batch,), generator=self.gen).tolist()
        packed = pack_shared([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.pad)
        logp, _ = response_logprobs(engine, packed, with_entropy=False)  # (B, R)
        return -self.coef * (logp * packed.mask).sum() / packed.mask.sum().clamp_min(1.0)


def _kept_or_new_engine(
    cache, role: str, model_path: str, resume_state: str | None, settings: EngineSettings, gas: int, load_model
):
    """(engine, optimizer) starting from `model_path` + `resume_state`: the resident trainer's kept engine when it holds
    exactly that state with the same settings, else `load_model()` wrapped in a new engine."""
    kept = cache.take_engine(role, model_path, resume_state, settings) if cache else None
    if kept is None:
        return deepspeed_engine(load_model(), settings, gas, resume_state)
    kept[0].set_train_batch_size(
        settings.micro_batch_size * gas * data_parallel.world()
    )  # the batch may differ from the last update's
    return kept


def _rl(request: UpdateRequest, tokenizer, cache=None):
    """ppo_epochs × minibatches optimizer steps; each minibatch is split into micro-batches whose losses use the
    minibatch's normalizers, so the accumulated gradient equals the minibatch's."""

    data = pl.read_parquet(request.data_path)
    update = PolicyUpdate(request, tokenizer, data)
    n, micro = data.height, request.engine.micro_batch_size
    # Minibatches are drawn as whole groups (the samples of one prompt), so that a micro-batch computes each prompt once
    # (packing.pack_shared): dealt sample by sample, a minibatch would hold a sample or two of every group.
    groups = groups_of(list(range(n)), update.prompts)
    minibatches = min(request.minibatches, len(groups))
    largest = math.ceil(len(groups) / minibatches) * max(map(len, groups))
    gas = data_parallel.accumulation_steps(largest, data_parallel.world(), micro)
    engine, optimizer = _kept_or_new_engine(
        cache,
        "policy",
        request.model_path,
        request.resume_state,
        request.engine,
        gas,
        lambda: load_policy(request.model_path, request.engine.lora),
    )
    critic = _critic_engine(request.critic, request.engine, gas, data, cache) if request.critic else None
    if request.engine.gradient_checkpointing:  # a kept engine's model may have been through a logprobs pass since
        for kept in (engine, critic.engine if critic else None):
            if kept is not None:
                checkpoint_layers(kept.module)
    torch.manual_seed(request.seed)  # after the engines: the same random state whether they were loaded or kept
    ptx = _Ptx(request, tokenizer) if request.ptx else None
    gen = torch.Generator().manual_seed(request.seed)
    grad_norms, steps, t0 = [], 0, time.time()
    for _ in range(request.ppo_epochs):
        perm = torch.randperm(len(groups), generator=gen).tolist()
        for mb in [[row for g in perm[i::minibatches] for row in groups[g]] for i in range(minibatches)]:
            for group in optimizer.param_groups:  # linear warmup over the run's first optimizer steps
                group["lr"] = request.engine.lr * min(
                    1.0, (request.first_step + steps + 1) / max(1, request.warmup_steps)
                )
            parts = update.micro_batches(mb, gas)
            norm = update.norm(mb)
            for k, idx, scale in data_parallel.micro_steps(mb, parts):
                last = k == len(parts) - 1
                engine.set_gradient_accumulation_boundary(last)
                update.micro_step(engine, idx, norm, ptx.loss if ptx is not None and last else None, scale)
                if critic is not None:
                    for key, v in critic.micro_step(update, idx, norm, last, scale).items():
                        update.add(key, v)
                crash_point(
                    f"{request.crash_point}:rank{data_parallel.rank()}", whole_group=False
                )  # one rank dies, the rest mid-step
            steps += 1
            gn = engine.get_global_grad_norm()
            gn = update.grad_norm if gn is None else gn  # ZeRO stage 0 in fp32: the trainer's own
            if gn is not None:
                grad_norms.append(float(gn))
    seconds = time.time() - t0
    waited = time.time()
    update.totals = data_parallel.sum_over_ranks(update.totals)  # also the barrier: every rank has finished its steps
    timings = update.rank_timings(time.time() - waited)
    counts = data_parallel.sum_over_ranks(update.counts)
    adapter = (
        adapter_stats(engine.module) if is_peft(engine.module) else {}
    )  # under ZeRO-3 a partition's: rank 0 reports
    return (
        engine,
        optimizer,
        {**_update_metrics(update.totals, steps, grad_norms, n, seconds), **timings, **counts, **adapter},
        critic,
    )


def _update_metrics(totals: dict, steps: int, grad_norms: list[float], samples: int, seconds: float) -> dict:
    """Token-weighted means of the per-token sums; per-step means of the losses."""
    tokens = max(totals.pop("tokens", 0.0), 1.0)
    per_step = {"loss", "ptx_loss", "value_loss"}
    metrics = {k: v / tokens for k, v in totals.items() if k not in per_step}
    metrics.update({k: totals[k] / steps for k in per_step if k in totals})
    metrics.setdefault("kl_ref", float("nan"))  # no reference pass ran (PolicyUpdate.micro_step)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["samples"] = float(samples)
    metrics["seconds_forward_backward"] = seconds  # the update itself: no load, no save
    return {"optimizer_steps": steps, **metrics}


class _Critic:
    """The value model's DeepSpeed engine, stepped in lockstep with the policy's micro-batches."""

    def __init__(self, engine, optimizer, request: CriticRequest, old_values, returns):
        self.engine, self.optimizer, self.request = engine, optimizer, request
        self.old_values, self.returns = old_values, returns

    def micro_step(self, update: PolicyUpdate, idx, norm, last, scale: float = 1.0) -> dict:
        """The value loss of the policy's micro-batch, on the shared-prefix layout's response grid (as the policy's)."""

        batch = pack_shared([update.prompts[i] for i in idx], [update.responses[i] for i in idx], update.pad)
        mask = update.token_mask(idx, batch.shape[1])  # (B, R): the model's own tokens of the samples not masked
        old = align_responses([self.old_values[i] for i in idx], batch.shape[1])
        ret = align_responses([self.returns[i] for i in idx], batch.shape[1])
        values = token_values(self.engine, batch)
        old, ret, mask = (t.to(values.device) for t in (old, ret, mask))
        loss, clipped = value_loss(values, old, ret, mask, self.request.value_clip, norm)
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(self.request.coef * loss * scale, scale_wrt_gas=False)
        self.engine.step()
        return {"value_loss": loss.detach(), "value_clip_frac": clipped} if scale else {}


def critic_settings(c: CriticRequest, policy: EngineSettings) -> EngineSettings:
    # The policy's engine settings with the critic's lr; the critic trains every weight (docs/train-your-own-model.md,
    # "LoRA").
    return dataclasses.replace(policy, lr=c.lr, lora=None)


def _critic_engine(c: CriticRequest, policy: EngineSettings, gas: int, data, cache=None):
    engine, optimizer = _kept_or_new_engine(
        cache, "critic", c.path, c.resume_state, critic_settings(c, policy), gas, lambda: load_critic(c.path, c.fresh)
    )
    return _Critic(engine, optimizer, c, data["values"].to_list(), data["returns"].to_list())


def handle(request: SFTRequest | UpdateRequest, cache=None) -> dict:
    """One request. `cache` (an EngineCache) is given by the resident trainer (tasks/engines/workers/trainer_server.py):
    RL updates then reuse the engines the previous update left, when they hold exactly the requested state."""

    torch.manual_seed(request.seed)
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request.model_path)
    if isinstance(request, SFTRequest):
        engine, table = _sft(request, load_policy(request.model_path, request.engine.lora), tokenizer)
        if data_parallel.rank() == 0:
            table.write_parquet(request.metrics_path)
        metrics, train_seconds = {}, time.time() - t0
        save_checkpoint(engine, tokenizer, request.tmp_dir)
    else:
        engine, optimizer, metrics, critic = _rl(request, tokenizer, cache)
        metrics["trainer_peak_rss_gib"] = peak_rss_gib()  # rank 0's: each rank holds as much
        train_seconds = time.time() - t0
        defer = cache is not None and cache.deferred is not None and bool(request.final_dir) and request.save_state
        timings = {"seconds_save_weights": 0.0}  # rank 0's
        state_id = save_checkpoint(
            engine,
            tokenizer,
            request.tmp_dir,
            request.crash_point,
            defer,
            save_state=request.save_state,
            state_id=request.state_id,
            save_weights=request.save_weights,
            timings=timings,
        )
        critic_id = (
            save_checkpoint(  # named after the policy's, so a replay gives both their recorded ids
                critic.engine,
                tokenizer,
                request.critic.out_dir,
                defer_state=defer,
                save_state=request.save_state,
                state_id=f"{state_id}-critic",
                save_weights=request.save_weights,
            )
            if critic is not None
            else None
        )
        if defer:  # the optimizer state is written while the next stages run, the critic's first
            engines = (
                [(os.path.relpath(request.critic.out_dir, request.tmp_dir), critic.engine, critic_id)]
                if critic is not None
                else []
            )
            cache.deferred.start([*engines, ("", engine, state_id)], request.final_dir, f"{request.crash_point}:state")
        metrics["seconds_save_checkpoint"] = time.time() - t0 - train_seconds
        metrics.update(timings)
        if cache is not None:
            cache.keep_engine("policy", state_id, engine, optimizer, request.engine)
            if critic is not None:
                cache.keep_engine(
                    "critic",
                    critic_id,
                    critic.engine,
                    critic.optimizer,
                    critic_settings(request.critic, request.engine),
                )
    return {
        "metrics": metrics,
        "state_id": None if isinstance(request, SFTRequest) else state_id,  # what a resident trainer now holds
        "train_seconds": train_seconds,
        "deepspeed_version": deepspeed.__version__,
        "zero_stage": request.engine.zero_stage,
    }
