"""The client side of the collective weight sync (`engines.weight_sync: collective`).

Before a generation that names weights some rollout replicas do not hold, the run's resident trainer, which holds them
(the engine its last update or replay kept), sends them to those replicas over a process group: the trainer's ranks
and the replicas are called at once, trainer rank 0 broadcasts, every replica's vLLM workers receive and load
(tasks/engines/workers/weight_group.py, tasks/engines/workers/vllm_receiver.py). No file is written or read.

Otherwise (engines.weight_sync file, or weights this process's trainer does not hold, e.g. the starting model) nothing
happens here: each replica reloads the checkpoint's files in place as it takes the generation request.

The group: rank 0 is trainer rank 0; the replicas' workers follow, tensor_parallel_size per replica. It meets through a
file when trainer rank 0 is on loopback (one machine: nothing listens on a network), else at a free port of trainer rank
0's node. Its members keep it between syncs while the members stay the same actors; a sync that fails ends the group
(and any member still waiting in it), and the next sync makes a new one.
Imports: ray and the engines' modules inside functions (the CLI imports the stages, which import this module).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from schemas.config import EnginesConfig
from schemas.requests import ReceiveWeightsRequest, SendWeightsRequest, VLLMSettings, WeightGroup
from storage import RunLayout
from tasks.engines import ray_cluster
from tasks.engines.resident import HUNG_GRACE_S
from tasks.engines.trainer_client import resident_trainer, trainer_holds

_GROUP: dict = {"members": None, "group": None, "file": None, "made": 0}


def sync_replicas(
    layout: RunLayout, engines: EnginesConfig, replicas: list, checkpoint: str, settings: VLLMSettings
) -> dict | None:
    """Send the weights of `checkpoint` to every replica that does not hold them, when this process's resident trainer
    holds them and the config asks for it; {sync_seconds, sync_bytes, sync_logprob_gap}, or None when no replica was
    sent anything. `settings` start a replica not yet started (from weights on disk)."""
    stale = [r for r in replicas if r.weights != checkpoint]
    if not stale or engines.weight_sync != "collective" or not trainer_holds(layout, engines, checkpoint):
        return None
    trainer = resident_trainer(layout, engines)
    t0 = time.time()
    group = _group_for(trainer, stale, engines, settings.tensor_parallel_size)
    with ThreadPoolExecutor(1 + len(stale)) as pool:
        sending = pool.submit(
            trainer.call, SendWeightsRequest(checkpoint=checkpoint, group=group), None, "send-weights"
        )
        receiving = [
            pool.submit(
                replica.call,
                ReceiveWeightsRequest(
                    model_path=checkpoint, group=group, first_rank=1 + k * settings.tensor_parallel_size
                ),
                settings,
            )
            for k, replica in enumerate(stale)
        ]
        answers = _all_or_end([sending, *receiving], [trainer, *stale])
    for replica in stale:
        replica.weights = checkpoint
    gaps = [a["sync_logprob_gap"] for a in answers[1:] if a["sync_logprob_gap"] is not None]
    _UNREPORTED[checkpoint] = result = {
        # Each replica's receive and load, as the file path's reload is counted (the probe check apart); the trainer's
        # gather and broadcast run meanwhile.
        "sync_seconds": max(a["sync_seconds"] for a in answers[1:]),
        "sync_wall_seconds": time.time() - t0,
        "sync_bytes": answers[0]["sync_bytes"],
        "sync_logprob_gap": max(gaps) if gaps else None,
    }
    return result


# The last sync of each checkpoint's weights, until the first generation with them reports it (a sync made before the
# generation began: one step off-policy, tasks/stages/rollouts.py::sample_ahead_task).
_UNREPORTED: dict[str, dict] = {}


def unreported_sync(checkpoint: str) -> dict | None:
    """The sync that brought the replicas to `checkpoint`'s weights, once: None after it was taken, or when none did."""
    return _UNREPORTED.pop(checkpoint, None)


def _all_or_end(futures: list, parties: list) -> list:
    """Every party's answer. When one fails, the others get HUNG_GRACE_S to fail too (their peer left the group, so
    they normally do at once); one still waiting then is ended, and the group is forgotten: the next sync makes a new
    one, and an ended engine restarts at its next request."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    failed = [f for f in futures if f.done() and f.exception() is not None]
    if not failed:
        return [f.result() for f in futures]
    _forget()
    _, waiting = wait(futures, timeout=HUNG_GRACE_S)
    for future, party in zip(futures, parties):
        if future in waiting:
            party.kill()
    raise failed[0].exception()


def _group_for(trainer, replicas: list, engines: EnginesConfig, tp: int) -> WeightGroup:
    """The group of trainer rank 0 and these replicas: the one kept since the last sync when the members are the same
    actors, else a new one."""
    members = (trainer.actors[0]._actor_id.hex(), *(r.actors[0]._actor_id.hex() for r in replicas))
    if _GROUP["members"] == members:
        return _GROUP["group"]
    _forget()
    _GROUP["made"] += 1
    key = hashlib.sha256(f"{os.getpid()}:{_GROUP['made']}:{members}".encode()).hexdigest()[:16]
    head = trainer.nodes[0]  # where trainer rank 0 runs
    if head["ip"] == ray_cluster.LOOPBACK:
        _GROUP["file"] = ray_cluster.meeting_file(engines.ray_address, "weights")
        _GROUP["file"].parent.mkdir(parents=True, exist_ok=True)
        init_method = f"file://{_GROUP['file']}"
    else:
        import ray

        port = ray.get(trainer.actors[0].where.remote())["port"]  # free on that node
        init_method = f"tcp://{head['ip']}:{port}"
    group = WeightGroup(
        key=key,
        init_method=init_method,
        world_size=1 + len(replicas) * tp,
        backend=backend(engines),
        timeout_s=engines.collective_timeout_s,
        bucket_bytes=engines.weight_sync_bucket_mb * 2**20,
    )
    _GROUP.update(members=members, group=group)
    return group


def backend(engines: EnginesConfig) -> str:
    """NCCL when the trainer and the replicas are on GPUs of their own (disjoint device lists, or Ray GPU bundles on
    both sides, which Ray fills with different devices); gloo otherwise: on CPU, and for GPUs the trainer and vLLM share
    (NCCL refuses two ranks on one device), the tensors then travel through host memory."""
    if engines.trainer_devices and engines.rollout_devices:
        return "gloo" if set(engines.trainer_devices) & set(engines.rollout_devices) else "nccl"
    gpu_bundles = engines.trainer_bundle.get("GPU", 0) >= 1 and engines.rollout_bundle.get("GPU", 0) >= 1
    return "nccl" if gpu_bundles else "gloo"


def _forget() -> None:
    """No group kept: its meeting file removed (its members drop it when a request names another key)."""
    if _GROUP["file"] is not None:
        Path(_GROUP["file"]).unlink(missing_ok=True)
    _GROUP.update(members=None, group=None, file=None)


atexit.register(_forget)
