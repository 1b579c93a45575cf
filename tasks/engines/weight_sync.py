"""The client side of the collective weight sync (`engines.weight_sync: collective`).

Before a generation that names weights some rollout replicas do not hold, the run's resident trainer, which holds them
(the engine its last update or replay kept), sends them to those replicas through vLLM's weight-transfer API: every
trainer rank is called, with the replicas' Ray actors beside the request, and trainer rank 0 drives the replicas' side
of vLLM's calls while it broadcasts (tasks/engines/workers/weight_transfer_trainer.py). No file is written or read.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from schemas.config import EnginesConfig
from schemas.requests import SendWeightsRequest, VLLMSettings, WeightGroup
from storage import RunLayout
from tasks.engines import ray_cluster
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
    with ThreadPoolExecutor(len(stale)) as pool:  # the trainer drives the replicas' actors: each must be running
        list(pool.map(lambda r: r.start(settings), stale))
    group = _group_for(trainer, stale, engines, settings)
    named = [(f"{r.name} (actor {r.actors[0]._actor_id.hex()[:12]} on node {r.node(0)})", r.actors[0]) for r in stale]
    request = SendWeightsRequest(checkpoint=checkpoint, group=group)
    try:
        answer = trainer.call(request, None, "send-weights", {"replicas": named})
    except Exception:
        # The group is forgotten (the next sync makes a new one) and the replicas ended: one may still wait in it,
        # and each holds weights of no checkpoint; an ended engine restarts at its next request.
        _forget()
        for replica in stale:
            replica.kill()
        raise
    for replica in stale:
        replica.weights = checkpoint
    replicas = answer["replicas"]
    gaps = [a["sync_logprob_gap"] for a in replicas if a["sync_logprob_gap"] is not None]
    _UNREPORTED[checkpoint] = result = {
        # Each replica's receive and load, as the file path's reload is counted (the probe check apart); the trainer's
        # gather and broadcast run meanwhile.
        "sync_seconds": max(a["sync_seconds"] for a in replicas),
        "sync_wall_seconds": time.time() - t0,
        "sync_bytes": answer["sync_bytes"],
        "sync_logprob_gap": max(gaps) if gaps else None,
    }
    return result


# The last sync of each checkpoint's weights, until the first generation with them reports it (a sync made before the
# generation began: one step off-policy, tasks/stages/rollouts.py::sample_ahead_task).
_UNREPORTED: dict[str, dict] = {}


def unreported_sync(checkpoint: str) -> dict | None:
    """The sync that brought the replicas to `checkpoint`'s weights, once: None after it was taken, or when none did."""
    return _UNREPORTED.pop(checkpoint, None)


def _group_for(trainer, replicas: list, engines: EnginesConfig, settings: VLLMSettings) -> WeightGroup:
    """The group of trainer rank 0 and these replicas: the one kept since the last sync when the members are the same
    actors, else a new one."""
    members = (trainer.actors[0]._actor_id.hex(), *(r.actors[0]._actor_id.hex() for r in replicas))
    if _GROUP["members"] == members:
        return _GROUP["group"]
    _forget()
    _GROUP["made"] += 1
    key = hashlib.sha256(f"{os.getpid()}:{_GROUP['made']}:{members}".encode()).hexdigest()[:16]
    head = trainer.nodes[0]  # where trainer rank 0 runs
    if head["ip"] == ray_cluster.LOOPBACK and settings.weight_transfer != "nccl":  # vLLM's NCCL meets over TCP only
        _GROUP["file"] = ray_cluster.meeting_file(engines.ray_address, "weights")
        _GROUP["file"].parent.mkdir(parents=True, exist_ok=True)
        init_method = f"file://{_GROUP['file']}"
    else:
        import ray

        port = ray.get(trainer.actors[0].where.remote())["port"]  # free on that node
        init_method = f"tcp://{head['ip']}:{port}"
    group = WeightGroup(
        key=key,
        backend=settings.weight_transfer,
        init_method=init_method,
        world_size=1 + len(replicas) * settings.tensor_parallel_size,
        tensor_parallel_size=settings.tensor_parallel_size,
        timeout_s=engines.collective_timeout_s,
        bucket_bytes=engines.weight_sync_bucket_mb * 2**20,
    )
    _GROUP.update(members=members, group=group)
    return group


def backend(engines: EnginesConfig, lora: bool) -> str:
    """The vLLM weight-transfer engine: vLLM's `nccl` when the trainer and the replicas are on GPUs of their own
    (disjoint device lists, or Ray GPU bundles on both sides, which Ray fills with different devices); rlpipe's
    `rlpipe_gloo` otherwise: on CPU, for GPUs the trainer and vLLM share (NCCL refuses two ranks on one device, and the
    tensors then travel through host memory), and for a LoRA adapter (vLLM's engines load into the model's own weights
    and cannot carry one)."""
    if lora:
        return "rlpipe_gloo"
    if engines.trainer_devices and engines.rollout_devices:
        return "rlpipe_gloo" if set(engines.trainer_devices) & set(engines.rollout_devices) else "nccl"
    gpu_bundles = engines.trainer_bundle.get("GPU", 0) >= 1 and engines.rollout_bundle.get("GPU", 0) >= 1
    return "nccl" if gpu_bundles else "rlpipe_gloo"


def _forget() -> None:
    """No group kept: its meeting file removed (its members drop it when a request names another key)."""
    if _GROUP["file"] is not None:
        Path(_GROUP["file"]).unlink(missing_ok=True)
    _GROUP.update(members=None, group=None, file=None)


atexit.register(_forget)
