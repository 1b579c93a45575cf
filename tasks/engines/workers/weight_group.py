"""Weights over a process group (`engines.weight_sync: collective`): trainer rank 0 broadcasts named tensors, in
buckets, to every vLLM worker of the rollout replicas, as TRL's vllm-serve and OpenRLHF do; no file is written.

The group is standalone: the trainer's ranks and vLLM's workers each have a default torch.distributed group of their
own already. It is a gloo (tensors in host memory) or NCCL process group on a FileStore when every member is on one
machine (nothing then listens on a network: gloo connects over 127.0.0.1), or on a TCPStore at trainer rank 0's node.
A member keeps one group, by its key, until a request names another key: the client makes a new key when the members
change or a sync failed (tasks/engines/weight_sync.py).

What travels: first a header (JSON: each bucket's tensor names, shapes and dtype, plus whatever the sender adds, such
as an adapter's config) as a length and a byte tensor; then each bucket as one flat tensor of one dtype, `bucket_bytes`
at most (a tensor larger than that is a bucket of its own); the sender packs bucket i+1 while bucket i is on its way.
Within a sync every bucket is a tensor of its own (vLLM keeps references to what it loads until a layer is complete),
and host-memory buckets are kept for the next sync.
No Prefect import: this runs in the trainer's and vLLM's processes.
Imports: torch inside the functions (the client imports this module for nothing but its docstring's contract).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta

from schemas.requests import SendWeightsRequest, WeightGroup

_JOINED: dict = {"key": None, "pg": None}


def join(group: WeightGroup, rank: int):
    """This process's member of `group` at `rank`: the group it keeps when the key is the same, else a new one (the old
    one is left first)."""
    if _JOINED["key"] == group.key:
        return _JOINED["pg"]
    leave()
    import torch.distributed as dist

    timeout = timedelta(seconds=group.timeout_s)
    scheme, _, where = group.init_method.partition("://")
    if scheme == "file":
        store = dist.FileStore(where, group.world_size)
    else:
        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), group.world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(group.key, store)
    if group.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, group.world_size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # One machine: gloo's sockets on loopback (its default device is the interface the host name resolves to).
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if scheme == "file" else None
        options._devices = [device or dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(store, rank, group.world_size, options)
    _JOINED.update(key=group.key, pg=pg)
    return pg


def leave() -> None:
    """Drop the group this process keeps (its sockets close: a peer still waiting in it fails at once)."""
    pg = _JOINED["pg"]
    _JOINED.update(key=None, pg=None)
    if pg is not None:
        try:
            pg.shutdown()
        except Exception:  # noqa: BLE001  (a group that failed may refuse even this; it is dropped all the same)
            pass


def buckets(named: Iterable[tuple[str, object]], bucket_bytes: int) -> list[list[tuple[str, object]]]:
    """Consecutive tensors grouped into buckets of one dtype and at most `bucket_bytes` (a larger tensor alone)."""
    out: list[list] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if not out or out[-1][0][1].dtype != tensor.dtype or size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def send(pg, named: Iterable[tuple[str, object]], bucket_bytes: int, header: dict, device: str = "cpu") -> int:
    """Broadcast the named tensors from rank 0 of `pg`, with `header` (JSON) for the receivers; the bytes sent. Bucket
    k + 1 is packed while bucket k is on its way."""
    import torch

    groups = buckets(named, bucket_bytes)
    plan = [[{"name": n, "shape": list(t.shape)} for n, t in b] for b in groups]
    dtypes = [str(b[0][1].dtype).removeprefix("torch.") for b in groups]
    total = sum(t.numel() * t.element_size() for b in groups for _, t in b)
    _send_header(pg, {**header, "bytes": total, "buckets": plan, "dtypes": dtypes}, device)
    sending = None
    for k, bucket in enumerate(groups):
        flat = _buffer("send", k, sum(t.numel() for _, t in bucket), bucket[0][1].dtype, device)
        torch.cat([t.detach().reshape(-1).to(device) for _, t in bucket], out=flat)
        work = pg.broadcast(flat, 0)
        if sending is not None:
            sending.wait()
        sending = work
    if sending is not None:
        sending.wait()
    return total


def receive(pg, device: str = "cpu") -> tuple[dict, Iterator[tuple[str, object]]]:
    """The sender's header, and an iterator over its (name, tensor) pairs. On a GPU each bucket is received while the
    one before it is consumed; in host memory every bucket is received first: on 2 CPU cores, receiving beside vLLM's
    load made the load 2-3× slower (the demo model: 0.9-1.35 s for both, against 0.7-1.0 s one after the other).
    Consume it whole: the sender waits for every bucket."""
    import torch

    header = _receive_header(pg, device)
    plan, dtypes = header.pop("buckets"), header.pop("dtypes")

    def post(k: int):
        numel = sum(_numel(entry["shape"]) for entry in plan[k])
        flat = _buffer("receive", k, numel, getattr(torch, dtypes[k]), device)
        return flat, pg.broadcast(flat, 0)

    def tensors():
        pending = post(0) if plan else None
        for k in range(len(plan)):
            flat, work = pending
            work.wait()
            pending = post(k + 1) if k + 1 < len(plan) else None
            at = 0
            for entry in plan[k]:
                n = _numel(entry["shape"])
                yield entry["name"], flat[at : at + n].view(entry["shape"])
                at += n

    return header, (tensors() if device != "cpu" else iter(list(tensors())))


def send_held(request: SendWeightsRequest, cache) -> dict:
    """The resident trainer's side of a sync (every rank runs it; rank 0 sends): the policy weights of
    `request.checkpoint`, which the trainer must hold (the engine its last update or replay kept)."""
    from tasks.engines.workers import data_parallel

    engine = cache.held_engine("policy", request.checkpoint)
    if engine is None:
        raise ValueError(
            f"the trainer does not hold the weights of {request.checkpoint} (only those of its last update): they "
            "cannot be sent"
        )
    t0 = time.time()
    named, header = policy_tensors(engine)
    if data_parallel.rank() != 0:
        return {"sync_bytes": 0, "send_seconds": time.time() - t0}
    pg = join(request.group, 0)
    try:
        sent = send(pg, named, request.group.bucket_bytes, header, "cuda" if request.group.backend == "nccl" else "cpu")
    except Exception:
        leave()  # the receivers still in the group fail at once, not at their timeout
        raise
    return {"sync_bytes": sent, "send_seconds": time.time() - t0}


def policy_tensors(engine) -> tuple[list[tuple[str, object]], dict]:
    """(name, tensor) pairs of a DeepSpeed engine's policy as a Hugging Face checkpoint names them (what the file path
    writes), and the header's kind: every weight once (a tied output layer is its embedding, sent once), or with LoRA
    the adapter's weights only, named as in adapter_model.safetensors. Under ZeRO-3 every rank takes part in gathering
    them, and rank 0 holds them."""
    from tasks.engines.workers.lora import is_peft

    gathered = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 else None
    module = engine.module
    if is_peft(module):
        from peft import get_peft_model_state_dict

        return list(get_peft_model_state_dict(module, state_dict=gathered).items()), {"kind": "adapter"}
    state = gathered if gathered is not None else module.state_dict()
    seen, named = set(), []
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            named.append((name, tensor))
    return named, {"kind": "full"}


# Bucket buffers in host memory, kept between syncs: fresh memory costs a page fault and a zeroed page per 4 KiB, 0.22 s
# for the 538 MB of the demo model here (as much as moving it), once for the receiver and once for the sender. The
# price is one model's size of memory on each side (the file path's page cache holds as much). Within a sync every
# bucket has a buffer of its own (vLLM keeps references to a bucket's tensors until their layer is complete); a sync
# starts after the last one is loaded. GPU buffers come from torch's caching allocator instead.
_POOL: dict = {}


def _buffer(side: str, k: int, numel: int, dtype, device: str):
    import torch

    if device != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    buf = _POOL.get((side, k))
    if buf is None or buf.numel() != numel or buf.dtype != dtype:
        buf = _POOL[(side, k)] = torch.empty(numel, dtype=dtype)
    return buf


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _send_header(pg, header: dict, device: str) -> None:
    import torch

    data = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
    pg.broadcast(torch.tensor([data.numel()], dtype=torch.int64, device=device), 0).wait()
    pg.broadcast(data, 0).wait()


def _receive_header(pg, device: str) -> dict:
    import torch

    length = torch.zeros(1, dtype=torch.int64, device=device)
    pg.broadcast(length, 0).wait()
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    pg.broadcast(data, 0).wait()
    return json.loads(data.cpu().numpy().tobytes().decode())
