"""The device check's two measured steps, each run by infra/gpu_check.py in a process of its own (`--step`): rlpipe's
trainer worker on one device (the logprobs pass, the update's micro-step, DeepSpeed's step), and what it computed or
how fast. The script builds their inputs, runs them, compares and reports; these are the trainer's code under
measurement.

Needs what the script needs (torch, transformers, DeepSpeed, pydantic and polars), imported inside the functions; the
script puts the repository root on sys.path before a step runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

LR = 1e-5


def _engine(model_dir: str, dtype: str, budget: int, gas: int):
    from schemas.requests import EngineSettings
    from tasks.engines.workers.deepspeed_train import load_policy
    from tasks.engines.workers.training import deepspeed_engine

    settings = EngineSettings(
        zero_stage=0,
        lr=LR,
        weight_decay=0.0,
        grad_clip=1e9,  # no clipping: the gradient itself is compared
        micro_batch_size=1,
        dtype=dtype,
        gradient_checkpointing=False,
        lora=None,
        micro_batch_tokens=budget,
    )
    engine, _ = deepspeed_engine(load_policy(model_dir), settings, gas=gas)
    return engine, settings


def _update(settings, rows, model_dir: str):
    from types import SimpleNamespace

    import polars as pl
    from transformers import AutoTokenizer

    from schemas.config import LossConfig
    from schemas.requests import LossSettings
    from tasks.engines.workers.policy_update import PolicyUpdate

    loss = LossSettings(
        loss=LossConfig(), kl_beta=0.0, entropy_coef=0.0, max_tokens=max(len(r["token_ids"]) for r in rows)
    )
    return PolicyUpdate(
        SimpleNamespace(loss=loss, engine=settings), AutoTokenizer.from_pretrained(model_dir), pl.DataFrame(rows)
    )


def _one_step(engine, update, n: int, gas: int, keep_grad: bool):
    """One optimizer step over all `n` rows through the trainer's micro-step; the flattened gradient (float32, on the
    CPU) read just before the step when `keep_grad`."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    from tasks.engines.workers import data_parallel

    minibatch = list(range(n))
    norm, parts = update.norm(minibatch), update.micro_batches(minibatch, gas)
    grads, step = [], engine.step

    def record():
        if keep_grad and engine.is_gradient_accumulation_boundary():
            grads.append(torch.cat([safe_get_full_grad(p).float().flatten().cpu() for p in engine.module.parameters()]))
        step()

    engine.step = record
    for k, idx, scale in data_parallel.micro_steps(minibatch, parts):
        engine.set_gradient_accumulation_boundary(k == len(parts) - 1)
        update.micro_step(engine, idx, norm, None, scale)
    engine.step = step
    return grads[-1] if grads else None


def _master_weights(engine):
    """The weights the optimizer updates, flattened on the CPU: in bfloat16 DeepSpeed's float32 master copy (a step of
    lr = 1e-5 does not move most bfloat16 weights at all), else the module's own."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param

    params = list(engine.module.parameters())
    # ZeRO 1-3 and DeepSpeed's bf16 optimizer map each parameter to its master copy; ZeRO 0 in bfloat16 wraps the
    # optimizer in FP16_UnfusedOptimizer, whose float32 groups mirror its low-precision ones.
    groups = getattr(engine.optimizer, "fp32_groups", None)
    mirror = {}
    if groups is not None and hasattr(engine.optimizer, "fp16_groups"):
        mirror = {id(p): m for low, high in zip(engine.optimizer.fp16_groups, groups) for p, m in zip(low, high)}
    master = [mirror.get(id(p), safe_get_full_fp32_param(p)) for p in params]
    return torch.cat([(p if m is None else m).detach().float().flatten().cpu() for p, m in zip(params, master)])


def run_equality(args) -> dict:
    """One process: logprobs, loss, gradient and updated weights of the batch in `args.dtype` on `args.device`."""
    import torch

    from tasks.engines.workers.token_batch import batched_responses, eval_mode

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    rows = json.loads(Path(args.rows).read_text())
    engine, settings = _engine(args.model, args.dtype, budget=args.budget, gas=1)
    before = _master_weights(engine)
    prompts, responses = [r["prompt_token_ids"] for r in rows], [r["token_ids"] for r in rows]
    with eval_mode(engine.module):
        logp, _ = batched_responses(
            engine.module, prompts, responses, 0, 64, with_entropy=False, micro_tokens=args.budget
        )
    update = _update(settings, rows, args.model)
    grad = _one_step(engine, update, len(rows), gas=1, keep_grad=True)
    after = _master_weights(engine)
    torch.save(
        {
            "logprobs": [torch.tensor(x) for x in logp],
            "loss": update.totals["loss"],
            "grad": grad,
            "delta": after - before,
        },
        args.result + ".pt",
    )
    return {"device": str(engine.device)}


def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def run_throughput(args) -> dict:
    """One process: tokens/s and model FLOPs of the update of `args.shape` in `args.dtype` (after a warm-up step)."""
    import torch

    engine, settings = _engine(args.model, args.dtype, budget=args.budget, gas=1)
    config = engine.module.config
    rows = json.loads(Path(args.rows).read_text())
    update = _update(settings, rows, args.model)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    _one_step(engine, update, len(rows), gas=1, keep_grad=False)  # warm-up: kernels chosen, memory allocated
    update.counts.clear()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        _one_step(engine, update, len(rows), gas=1, keep_grad=False)
    sync()
    seconds = time.perf_counter() - t0
    flops = train_flops(config, update.counts)
    profile = _profiled_step(engine, update, len(rows)) if args.profile else None
    peak_mem = torch.cuda.max_memory_allocated() if engine.device.type == "cuda" else 0
    return {
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "tokens": update.counts["update_tokens"],
        "seconds": seconds,
        "tokens_per_s": update.counts["update_tokens"] / seconds,
        "model_flops": flops,
        "flops_per_s": flops / seconds,
        "peak_gpu_gib": _gib(peak_mem),
        **({"profile": profile} if profile else {}),
    }


def _profiled_step(engine, update, n: int) -> dict:
    """One more step under torch's profiler: the operators that took the most device time and the most host time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tasks.engines.workers import policy_update

    packing = [0.0]
    pack = policy_update.pack_shared

    def timed_pack(*a, **k):  # packing runs on the host, in Python: the profiler's operator tables do not see it
        t = time.perf_counter()
        out = pack(*a, **k)
        packing[0] += time.perf_counter() - t
        return out

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    policy_update.pack_shared = timed_pack
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        _one_step(engine, update, n, gas=1, keep_grad=False)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    policy_update.pack_shared = pack
    table = prof.key_averages()
    device_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, device_key) for e in table) / 1e6
    print(f"profiled step: {wall:.3f} s wall (profiler on), device busy {busy:.3f} s, packing {packing[0]:.3f} s")
    return {
        "wall_s": wall,
        "device_busy_s": busy,
        "packing_s": packing[0],
        "device": table.table(sort_by=device_key, row_limit=25, max_name_column_width=60),
        "host": table.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60),
    }


def train_flops(config, counts: dict[str, float]) -> float:
    """Model FLOPs of the forward and backward passes counted in `counts` (token_batch.count_into's `update_*`):
    2 per multiply-add forward, twice that backward, over the useful work only (real tokens, the attention pairs the
    mask allows, the logits of predicted tokens), as PaLM's model FLOP utilisation counts it."""
    d, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    per_layer = d * heads * head_dim * 2 + d * kv * head_dim * 2 + 3 * d * config.intermediate_size  # q,o; k,v; MLP
    forward = (
        2 * layers * per_layer * counts["update_tokens"]
        + 2 * layers * 2 * heads * head_dim * counts["update_attention_pairs"]  # QKᵀ and the weighted sum of V
        + 2 * d * config.vocab_size * counts["update_logit_positions"]
    )
    return 3 * forward
