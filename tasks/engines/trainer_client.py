"""How the `logprobs` and `optimize` stages reach their engines: the run's resident trainer
(tasks/engines/workers/trainer_server.py, one Ray actor per rank) by default, or a one-shot engine per call with
`engines.resident_trainer: false` (the same requests and results; each call then loads everything from disk).
"""

from __future__ import annotations

from schemas.config import EnginesConfig
from schemas.requests import LogprobsRequest, UpdateRequest
from storage import RunLayout
from tasks.engines.ray_cluster import Placement
from tasks.engines.resident import ResidentProcess, resident, run_worker
from tasks.engines.workers import LOGPROBS_WORKER, TRAIN_WORKER, TRAINER_SERVER

ONE_SHOT_MODULES = {LogprobsRequest: LOGPROBS_WORKER, UpdateRequest: TRAIN_WORKER}


def trainer_placement(engines: EnginesConfig) -> Placement:
    return Placement.from_config(engines, engines.trainer_bundle)


def call_trainer(
    layout: RunLayout, engines: EnginesConfig, request: LogprobsRequest | UpdateRequest, log_name: str
) -> dict:
    """The request answered by the run's resident trainer, or by a one-shot engine (`engines.resident_trainer: false`)
    logging to the run's `logs/{log_name}.log`."""
    e = engines
    if not e.resident_trainer:
        return run_worker(
            ONE_SHOT_MODULES[type(request)],
            request,
            layout.log_path(log_name),
            ranks=e.train_ranks,
            devices=e.trainer_devices,
            placement=trainer_placement(e),
        )
    return resident_trainer(layout, engines).call(request, label=log_name)


def resident_trainer(layout: RunLayout, engines: EnginesConfig) -> ResidentProcess:
    """This process's resident trainer for the run (started by its first request, or earlier by `spawn`)."""
    e, log = engines, layout.log_path("trainer")
    return resident(
        TRAINER_SERVER,
        layout.run_id,
        lambda: ResidentProcess(
            TRAINER_SERVER, log, ranks=e.train_ranks, devices=e.trainer_devices, placement=trainer_placement(e)
        ),
    )
