"""DeepSpeed trainer worker: SFT steps or one RL policy update, then an atomic checkpoint.

Request (both modes): mode, model_path, out_dir (final checkpoint folder), tmp_dir, metrics_path, zero_stage,
lr, weight_decay, grad_clip, micro_batch_size, seed, dtype, gradient_checkpointing; optional resume_state (a DeepSpeed
state folder), crash_point (storage/crash.py).
- sft: data_path (prompt_token_ids, response_token_ids), steps, batch_size, warmup_steps.
- rl: data_path (prompt_token_ids, token_ids, old/ref_logprobs, token_advantages, loss_mask; values and
  returns with a critic), ppo_epochs, minibatches, max_tokens, loss settings; optional critic (path, fresh,
  resume_state, out_dir, lr, value_clip, coef) and ptx_coef/ptx_batch/ptx_data_path.
The checkpoint folder holds HF safetensors + tokenizer (what vLLM loads), `sync_probe.json` (the trainer's logprobs
that the sampler checks its weight sync against), `ds_state/` (optimizer state) and `trainer_state.json` (the id
a resident trainer reuses its engine by, tasks/engines/workers/engine_cache.py),
plus `critic/` (the same two) for PPO, written under tmp_dir and renamed into place by the caller's storage
layer.
"""

from __future__ import annotations

import math
import os
import socket
import time

from storage.crash import crash_point
from tasks.data.formatting import pad_id
from tasks.engines.launch import worker_main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model, request, gas: int):
    import deepspeed
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    if request["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=request["lr"], weight_decay=request["weight_decay"], betas=(0.9, 0.999))
    config = {
        "train_micro_batch_size_per_gpu": request["micro_batch_size"],
        "gradient_accumulation_steps": gas,
        "gradient_clipping": request["grad_clip"],
        "zero_optimization": {"stage": request["zero_stage"]},
        # bf16: DeepSpeed casts the module and keeps fp32 master weights in its optimizer wrapper.
        "bf16": {"enabled": request["dtype"] == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if request.get("resume_state"):
        engine.load_checkpoint(request["resume_state"], tag="state", load_module_strict=True)
        for group in engine.optimizer.param_groups:  # the config's lr wins over the saved one
            group["lr"] = request["lr"]
    return engine, optimizer


def _save(engine, tokenizer, tmp_dir: str, crash_name: str = "") -> str:
    """Write the checkpoint; return its state id (written last: a checkpoint without one is never reused)."""
    from tasks.engines.workers.engine_cache import write_state_id
    from tasks.engines.workers.sync_probe import write_probe

    engine.module.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    write_probe(engine.module, tokenizer, tmp_dir)  # the sampler checks its weight sync against these logprobs
    crash_point(crash_name)  # a checkpoint with weights but no optimizer state must never be used
    engine.save_checkpoint(os.path.join(tmp_dir, "ds_state"), tag="state")
    return write_state_id(tmp_dir)


def _sft(request, model, tokenizer):
    import polars as pl
    import torch

    from tasks.engines.workers.token_batch import pack, token_logprobs

    data = pl.read_parquet(request["data_path"])
    prompts, responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
    bs, micro = request["batch_size"], min(request["micro_batch_size"], request["batch_size"])
    gas = math.ceil(bs / micro)
    engine, optimizer = _engine(model, request, gas)
    steps, warmup, base_lr = request["steps"], request["warmup_steps"], request["lr"]
    gen = torch.Generator().manual_seed(request["seed"])
    rows = []
    for step in range(steps):
        lr = base_lr * min(1.0, (step + 1) / max(1, warmup)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = torch.randint(len(prompts), (bs,), generator=gen).tolist()
        parts = [batch[i : i + micro] for i in range(0, bs, micro)]
        total_tokens = sum(len(responses[i]) for i in batch)
        loss_sum = 0.0
        for k, idx in enumerate(parts):
            ids, attn, mask = pack([prompts[i] for i in idx], [responses[i] for i in idx], pad_id(tokenizer))
            logp, _ = token_logprobs(engine, ids, attn, with_entropy=False)
            loss = -(logp * mask).sum() / total_tokens  # token-mean over the whole batch
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            loss_sum += float(loss.detach())
        rows.append({"step": step, "loss": loss_sum, "lr": lr})
    return engine, pl.DataFrame(rows, schema={"step": pl.Int32, "loss": pl.Float64, "lr": pl.Float64}), {}


def _policy_settings(loss_cfg: dict):
    from tasks.algos.losses import ClipSettings, PolicyLossSettings

    return PolicyLossSettings(
        objective=loss_cfg["objective"], aggregation=loss_cfg["aggregation"],
        clip=ClipSettings(loss_cfg["clip_eps_low"], loss_cfg["clip_eps_high"], loss_cfg["dual_clip"]),
        kl_estimator=loss_cfg["kl_estimator"], kl_in_loss=loss_cfg["kl_in_loss"], kl_beta=loss_cfg["kl_beta"],
        entropy_coef=loss_cfg.get("entropy_coef", 0.0),
    )


class _Ptx:
    """PPO-ptx: a batch of SFT demonstrations per optimizer step, γ_ptx · token-mean NLL."""

    def __init__(self, request, tokenizer, seed):
        import polars as pl
        import torch

        data = pl.read_parquet(request["ptx_data_path"])
        self.prompts, self.responses = data["prompt_token_ids"].to_list(), data["response_token_ids"].to_list()
        self.coef, self.batch, self.pad = request["ptx_coef"], request["ptx_batch"], pad_id(tokenizer)
        self.gen = torch.Generator().manual_seed(seed)

    def loss(self, engine):
        import torch

        from tasks.engines.workers.token_batch import pack, token_logprobs

        idx = torch.randint(len(self.prompts), (self.batch,), generator=self.gen).tolist()
        ids, attn, mask = pack([self.prompts[i] for i in idx], [self.responses[i] for i in idx], self.pad)
        logp, _ = token_logprobs(engine, ids, attn, with_entropy=False)
        return -self.coef * (logp * mask).sum() / mask.sum().clamp_min(1.0)


def engine_settings(request: dict, lr: float) -> dict:
    """What an engine is built with, besides its state: a kept engine is reused only when these are equal."""
    return {k: request[k] for k in ("zero_stage", "weight_decay", "grad_clip", "micro_batch_size")} | {"lr": lr}


def _kept_or_new_engine(cache, role: str, request: dict, gas: int, load_model):
    """(engine, optimizer) for `request` (its model_path, resume_state and lr): the resident trainer's kept engine
    when it holds exactly that starting state, else `load_model()` wrapped in a new engine."""
    kept = cache.take_engine(role, request["model_path"], request.get("resume_state"),
                             engine_settings(request, request["lr"])) if cache else None
    if kept is None:
        return _engine(load_model(), request, gas)
    kept[0].set_train_batch_size(request["micro_batch_size"] * gas)  # the batch may differ from the last update's
    return kept


def _load_policy(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.use_cache = False
    return model


def _rl(request, tokenizer, cache=None):
    """ppo_epochs × minibatches optimizer steps; each minibatch is split into micro-batches whose losses
    use the minibatch's normalizers, so the accumulated gradient equals the minibatch's."""
    import polars as pl
    import torch

    from tasks.algos.losses import MinibatchNorm, policy_loss, tis_weights
    from tasks.engines.workers.token_batch import align, pack, token_logprobs

    data = pl.read_parquet(request["data_path"])
    prompts, responses = data["prompt_token_ids"].to_list(), data["token_ids"].to_list()
    tis_cap = request["loss"]["tis_cap"]
    list_columns = ("old_logprobs", "ref_logprobs", "token_advantages") + (("sampler_logprobs",) if tis_cap else ())
    lists = {c: data[c].to_list() for c in list_columns}
    loss_mask = data["loss_mask"].to_list()
    n, micro = data.height, request["micro_batch_size"]
    minibatches = min(request["minibatches"], n)
    gas = max(1, math.ceil(math.ceil(n / minibatches) / micro))
    engine, optimizer = _kept_or_new_engine(cache, "policy", request, gas, lambda: _load_policy(request["model_path"]))
    critic = _critic_engine(request, gas, data, cache) if request.get("critic") else None
    ptx = _Ptx(request, tokenizer, request["seed"]) if request.get("ptx_coef") else None
    settings = _policy_settings(request["loss"])
    gen = torch.Generator().manual_seed(request["seed"])
    totals: dict[str, float] = {}
    entropy_sum, grad_norms, steps = 0.0, [], 0
    t0 = time.time()

    def add(key, value):
        totals[key] = totals.get(key, 0.0) + float(value)

    for _ in range(request["ppo_epochs"]):
        perm = torch.randperm(n, generator=gen).tolist()
        for mb in [perm[i::minibatches] for i in range(minibatches)]:
            global_step = request.get("first_step", 0) + steps
            for group in optimizer.param_groups:
                group["lr"] = request["lr"] * min(1.0, (global_step + 1) / max(1, request.get("warmup_steps", 0)))
            parts = [p for p in (mb[i::gas] for i in range(gas)) if p]
            norm = MinibatchNorm(
                tokens=float(sum(len(responses[i]) * loss_mask[i] for i in mb)),
                sequences=float(sum(1 for i in mb if loss_mask[i] and responses[i])),
                max_len=float(request["max_tokens"]),
            )
            for k, idx in enumerate(parts):
                p = [prompts[i] for i in idx]
                ids, attn, mask = pack(p, [responses[i] for i in idx], pad_id(tokenizer))
                mask = mask * torch.tensor([float(loss_mask[i]) for i in idx]).unsqueeze(1)  # (B, T)
                plen, width = [len(x) for x in p], mask.shape[1]
                old, ref, adv = (align([lists[c][i] for i in idx], plen, width) for c in ("old_logprobs", "ref_logprobs", "token_advantages"))
                weights = None
                if tis_cap:
                    weights = tis_weights(old, align([lists["sampler_logprobs"][i] for i in idx], plen, width), tis_cap)  # (B, T)
                    add("tis_weight_mean", (weights * mask).sum())
                    add("tis_capped_fraction", ((weights >= tis_cap).float() * mask).sum())
                logp, ent = token_logprobs(engine, ids, attn, with_entropy=True)
                loss, sums = policy_loss(logp, old, ref, adv, mask, norm, settings, entropy=ent, token_weights=weights)
                last = k == len(parts) - 1
                if ptx is not None and last:
                    ptx_loss = ptx.loss(engine)
                    loss = loss + ptx_loss
                    add("ptx_loss", ptx_loss.detach())
                engine.set_gradient_accumulation_boundary(last)
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
                for key, v in sums.items():
                    add(key, v)
                add("loss", loss.detach())
                entropy_sum += float((ent.detach() * mask).sum())
                if critic is not None:
                    for key, v in critic.micro_step(idx, ids, attn, mask, plen, width, norm, last).items():
                        add(key, v)
            steps += 1
            gn = engine.get_global_grad_norm()
            if gn is not None:
                grad_norms.append(float(gn))
    tokens = max(totals.pop("tokens", 0.0), 1.0)
    per_step = {"loss", "ptx_loss", "value_loss"}
    metrics = {k: v / tokens for k, v in totals.items() if k not in per_step}
    metrics.update({k: totals[k] / steps for k in per_step if k in totals})
    metrics["entropy"] = entropy_sum / tokens
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["samples"] = float(n)
    metrics["seconds_forward_backward"] = time.time() - t0  # the update itself: no load, no save
    return engine, optimizer, {"optimizer_steps": steps, **metrics}, critic


class _Critic:
    """The value model's DeepSpeed engine, stepped in lockstep with the policy's micro-batches."""

    def __init__(self, engine, optimizer, request, old_values, returns):
        self.engine, self.optimizer, self.request = engine, optimizer, request
        self.old_values, self.returns = old_values, returns

    def micro_step(self, idx, ids, attn, mask, plen, width, norm, last) -> dict:
        from tasks.algos.losses import value_loss
        from tasks.engines.workers.critic import token_values
        from tasks.engines.workers.token_batch import align

        c = self.request["critic"]
        old = align([self.old_values[i] for i in idx], plen, width)
        ret = align([self.returns[i] for i in idx], plen, width)
        values = token_values(self.engine, ids, attn)
        loss, clipped = value_loss(values, old, ret, mask, c["value_clip"], norm)
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(c["coef"] * loss, scale_wrt_gas=False)
        self.engine.step()
        return {"value_loss": loss.detach(), "value_clip_frac": clipped}


def _critic_engine(request, gas, data, cache=None):
    from tasks.engines.workers.critic import load_critic

    c = request["critic"]
    critic_request = {**request, "model_path": c["path"], "lr": c["lr"], "resume_state": c.get("resume_state")}
    engine, optimizer = _kept_or_new_engine(cache, "critic", critic_request, gas, lambda: load_critic(c["path"], c["fresh"]))
    return _Critic(engine, optimizer, request, data["values"].to_list(), data["returns"].to_list())


def handle(request: dict, cache=None) -> dict:
    """One request. `cache` (an EngineCache) is given by the resident trainer (tasks/engines/workers/trainer_server.py):
    RL updates then reuse the engines the previous update left, when they hold exactly the requested state."""
    import deepspeed
    import torch
    from transformers import AutoTokenizer

    torch.manual_seed(request["seed"])
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request["model_path"])
    critic = None
    if request["mode"] == "sft":
        engine, table, metrics = _sft(request, _load_policy(request["model_path"]), tokenizer)
    else:
        engine, optimizer, metrics, critic = _rl(request, tokenizer, cache)
        table = None
    train_seconds = time.time() - t0
    if table is not None:
        table.write_parquet(request["metrics_path"])
    state_id = _save(engine, tokenizer, request["tmp_dir"], request.get("crash_point", ""))
    critic_id = _save(critic.engine, tokenizer, request["critic"]["out_dir"]) if critic is not None else None
    if cache is not None:
        cache.keep_engine("policy", state_id, engine, optimizer, engine_settings(request, request["lr"]))
        if critic is not None:
            cache.keep_engine("critic", critic_id, critic.engine, critic.optimizer, engine_settings(request, request["critic"]["lr"]))
    return {
        "metrics": metrics, "train_seconds": train_seconds, "deepspeed_version": deepspeed.__version__,
        "zero_stage": request["zero_stage"],
    }


if __name__ == "__main__":
    worker_main(handle)
