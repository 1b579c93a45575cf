"""How the `logprobs` and `optimize` stages reach their engines: the run's resident trainer
(tasks/engines/workers/trainer_server.py) by default, or a one-shot worker process per call with
`engines.resident_trainer: false` (the same requests and results; each call then loads everything from disk).
"""

from __future__ import annotations

from schemas.requests import EngineSettings, LogprobsRequest, LoraSettings, TrainerWarmStart, UpdateRequest
from storage import read_manifest
from tasks.engines.launch import run_worker
from tasks.engines.resident import ResidentProcess, resident
from tasks.engines.workers import LOGPROBS_WORKER, TRAIN_WORKER, TRAINER_SERVER
from tasks.stages.common import RunContext

ONE_SHOT_MODULES = {LogprobsRequest: LOGPROBS_WORKER, UpdateRequest: TRAIN_WORKER}


def call_trainer(ctx: RunContext, request: LogprobsRequest | UpdateRequest, log_name: str) -> dict:
    e = ctx.cfg.engines
    if not e.resident_trainer:
        return run_worker(
            ONE_SHOT_MODULES[type(request)],
            request,
            ctx.layout.scratch_dir,
            ctx.layout.log_path(log_name),
            ranks=e.train_ranks,
            devices=e.trainer_devices,
            hostfile=e.hostfile,
        )
    return resident_trainer(ctx).call(request, label=log_name)


def resident_trainer(ctx: RunContext) -> ResidentProcess:
    """This process's resident trainer for the run (started by its first request, or earlier by `spawn`)."""
    e, log = ctx.cfg.engines, ctx.layout.log_path("trainer")
    return resident(
        TRAINER_SERVER,
        ctx.layout.run_id,
        lambda: ResidentProcess(
            TRAINER_SERVER, log, ranks=e.train_ranks, devices=e.trainer_devices, hostfile=e.hostfile
        ),
    )


def trainer_warm_start(ctx: RunContext) -> TrainerWarmStart | None:
    """What the resident trainer may load before its first request: the run's starting weights, when the next update
    starts from them (no update is complete yet), with the policy's engine settings. A resumed run's trainer loads on
    demand instead: an engine built ahead and never taken would only hold memory."""
    if read_manifest(ctx.layout, "train_metrics", 1, verify=False) is not None:
        return None
    cfg = ctx.cfg
    return TrainerWarmStart(
        cfg.model.path,
        cfg.model.dtype,
        EngineSettings.for_policy(cfg.optim, cfg.model, LoraSettings.from_config(cfg.lora, cfg.seed)),
    )
