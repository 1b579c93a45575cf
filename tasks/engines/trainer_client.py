"""How the `logprobs` and `optimize` stages reach their engines: the run's resident trainer
(tasks/engines/workers/trainer_server.py) by default, or a one-shot worker process per call with
`engines.resident_trainer: false` (the same requests and results; each call then loads everything from disk).
"""

from __future__ import annotations

from schemas.config import EnginesConfig
from schemas.requests import LogprobsRequest, UpdateRequest
from storage import RunLayout
from tasks.engines.launch import run_worker
from tasks.engines.resident import ResidentProcess, resident
from tasks.engines.workers import LOGPROBS_WORKER, TRAIN_WORKER, TRAINER_SERVER

ONE_SHOT_MODULES = {LogprobsRequest: LOGPROBS_WORKER, UpdateRequest: TRAIN_WORKER}


def call_trainer(
    layout: RunLayout, engines: EnginesConfig, request: LogprobsRequest | UpdateRequest, log_name: str
) -> dict:
    """The request answered by the run's resident trainer, or by a one-shot worker (`engines.resident_trainer: false`)
    logging to the run's `logs/{log_name}.log`."""
    e = engines
    if not e.resident_trainer:
        return run_worker(
            ONE_SHOT_MODULES[type(request)],
            request,
            layout.scratch_dir,
            layout.log_path(log_name),
            ranks=e.train_ranks,
            devices=e.trainer_devices,
            hostfile=e.hostfile,
        )
    return resident_trainer(layout, engines).call(request, label=log_name)


def resident_trainer(layout: RunLayout, engines: EnginesConfig) -> ResidentProcess:
    """This process's resident trainer for the run (started by its first request, or earlier by `spawn`)."""
    e, log = engines, layout.log_path("trainer")
    return resident(
        TRAINER_SERVER,
        layout.run_id,
        lambda: ResidentProcess(
            TRAINER_SERVER, log, ranks=e.train_ranks, devices=e.trainer_devices, hostfile=e.hostfile
        ),
    )
