"""What every DeepSpeed trainer shares: the engine, the checkpoint, the supervised schedule and its progress lines.
No Prefect import: this runs in the worker processes.
Imports: torch and DeepSpeed are imported inside functions: `tasks/engines/launch.py` imports this module in the Prefect
process, which never imports DeepSpeed (2.6 s)."""

from __future__ import annotations

import math
import os
import time

from schemas.requests import EngineSettings, Schedule
from storage.crash import crash_point
from tasks.engines.launch import PROGRESS_PREFIX  # clients show these lines of a worker's log in the terminal
from tasks.engines.workers import data_parallel
from tasks.engines.workers.lora import is_peft, save_adapter, save_model_config


def adamw(model, lr: float, weight_decay: float):
    """AdamW over the parameters that train: with LoRA the frozen base model gets no optimizer state (and no gradient).
    Fused: one kernel over all parameters. torch's default (foreach) AdamW took ~2.5 s a step for the 135M SmolLM2 on
    2 CPU cores, the fused one ~0.1 s (its temporaries per parameter list dominate on a CPU)."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999), fused=True)


def checkpoint_layers(model) -> None:
    """Gradient checkpointing for a model that trains in eval mode. transformers checkpoints a layer only while that
    layer is in training mode, and rlpipe's models train in eval mode (no dropout: π_θ must be the policy the sampler
    and the logprobs pass computed), so `gradient_checkpointing_enable` alone changed nothing (measured on
    SmolLM2-135M, 3 rows of 1,056 tokens: a peak of 8.3 GiB either way). The checkpointed layers themselves are put in
    training mode; their submodules, dropout among them, stay as they are. Call it again after anything that sets the
    whole model's mode (token_batch.eval_mode, around a logprobs pass on a kept engine's model)."""
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) is True:
            module.training = True


def deepspeed_engine(model, settings: EngineSettings, gas: int, resume_state: str | None = None):
    """(engine, optimizer): AdamW under DeepSpeed (ZeRO stage, gradient clipping, bf16 from the settings), resumed from
    `resume_state` when given (the settings' lr wins over the saved one). `gas` counts one rank's micro-steps per
    optimizer step; ZeRO partitions over all the ranks of the process group."""
    import deepspeed

    data_parallel.init_process_group()
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpoint_layers(model)
    optimizer = adamw(model, settings.lr, settings.weight_decay)
    config = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.zero_stage},
        # bf16: DeepSpeed casts the module and keeps fp32 master weights in its optimizer wrapper.
        "bf16": {"enabled": settings.dtype == "bfloat16"},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if resume_state:
        check_saved_state(resume_state, settings.zero_stage)
        # The weights come from the checkpoint's own files, which `model` was loaded from (save_optimizer_state).
        engine.load_checkpoint(
            resume_state,
            tag="state",
            load_module_strict=not is_peft(model),
            custom_load_fn=None if settings.zero_stage == 3 else _module_weights_if_saved,
        )
        for group in engine.optimizer.param_groups:
            group["lr"] = settings.lr
    return engine, optimizer


def save_optimizer_state(engine, state_dir: str) -> None:
    """DeepSpeed's state (optimizer moments, fp32 master weights under ZeRO 1-2 or bf16, step counts) without a second
    copy of the module's weights: the checkpoint's HF or adapter files hold them exactly, and a resume loads the model
    from them first. That is a third less to write for full-weight fp32 training (0.54 of 1.6 GB on the demo model).
    ZeRO-3 keeps DeepSpeed's own layout (its module state is saved partitioned)."""
    adapter = is_peft(engine.module)
    if engine.zero_optimization_stage() == 3:
        engine.save_checkpoint(state_dir, tag="state", exclude_frozen_parameters=adapter)
        return
    engine.module_state_dict = lambda *args, **kwargs: {}  # read by save_checkpoint alone, restored below
    try:
        engine.save_checkpoint(state_dir, tag="state", exclude_frozen_parameters=adapter)
    finally:
        del engine.module_state_dict  # the engine's own method again


def _module_weights_if_saved(src: dict, dst) -> None:
    """DeepSpeed's module loading, for a state that holds the weights (one written before save_optimizer_state left
    them out); an adapter's state holds the trainable weights only, the frozen base comes from the model folder."""
    if src:
        dst.load_state_dict(src, strict=not is_peft(dst))


def unreported_grad_norm(engine) -> float | None:
    """The 2-norm of the gradients an optimizer step is about to apply (before clipping), where DeepSpeed keeps none:
    at ZeRO stage 0 in fp32 it clips with torch's clip_grad_norm_ and drops the norm it computed, so its
    get_global_grad_norm() stays None. Call it at an accumulation boundary after the backward pass, when every rank
    holds the gradients averaged over the ranks: the local norm is the global one. None where DeepSpeed reports its
    own (ZeRO 1-3, bf16)."""
    import torch

    if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled() or engine.fp16_enabled():
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


def check_saved_state(resume_state: str, zero_stage: int) -> None:
    """The state is complete, and (ZeRO's optimizer state is saved one partition per rank) resuming it needs as many
    ranks as saved it."""
    from tasks.engines.workers.engine_cache import read_state

    state = read_state(os.path.dirname(resume_state))
    if state.get("pending"):
        raise ValueError(
            f"{os.path.dirname(resume_state)} has its weights but not its optimizer state (the command that wrote it "
            "stopped first): redo that iteration's optimize stage (`rlpipe run` of the same run redoes it)"
        )
    saved = state.get("world_size", 1)
    if zero_stage > 0 and saved != data_parallel.world():
        raise ValueError(
            f"{resume_state} holds ZeRO-{zero_stage} optimizer state of {saved} trainer rank(s), and this trainer has "
            f"{data_parallel.world()}: set engines.train_ranks={saved} (or convert it with DeepSpeed's ds_to_universal)"
        )


def save_checkpoint(
    engine,
    tokenizer,
    out_dir: str,
    crash_name: str = "",
    defer_state: bool = False,
    save_state: bool = True,
    state_id: str = "",
    save_weights: bool = True,
    timings: dict | None = None,
) -> str:
    """HF weights + tokenizer (what vLLM loads), the sync probe, then the DeepSpeed state; returns the state id, written
    last (a checkpoint without one is never reused by a resident trainer; `state_id` gives it that id, else a new one).
    With `defer_state` the id is marked pending and the state is left to the caller's
    tasks/engines/workers/deferred_state.py; without `save_state` there is none (checkpoint.every: the caller keeps the
    engine). Without `save_weights` the folder is the model's configuration without its weight files (the trainer keeps
    the engine and sends its weights to the sampler over a process group). Every rank calls it: ZeRO-3's weights are
    gathered from all ranks, rank 0 writes the consolidated HF folder, each rank saves its optimizer partition.
    `timings` gets `seconds_save_weights`: writing the weights (or the config in their place)."""
    from tasks.engines.workers.engine_cache import write_state_id
    from tasks.engines.workers.sync_probe import write_probe

    t0 = time.time()
    zero3 = engine.zero_optimization_stage() == 3 and save_weights
    consolidated = engine._zero3_consolidated_16bit_state_dict() if zero3 else None
    adapter = is_peft(engine.module)
    if data_parallel.rank() == 0:
        if not save_weights:
            save_model_config(engine.module, out_dir)
        elif adapter:  # a PEFT folder: the adapter's weights only (tasks/engines/workers/lora.py)
            save_adapter(engine.module, out_dir, state_dict=consolidated)
        else:
            engine.module.save_pretrained(out_dir, safe_serialization=True, state_dict=consolidated)
        if timings is not None:
            timings["seconds_save_weights"] = time.time() - t0
        tokenizer.save_pretrained(out_dir)
    # The sampler checks its weight sync against these logprobs; under ZeRO-3 a forward needs every rank.
    write_probe(engine.module, tokenizer, out_dir, write=data_parallel.rank() == 0)
    crash_point(crash_name)  # a checkpoint with weights but no optimizer state must never be used
    if defer_state:
        return write_state_id(out_dir, data_parallel.world(), state_id or None, pending=True)
    if save_state:
        save_optimizer_state(engine, os.path.join(out_dir, "ds_state"))
    if data_parallel.rank() == 0:
        state_id = write_state_id(out_dir, data_parallel.world(), state_id or None, weights_only=not save_state)
    return data_parallel.broadcast(state_id if data_parallel.rank() == 0 else None)


def cosine_lr(schedule: Schedule, base_lr: float, step: int) -> float:
    """Linear warmup, then cosine from base_lr down to 10% of it."""
    warm = min(1.0, (step + 1) / max(1, schedule.warmup_steps))
    return base_lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / schedule.steps)))


def accumulation_steps(schedule: Schedule, micro_batch_size: int) -> int:
    """One rank's micro-steps per optimizer step."""
    return data_parallel.accumulation_steps(schedule.batch_size, data_parallel.world(), micro_batch_size)


def supervised_steps(schedule: Schedule, optimizer, base_lr: float, n: int, seed: int, micro_batch_size: int):
    """For each optimizer step, with its learning rate set: (step, lr, batch, this rank's micro-batches of it),
    batch_size
    elements drawn at random (seeded, the same draw on every rank) from n; an empty micro-batch is a dummy step."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    bs, gas, chunk = (
        schedule.batch_size,
        accumulation_steps(schedule, micro_batch_size),
        min(micro_batch_size, schedule.batch_size),
    )
    for step in range(schedule.steps):
        lr = cosine_lr(schedule, base_lr, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = torch.randint(n, (bs,), generator=gen).tolist()
        yield (
            step,
            lr,
            batch,
            data_parallel.rank_micro_batches(batch, gas, data_parallel.world(), data_parallel.rank(), chunk),
        )


class Progress:
    """`progress:` lines in the worker's log (shown in the terminal by the client): steps done, rate, time left and
    the recent mean of each metric, at most every `seconds` and at the last step."""

    def __init__(self, what: str, total: int, seconds: float = 10.0):
        self.what, self.total, self.seconds = what, total, seconds
        self.started = self.last = time.time()
        self.recent: list[dict] = []

    def step(self, done: int, metrics: dict) -> None:
        self.recent.append(metrics)
        now = time.time()
        if now - self.last < self.seconds and done < self.total:
            return
        rate = done / max(now - self.started, 1e-9)
        left = (self.total - done) / rate if rate else float("inf")
        means = " ".join(f"{k} {sum(m[k] for m in self.recent) / len(self.recent):.4g}" for k in self.recent[0])
        print(
            f"{PROGRESS_PREFIX} {self.what} step {done}/{self.total} ({100 * done / self.total:.0f}%), {rate:.2f} "
            f"steps/s, "
            f"{_duration(left)} left, {means}",
            flush=True,
        )
        self.last, self.recent = now, []


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m}m {s:02d}s" if m else f"{s}s"
