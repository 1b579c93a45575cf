"""DeepSpeed trainer worker: SFT steps or one RL policy update, then an atomic checkpoint.

Request (both modes): mode, model_path, out_dir (final checkpoint folder), tmp_dir, metrics_path, zero_stage,
lr, weight_decay, grad_clip, micro_batch_size, seed; optional resume_state (a DeepSpeed state folder).
- sft: data_path (text, response), steps, batch_size, warmup_steps.
- rl: data_path (prompt_token_ids, token_ids, old/ref_logprobs, token_advantages, loss_mask), ppo_epochs,
  minibatches, loss settings.
The checkpoint folder holds HF safetensors + tokenizer (what vLLM loads) and `ds_state/` (optimizer state),
written under tmp_dir and renamed into place by the caller's storage layer.
"""

from __future__ import annotations

import math
import os
import socket
import time

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
    optimizer = torch.optim.AdamW(model.parameters(), lr=request["lr"], weight_decay=request["weight_decay"], betas=(0.9, 0.999))
    config = {
        "train_micro_batch_size_per_gpu": request["micro_batch_size"],
        "gradient_accumulation_steps": gas,
        "gradient_clipping": request["grad_clip"],
        "zero_optimization": {"stage": request["zero_stage"]},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if request.get("resume_state"):
        engine.load_checkpoint(request["resume_state"], tag="state", load_module_strict=True)
        for group in engine.optimizer.param_groups:  # the config's lr wins over the saved one
            group["lr"] = request["lr"]
    return engine, optimizer


def _save(engine, tokenizer, tmp_dir: str) -> None:
    engine.module.save_pretrained(tmp_dir, safe_serialization=True)
    tokenizer.save_pretrained(tmp_dir)
    engine.save_checkpoint(os.path.join(tmp_dir, "ds_state"), tag="state")


def _sft(request, model, tokenizer):
    import polars as pl
    import torch

    from tasks.engines.token_batch import pack, token_logprobs

    data = pl.read_parquet(request["data_path"])
    prompts = [tokenizer(t)["input_ids"] for t in data["text"].to_list()]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in data["response"].to_list()]
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
            ids, attn, mask = pack([prompts[i] for i in idx], [responses[i] for i in idx], tokenizer.pad_token_id)
            logp, _ = token_logprobs(engine, ids, attn, with_entropy=False)
            loss = -(logp * mask).sum() / total_tokens  # token-mean over the whole batch
            engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
            engine.backward(loss, scale_wrt_gas=False)
            engine.step()
            loss_sum += float(loss.detach())
        rows.append({"step": step, "loss": loss_sum, "lr": lr})
    return engine, pl.DataFrame(rows, schema={"step": pl.Int32, "loss": pl.Float64, "lr": pl.Float64}), {}


def _rl(request, model, tokenizer):
    import polars as pl
    import torch

    from tasks.engines.token_batch import align, pack, token_logprobs
    from tasks.losses import ClipSettings, MinibatchNorm, PolicyLossSettings, policy_loss

    data = pl.read_parquet(request["data_path"])
    prompts, responses = data["prompt_token_ids"].to_list(), data["token_ids"].to_list()
    old_all, ref_all = data["old_logprobs"].to_list(), data["ref_logprobs"].to_list()
    adv_all, loss_mask = data["token_advantages"].to_list(), data["loss_mask"].to_list()
    n, micro = data.height, request["micro_batch_size"]
    minibatches = min(request["minibatches"], n)
    gas = max(1, math.ceil(math.ceil(n / minibatches) / micro))
    engine, optimizer = _engine(model, request, gas)
    loss_cfg = request["loss"]
    settings = PolicyLossSettings(
        objective=loss_cfg["objective"], aggregation=loss_cfg["aggregation"],
        clip=ClipSettings(loss_cfg["clip_eps_low"], loss_cfg["clip_eps_high"], loss_cfg["dual_clip"]),
        kl_estimator=loss_cfg["kl_estimator"], kl_in_loss=loss_cfg["kl_in_loss"], kl_beta=loss_cfg["kl_beta"],
    )
    gen = torch.Generator().manual_seed(request["seed"])
    totals: dict[str, float] = {}
    entropy_sum, grad_norms, steps = 0.0, [], 0
    for _ in range(request["ppo_epochs"]):
        perm = torch.randperm(n, generator=gen).tolist()
        for mb in [perm[i::minibatches] for i in range(minibatches)]:
            global_step = request.get("first_step", 0) + steps
            for group in optimizer.param_groups:
                group["lr"] = request["lr"] * min(1.0, (global_step + 1) / max(1, request.get("warmup_steps", 0)))
            parts = [p for p in (mb[i::gas] for i in range(gas)) if p]
            norm = MinibatchNorm(tokens=float(sum(len(responses[i]) * loss_mask[i] for i in mb)), sequences=float(len(mb)))
            for k, idx in enumerate(parts):
                p = [prompts[i] for i in idx]
                ids, attn, mask = pack(p, [responses[i] for i in idx], tokenizer.pad_token_id)
                mask = mask * torch.tensor([float(loss_mask[i]) for i in idx]).unsqueeze(1)  # (B, T)
                plen, width = [len(x) for x in p], mask.shape[1]
                old = align([old_all[i] for i in idx], plen, width)
                ref = align([ref_all[i] for i in idx], plen, width)
                adv = align([adv_all[i] for i in idx], plen, width)
                logp, ent = token_logprobs(engine, ids, attn, with_entropy=True)
                loss, sums = policy_loss(logp, old, ref, adv, mask, norm, settings)
                engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
                engine.backward(loss, scale_wrt_gas=False)
                engine.step()
                for key, v in sums.items():
                    totals[key] = totals.get(key, 0.0) + float(v)
                totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
                entropy_sum += float((ent.detach() * mask).sum())
            steps += 1
            gn = engine.get_global_grad_norm()
            if gn is not None:
                grad_norms.append(float(gn))
    tokens = max(totals.pop("tokens", 0.0), 1.0)
    metrics = {k: v / tokens for k, v in totals.items() if k != "loss"}
    metrics["loss"] = totals.get("loss", 0.0) / steps
    metrics["entropy"] = entropy_sum / tokens
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    return engine, None, {"optimizer_steps": steps, **metrics}


def handle(request: dict) -> dict:
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(request["seed"])
    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(request["model_path"])
    model = AutoModelForCausalLM.from_pretrained(request["model_path"], dtype=torch.float32)
    model.config.use_cache = False
    engine, table, metrics = (_sft if request["mode"] == "sft" else _rl)(request, model, tokenizer)
    train_seconds = time.time() - t0
    if table is not None:
        table.write_parquet(request["metrics_path"])
    _save(engine, tokenizer, request["tmp_dir"])
    return {
        "metrics": metrics, "train_seconds": train_seconds, "deepspeed_version": deepspeed.__version__,
        "zero_stage": request["zero_stage"],
    }


if __name__ == "__main__":
    worker_main(handle)
