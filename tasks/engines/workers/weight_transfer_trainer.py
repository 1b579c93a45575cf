"""The trainer (sending) side of a weight sync through vLLM's weight-transfer API: `rlpipe_gloo`'s trainer engine
(`GlooTrainerWeightTransferEngine`, as vLLM's NCCLTrainerWeightTransferEngine), the client that drives the replicas
through vLLM's four calls (`ReplicaClient`), the source it broadcasts (`PolicySource`), and `send_held`, which the
resident trainer calls on every rank. The engine (receiving) side, and what both sides share, is
tasks/engines/workers/weight_transfer.py's, which also registers this engine with vLLM's factories.
No Prefect import: this runs in the trainer's processes.
Imports: torch and vLLM at the top: only those processes import this module.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

from tasks.engines.workers.weight_transfer import (
    BACKEND,
    GlooInitInfo,
    GlooUpdateInfo,
    chunks,
    close_group,
    host_buffer,
    join,
    register,
    tensor_bytes,
)


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = BACKEND

    init_method: str
    key: str
    world_size: int
    timeout_s: float
    buffer_size_bytes: int


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


# A sync itself, in the resident trainer's processes (tasks/engines/workers/trainer_server.py).

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
