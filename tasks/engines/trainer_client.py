"""How the `logprobs` and `optimize` stages reach their engines: the run's resident trainer
(tasks/engines/workers/trainer_server.py, one Ray actor per rank) by default, or a one-shot engine per call with
`engines.resident_trainer: false` (the same requests and results; each call then loads everything from disk).
"""

from __future__ import annotations

import weakref

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
    trainer = resident_trainer(layout, engines)
    if not isinstance(request, UpdateRequest):
        return trainer.call(request, label=log_name)
    _HELD.pop(trainer, None)  # an update that fails leaves the trainer holding nothing
    resp = trainer.call(request, label=log_name)
    _HELD[trainer] = resp["state_id"]
    return resp


# The state id of the checkpoint whose engines (and optimizer state) each resident trainer of this process holds: what
# its last update wrote (tasks/engines/workers/engine_cache.py keeps that engine). Weak: an ended trainer drops out.
_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def trainer_holds(layout: RunLayout, engines: EnginesConfig, checkpoint: str) -> bool:
    """Whether the run's resident trainer in this process holds the engines that wrote `checkpoint`: the next update
    then needs no optimizer state from disk. False for a trainer started since (a resumed run) or one-shot trainers."""
    from tasks.engines.workers.engine_cache import read_state_id

    if not engines.resident_trainer:
        return False
    trainer = resident_trainer(layout, engines)
    held = _HELD.get(trainer)
    return trainer.running and held is not None and held == read_state_id(checkpoint)


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
