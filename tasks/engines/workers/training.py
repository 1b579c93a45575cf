"""What every DeepSpeed trainer shares: the engine, the checkpoint, the supervised schedule and its progress lines.
No Prefect import: this runs in the worker processes."""

from __future__ import annotations

import math
import os
import socket
import time

from schemas.requests import EngineSettings, Schedule
from storage.crash import crash_point
from tasks.engines.launch import PROGRESS_PREFIX  # clients show these lines of a worker's log in the terminal


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_engine(model, settings: EngineSettings, gas: int, resume_state: str | None = None):
    """(engine, optimizer): AdamW under DeepSpeed (ZeRO stage, gradient clipping, bf16 from the settings), resumed from
    `resume_state` when given (the settings' lr wins over the saved one)."""
    import deepspeed
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    if settings.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay, betas=(0.9, 0.999))
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
        engine.load_checkpoint(resume_state, tag="state", load_module_strict=True)
        for group in engine.optimizer.param_groups:
            group["lr"] = settings.lr
    return engine, optimizer


def save_checkpoint(engine, tokenizer, out_dir: str, crash_name: str = "") -> str:
    """HF weights + tokenizer (what vLLM loads), the sync probe, then the DeepSpeed state; returns the state id, written
    last (a checkpoint without one is never reused by a resident trainer)."""
    from tasks.engines.workers.engine_cache import write_state_id
    from tasks.engines.workers.sync_probe import write_probe

    engine.module.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    write_probe(engine.module, tokenizer, out_dir)  # the sampler checks its weight sync against these logprobs
    crash_point(crash_name)  # a checkpoint with weights but no optimizer state must never be used
    engine.save_checkpoint(os.path.join(out_dir, "ds_state"), tag="state")
    return write_state_id(out_dir)


def cosine_lr(schedule: Schedule, base_lr: float, step: int) -> float:
    """Linear warmup, then cosine from base_lr down to 10% of it."""
    warm = min(1.0, (step + 1) / max(1, schedule.warmup_steps))
    return base_lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / schedule.steps)))


def accumulation_steps(schedule: Schedule, micro_batch_size: int) -> int:
    return math.ceil(schedule.batch_size / min(micro_batch_size, schedule.batch_size))


def supervised_steps(schedule: Schedule, optimizer, base_lr: float, n: int, seed: int, micro_batch_size: int):
    """For each optimizer step, with its learning rate set: (step, lr, micro-batches of element indices), batch_size
    elements drawn at random (seeded) from n."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    bs, micro = schedule.batch_size, min(micro_batch_size, schedule.batch_size)
    for step in range(schedule.steps):
        lr = cosine_lr(schedule, base_lr, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = torch.randint(n, (bs,), generator=gen).tolist()
        yield step, lr, [batch[i : i + micro] for i in range(0, bs, micro)]


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
        print(f"{PROGRESS_PREFIX} {self.what} step {done}/{self.total} ({100 * done / self.total:.0f}%), {rate:.2f} steps/s, "
              f"{_duration(left)} left, {means}", flush=True)
        self.last, self.recent = now, []


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m}m {s:02d}s" if m else f"{s}s"
