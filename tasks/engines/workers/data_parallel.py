"""Data parallelism for the DeepSpeed trainers: which rank this process is, how a batch is shared, and the few
collectives the workers need besides DeepSpeed's own.

A trainer of `engines.train_ranks` ranks is one Ray actor per rank, started with the standard `torch.distributed`
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: tasks/engines/resident.py sets it, at rank 0's
node address, on one machine or several) and each given every request. Without it a worker is rank 0 of 1. Every
rank reads the same request and the same Parquet input, so the split is a pure function of (indices, world size,
rank): nothing is scattered.

Why dummy micro-steps: DeepSpeed reduces gradients inside backward (ZeRO 1/2) and gathers ZeRO-3's partitioned
weights inside forward, so every rank must run as many forward/backward passes as the others. A rank with fewer
rows runs a zero-weighted pass on a real row instead of skipping.
No Prefect import: this runs in the worker processes.
Imports: torch.distributed and DeepSpeed are imported inside functions: the Prefect process imports this module (rank
environments) and never DeepSpeed (2.6 s).
"""

from __future__ import annotations

import fcntl
import math
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

# A torch build lock older than this, found while no rlpipe process is loading the op, was left by a killed process
# (building the op from scratch takes about 30 s on 2 cores).
STALE_BUILD_LOCK_S = 120
# A collective that waits longer than this fails (naming its rank): a rank that hangs, or whose node is lost, must not
# hold the others forever. Each request reaches every rank directly, so no collective waits between requests.
TIMEOUT_ENV = "RLPIPE_COLLECTIVE_TIMEOUT_S"
RENDEZVOUS_ENV = "RLPIPE_RENDEZVOUS"  # a torch.distributed init_method (file://...) for ranks on one machine
DEFAULT_TIMEOUT_S = 600.0
_CONTROL = {"group": None}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_comm_op() -> None:
    """Load DeepSpeed's shared-memory collectives op (CPU), as init_distributed would, without hanging on a stale lock.

    torch takes `<build dir>/lock` around every JIT load, even of an op already built, and a process killed while
    holding it (a command stopped in its first seconds) leaves the file behind: every later load on the machine then
    waits for it forever. Here the load runs under an flock of our own, which the kernel releases when its holder
    dies; a torch lock found by its holder is either being held by another program or stale, and is removed once it
    is older than STALE_BUILD_LOCK_S. The op is then cached in this process (OpBuilder._loaded_ops)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return
    build_dir = Path(_get_build_directory(builder.name, verbose=False))
    with open(build_dir.parent / f"{build_dir.name}.rlpipe-lock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        torch_lock = build_dir / "lock"
        while torch_lock.exists():
            try:
                if time.time() - torch_lock.stat().st_mtime > STALE_BUILD_LOCK_S:
                    torch_lock.unlink()
                    print(f"removed a stale build lock left by a killed process: {torch_lock}", flush=True)
                    break
            except FileNotFoundError:
                break
            time.sleep(0.5)
        builder.load(verbose=False)


def init_process_group() -> None:
    """Join the trainer's process group (NCCL on GPU, gloo on CPU); a worker started alone is rank 0 of 1. Safe to
    call again. The ranks meet through RENDEZVOUS_ENV's file where the client set one (ranks on one machine), else at
    MASTER_ADDR:MASTER_PORT: torch's TCP store listens on every interface, which a machine that must stay on loopback
    cannot have. A single rank meets nobody: its group is made on an in-memory store (no file, no listener), and
    DeepSpeed takes it as it is."""
    import deepspeed
    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    load_comm_op()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if world() == 1 and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=collective_timeout())
    rendezvous = os.environ.get(RENDEZVOUS_ENV)
    deepspeed.init_distributed(
        dist_backend=backend,
        auto_mpi_discovery=False,
        verbose=False,
        timeout=collective_timeout(),
        init_method=rendezvous,
        **({"rank": rank(), "world_size": world()} if rendezvous else {}),
    )
    if world() > 1:
        control_group()  # made now, in the same order on every rank (creating a group is itself a collective)


def collective_timeout() -> timedelta:
    """`engines.collective_timeout_s`, as the client passed it to the ranks."""
    return timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))


def control_group():
    """A gloo group for small Python objects (metrics, gathered rows, a checkpoint's id): objects need no GPU."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init_process_group()
    if _CONTROL["group"] is None:
        _CONTROL["group"] = dist.new_group(backend="gloo", timeout=collective_timeout())
    return _CONTROL["group"]


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if world() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def all_gather(obj) -> list:
    """Every rank's `obj`, by rank."""
    if world() == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world()
    dist.all_gather_object(out, obj, group=control_group())
    return out


def sum_over_ranks(totals: dict[str, float]) -> dict[str, float]:
    """Each key summed over the ranks (keys missing on a rank count as 0)."""
    merged: dict[str, float] = {}
    for part in all_gather(totals):
        for key, value in part.items():
            merged[key] = merged.get(key, 0.0) + value
    return merged


def accumulation_steps(batch_rows: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-steps per optimizer step when `batch_rows` rows are shared by `world_size` ranks."""
    return max(1, math.ceil(math.ceil(batch_rows / world_size) / micro_batch_size))


def rank_micro_batches(
    indices: list[int], gas: int, world_size: int, rank_: int, chunk: int | None = None
) -> list[list[int]]:
    """This rank's micro-batches of a batch: its rows are rank, rank + W, rank + 2W, ..., dealt round-robin over `gas`
    micro-batches, or cut into consecutive chunks of `chunk` rows. With several ranks there are always `gas` of them,
    an empty one being a dummy step; alone, empty ones are left out (nothing to keep in step with)."""
    mine = indices[rank_::world_size]
    parts = [mine[i : i + chunk] for i in range(0, gas * chunk, chunk)] if chunk else [mine[i::gas] for i in range(gas)]
    return parts if world_size > 1 else [p for p in parts if p]


def contiguous_micro_batches(indices: list[int], gas: int, world_size: int, rank_: int) -> list[list[int]]:
    """This rank's micro-batches of a batch whose rows that belong together are next to each other (a group's samples,
    which share a prompt): the batch is cut into world × gas consecutive pieces of near-equal size, and rank r takes
    pieces r·gas to (r+1)·gas − 1. Empty pieces are dummy steps with several ranks, left out alone."""
    size = math.ceil(len(indices) / (world_size * gas))
    parts = [indices[i * size : (i + 1) * size] for i in range(rank_ * gas, (rank_ + 1) * gas)]
    return parts if world_size > 1 else [p for p in parts if p]


def micro_steps(batch: list[int], parts: list[list[int]]):
    """(k, rows, scale) for each of this rank's micro-batches. Losses are sums over the whole batch divided by the
    batch's normalizer, and DeepSpeed averages gradients over the ranks, so a real step is scaled by the world size;
    a dummy step runs batch[0]'s row with scale 0 (its metrics must be left out)."""
    w = float(world())
    for k, idx in enumerate(parts):
        yield k, (idx or batch[:1]), (w if idx else 0.0)


def map_in_order(fn, items: list) -> list:
    """[fn(x) for x in items], the items dealt round-robin over the ranks and the results gathered back in order on
    every rank. Ranks with fewer items call fn on items[0] and drop the result, to stay in lockstep (ZeRO-3)."""
    w, r = world(), rank()
    if w == 1:
        return [fn(x) for x in items]
    mine = items[r::w]
    out = [fn(x) for x in mine]
    for _ in range(math.ceil(len(items) / w) - len(mine)):
        fn(items[0])
    result = [None] * len(items)
    for rr, part in enumerate(all_gather(out)):
        result[rr::w] = part
    return result
