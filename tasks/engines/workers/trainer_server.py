"""Resident trainer: one Ray actor per rank for a run, that keeps the DeepSpeed engines (policy, critic) and the frozen
reference between iterations, and answers the `logprobs` and `optimize` stages.

Started by tasks/engines/trainer_client.py as one Ray actor per rank (tasks/engines/resident.py).
A message is {"request": a LogprobsRequest or UpdateRequest on the wire (schemas/requests.py)}, the same requests the
one-shot workers (torch_logprobs, deepspeed_train) take; inputs and outputs stay Parquet and checkpoints on disk. What
it reuses, and when, is tasks/engines/workers/engine_cache.py: only state that provably equals the requested checkpoint.
No Prefect import: this runs in its own actor process.
Imports: The DeepSpeed trainer (DeepSpeed alone is 2.6 s of imports) is imported when the first request needs it, which
overlaps the import with the command's own start-up."""

from __future__ import annotations

import time

from schemas.requests import LogprobsRequest, SendWeightsRequest, UpdateRequest, from_wire


def make_answer(warm_start):
    """`warm_start`: a TrainerWarmStart, or None (schemas/requests.py)."""
    import deepspeed  # noqa: F401  (the imports are paid once, here)
    import torch  # noqa: F401

    from tasks.engines.workers import data_parallel, deepspeed_train, torch_logprobs
    from tasks.engines.workers.engine_cache import EngineCache

    data_parallel.init_process_group()  # every rank joins before the first request
    cache = EngineCache()
    if data_parallel.world() == 1:  # DeepSpeed's save has collectives, which must not run beside a request's
        from tasks.engines.workers.deferred_state import DeferredState

        cache.deferred = DeferredState()
    if warm_start is not None:
        load_ahead(warm_start, cache)
    handlers = {
        LogprobsRequest: torch_logprobs.handle,
        UpdateRequest: deepspeed_train.handle,
        SendWeightsRequest: send_weights,  # with the message's replicas, below
    }

    def answer(msg: dict) -> dict:
        request = from_wire(msg["request"])
        if type(request) not in handlers:
            raise ValueError(f"the trainer does not take a {type(request).__name__}")
        hits = dict(cache.hits)
        t0 = time.time()
        # The last update's optimizer state, before anything changes its engine. Sending the weights only reads them,
        # beside the writer (which reads the optimizer's moments), except ZeRO-3's gather, a collective of its own.
        if not isinstance(request, SendWeightsRequest) or cache.partitioned():
            finish_deferred()
        print(
            f"[trainer rank {data_parallel.rank()}/{data_parallel.world()}] {type(request).__name__} "
            f"{msg.get('label', '')}",
            flush=True,
        )
        if isinstance(request, SendWeightsRequest):  # the replicas' Ray actors travel beside the request
            resp = send_weights(request, cache, msg["replicas"])
        else:
            resp = handlers[type(request)](request, cache)
        reused = {f"reused_{k}": cache.hits[k] - hits[k] for k in hits}
        print(f"[trainer] done in {time.time() - t0:.2f}s {reused}", flush=True)
        return {**resp, **reused}

    def finish_deferred() -> None:
        done = cache.deferred.finish() if cache.deferred is not None else None
        if done is not None:
            print(
                f"[trainer] wrote the last update's optimizer state in {done[0]:.2f}s while the stages ran "
                f"(waited {done[1]:.2f}s for it here)",
                flush=True,
            )

    answer.finish = finish_deferred  # before the trainer shuts down (tasks/engines/resident.py)
    return answer


def send_weights(request, cache, replicas: list) -> dict:
    """A SendWeightsRequest: the held policy to `replicas` [(name, Ray actor)] through vLLM's weight-transfer API.
    vLLM is imported here, at the first sync: a trainer on a machine without vLLM (the device check) never needs it."""
    from tasks.engines.workers.weight_transfer_trainer import send_held

    return send_held(request, cache, replicas)


def load_ahead(start, cache) -> None:
    """The reference and the first update's engine, loaded before any request (1.4 s of a demo run's first update, and
    more for a larger model): the run's first stages and vLLM's start run meanwhile. Every rank builds the engine,
    which is a collective step under ZeRO."""
    from tasks.engines.workers.deepspeed_train import load_policy
    from tasks.engines.workers.torch_logprobs import load_lm
    from tasks.engines.workers.training import deepspeed_engine

    t0 = time.time()
    if start.engine.lora is None:  # with LoRA the reference is the engine's own model with its adapter switched off
        cache.frozen(start.model_path, lambda: load_lm(start.model_path, start.dtype))
    # gas 1 for now: the update sets its batch size on the engine it takes (as on an engine kept from the last update).
    engine, optimizer = deepspeed_engine(load_policy(start.model_path, start.engine.lora), start.engine, gas=1)
    cache.keep_loaded_engine("policy", start.model_path, engine, optimizer, start.engine)
    print(f"[trainer] loaded {start.model_path} and its engine ahead in {time.time() - t0:.2f}s", flush=True)


def warm() -> None:
    """What a trainer spawned held does before it is released (tasks/engines/resident.py): torch's, DeepSpeed's and
    transformers' imports."""
    import deepspeed  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from tasks.engines.workers import deepspeed_train, torch_logprobs  # noqa: F401
