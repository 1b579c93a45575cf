"""Where an engine's ranks run and how they meet: each rank's actor options in the engine's placement group (its own,
or one shared by name: `Placement.share`), the one line for a group Ray does not place, and what each rank starts
with in its environment (its threads, its temporary folder, torch.distributed's variables at rank 0's node, or a
meeting file on one machine). tasks/engines/resident.py's ResidentProcess asks these as it spawns and releases its
actors.
Imports: ray (0.6 s) is imported inside functions: the CLI imports this module at every start.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path
from typing import Callable

from tasks.engines import ray_cluster
from tasks.engines.launch import WorkerError
from tasks.engines.ray_cluster import Placement
from tasks.engines.workers import data_parallel

SHARED_GROUPS: dict[str, object] = {}  # Placement.share -> its placement group


def thread_env(ranks: int) -> dict:
    """Ranks that each take every core slow each other down several times over: the cores are shared out (a
    thread count the user set wins). One rank chooses for itself, as a process of its own would (vLLM-CPU keeps one
    torch thread for serving, and binds its compute threads itself): the OMP_NUM_THREADS Ray sets in an actor
    (the CPUs it reserved, or 1) is removed."""
    if os.environ.get("OMP_NUM_THREADS"):
        return {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)) if ranks > 1 else None}


def temp_env(placement: Placement) -> dict:
    """The engines' temporary files (vLLM's rendezvous file, one per start) in the embedded instance's folder,
    which goes with it (and with the reaper's sweep); torch's compile cache stays where it was."""
    if placement.ray_address:
        return {}
    return {
        "TMPDIR": os.path.join(ray_cluster.temp_dir_for(os.getpid()), "engines"),
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
    }


def actor_options(name: str, ranks: int, p: Placement) -> tuple[Callable[[int], dict], object, tuple | None]:
    """Each rank's actor options: its reserved resources, in its bundle of the engine's placement group; the group when
    the engine owns it (removed with it; None when shared or none), and (group, its ready() ref, its bundles) until Ray
    has placed it."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = dict(p.bundle)
    reserve = {
        "num_cpus": bundle.pop("CPU", 0),
        "num_gpus": bundle.pop("GPU", 0),
        "resources": bundle,
    }
    if not p.bundle:
        return (lambda r: reserve), None, None
    bundles = [dict(p.bundle)] * (ranks * p.replicas)
    if not p.share or p.share not in SHARED_GROUPS:
        reason = ray_cluster.why_unplaceable(dict(p.bundle), len(bundles), p.strategy, ray_cluster.node_resources())
        if reason:  # Ray would keep it pending, and the engine would wait START_DEADLINE_S for nothing
            raise WorkerError(f"{name} cannot be placed on this Ray cluster: {reason} ({p.strategy})")
    own = None
    if not p.share:
        own = group = placement_group(bundles, strategy=p.strategy)
    elif p.share not in SHARED_GROUPS:
        group = SHARED_GROUPS[p.share] = placement_group(bundles, strategy=p.strategy)
    else:
        group = SHARED_GROUPS[p.share]

    def options(r: int) -> dict:
        return {
            **reserve,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=p.index * ranks + r
            ),
        }

    return options, own, (group, group.ready(), bundles)


def not_placed(name: str, placed: tuple, p: Placement) -> WorkerError:
    """The one line for a placement group Ray has not placed within engines.placement_timeout_s: what the group needs
    and what the nodes have free (other engines' groups may hold the rest)."""
    _, _, bundles = placed
    free = ray_cluster.node_resources(free=True)
    reason = ray_cluster.why_unplaceable(bundles[0], len(bundles), p.strategy, free)
    return WorkerError(
        f"{name} was not placed within {p.placement_timeout_s:g}s (engines.placement_timeout_s): "
        f"{len(bundles)} bundles of {ray_cluster.bundle_text(bundles[0])} ({p.strategy}); "
        + (f"free now (other engines' groups hold the rest): {reason}" if reason else "it would fit what is free now")
    )


def rank_env(r: int, ranks: int, nodes: list[dict], devices: list[int] | None, p: Placement) -> dict:
    """The standard torch.distributed variables (what torchrun sets): rank 0's node address and a port free there.
    On a GPU Ray gives each actor its own devices, so its local rank is 0 among what it sees."""
    if ranks == 1:
        return {}
    head = nodes[0]
    return {
        "RANK": str(r),
        "LOCAL_RANK": "0" if not devices else str(r),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(sum(n["node_id"] == nodes[r]["node_id"] for n in nodes)),
        "MASTER_ADDR": head["ip"],
        "MASTER_PORT": str(head["port"]),
        data_parallel.TIMEOUT_ENV: str(p.collective_timeout_s),
    }


def meeting_place(name: str, ranks: int, nodes: list[dict], p: Placement) -> tuple[dict, Path | None]:
    """Where the ranks meet, the same for all of them: at MASTER_ADDR:MASTER_PORT, or, when rank 0 is on loopback
    (one machine, which must stay on it), through a file (torch's TCP store would listen on every interface), with
    gloo connecting over `lo` (not the interface the host name resolves to); (its variables, the file, which goes with
    the ranks)."""
    if ranks == 1 or nodes[0]["ip"] != ray_cluster.LOOPBACK:
        return {}, None
    rendezvous = ray_cluster.meeting_file(p.ray_address, f"rendezvous-{name}")
    rendezvous.parent.mkdir(parents=True, exist_ok=True)
    return {data_parallel.RENDEZVOUS_ENV: f"file://{rendezvous}", "GLOO_SOCKET_IFNAME": "lo"}, rendezvous
