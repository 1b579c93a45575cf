"""vLLM server: one resident engine answering generation jobs (rollout rounds, eval passes).

Started by tasks/engines/vllm_client.py as a Ray actor (tasks/engines/resident.py).
A job is {prompts_path, out_path, n, temperature, top_p, max_tokens, seed, stop, stop_token_ids, min_tokens}; it reads
Parquet (prompt_id, prompt_token_ids, and optionally a row's seed_offset, max_tokens and min_tokens) and writes Parquet
with one row per sample: prompt_id, sample_idx, token_ids (EOS included when it stopped), text, sampler_logprobs,
finish_reason, truncated, length.
No Prefect import: this runs in its own process.
Imports: vLLM (3.5 s of imports) is imported inside functions: a held server imports it while the command checks its
input, and the settings set its environment (threads, KV-cache space) before it is imported.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from schemas.requests import (
    GenerationJob,
    GenerationReply,
    JobTiming,
    VLLMSettings,
    WeightUpdateCall,
    from_wire,
    to_wire,
)
from tasks.engines.workers.vllm_weights import Adapters, sampler_probe_gap, sync_weights


def head_entropy(steps, k: int) -> float:
    """ARPO's entropy of a generation's start: over its first k positions, the sum of −Σ p·log p over the candidates
    vLLM returned at each (the top ones and the sampled token), a truncated entropy (the reference code's)."""
    return float(-sum(math.exp(c.logprob) * c.logprob for step in steps[:k] for c in step.values()))


def _rows(outputs, prompt_ids, top: bool = False, entropy_tokens: int = 0):
    rows = []
    for pid, out in zip(prompt_ids, outputs):
        for k, o in enumerate(out.outputs):
            token_ids = list(o.token_ids)
            # logprobs=0 returns the sampled token's own logprob at each step (logprobs=k: and the top k).
            lps = [float(step[tid].logprob) for tid, step in zip(token_ids, o.logprobs or [])]
            extra = {}
            if top:
                first = o.logprobs[0].values() if o.logprobs else ()
                extra["first_top"] = [{"token": c.decoded_token or "", "logprob": float(c.logprob)} for c in first]
            if entropy_tokens:
                extra["head_entropy"] = head_entropy(o.logprobs or [], entropy_tokens)
            rows.append(
                {
                    **extra,
                    "prompt_id": pid,
                    "sample_idx": k,
                    "token_ids": token_ids,
                    "text": o.text,
                    "sampler_logprobs": lps,
                    "finish_reason": str(o.finish_reason),
                    "truncated": o.finish_reason == "length",
                    "length": len(token_ids),
                }
            )
    return rows


def _start_engine(settings: VLLMSettings):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(settings.kv_cache_gib)))
    # collective_rpc with a function (_refresh_lm_head) pickles it to the engine's own worker process.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm.platforms import current_platform

    extra = {}
    if current_platform.is_cpu() and settings.tensor_parallel_size == 1:
        # One process. vLLM-CPU otherwise runs three (this one, its engine core, and a worker whose compute threads are
        # bound to all cores but one, the last being kept for the engine core's loop), each importing vLLM: measured on
        # 2 cores with the 20M bench model, the start went from 38.5 s to 13.3 s and generation from 935 to 1,327
        # tokens/s, since the compute now has both cores.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        extra["distributed_executor_backend"] = "uni"
    from vllm import LLM

    if current_platform.is_cpu():
        # A seeded request whose prefill is chunked needs its generator rewound, which vLLM-CPU cannot do ("CPU
        # Generator does not use offset", the engine dies): keep every prompt's prefill whole, with vLLM's own token
        # budget (4,096) unless the context is longer.
        with open(os.path.join(settings.model_path, "config.json")) as f:
            context = json.load(f).get("max_position_embeddings") or 0
        extra.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, context))
    else:  # a GPU shared with the resident trainer: vLLM takes only its share
        extra = {"gpu_memory_utilization": settings.gpu_memory_utilization}
    if settings.max_lora_rank:  # the policy trains an adapter: each request names the iteration's (one at a time)
        extra.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(settings.max_lora_rank))
        if current_platform.is_cpu():
            from tasks.engines.workers.vllm_cpu_lora import install

            install()  # its LoRA products, one matmul per adapter (tasks/engines/workers/vllm_cpu_lora.py)
    if settings.sleep:  # engines.colocate_sleep: vLLM allocates through its own allocator to release it later
        extra["enable_sleep_mode"] = True
    from tasks.engines.workers.weight_transfer import register

    register()  # this process's workers (vLLM's own processes register it as a plugin)
    return LLM(
        model=settings.model_path,
        dtype=settings.dtype,
        seed=settings.seed,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=True,
        enable_prefix_caching=settings.prefix_caching,
        max_logprobs=settings.max_logprobs,
        logprobs_mode=settings.logprobs_mode,
        # The trainer's weights through vLLM's weight-transfer API (engines.weight_sync collective)
        weight_transfer_config={"backend": settings.weight_transfer},
        **extra,
    )


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's LoRAConfig.max_lora_rank accepts these only


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds `rank` (its buffers are sized by it; a smaller adapter fits)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank {rank} is above vLLM's largest LoRA rank, {VLLM_LORA_RANKS[-1]}")
    return fits[0]


def _run_jobs(llm, jobs: tuple[GenerationJob, ...], lora=None) -> tuple[JobTiming, ...]:
    import polars as pl
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    schema = {
        "prompt_id": pl.Utf8,
        "sample_idx": pl.Int32,
        "token_ids": pl.List(pl.Int32),
        "text": pl.Utf8,
        "sampler_logprobs": pl.List(pl.Float32),
        "finish_reason": pl.Utf8,
        "truncated": pl.Boolean,
        "length": pl.Int32,
    }
    timings = []
    for job in jobs:
        prompts = pl.read_parquet(job.prompts_path)
        # A prompt file may set a row's seed (job seed + seed_offset, else + its row: the rollouts stage deals rows to
        # replicas) and token limits (partial rollouts continue each sequence with what is left of its budget).
        per_row = {
            key: prompts[key].to_list() if key in prompts.columns else None
            for key in ("seed_offset", "max_tokens", "min_tokens")
        }
        params = [
            SamplingParams(
                n=job.n,
                temperature=job.temperature,
                top_p=job.top_p,
                max_tokens=per_row["max_tokens"][i] if per_row["max_tokens"] else job.max_tokens,
                min_tokens=per_row["min_tokens"][i] if per_row["min_tokens"] else job.min_tokens,
                logprobs=job.top_logprobs,
                seed=job.seed + (per_row["seed_offset"][i] if per_row["seed_offset"] else i),
                stop=list(job.stop) or None,
                stop_token_ids=list(job.stop_token_ids) or None,
            )
            for i in range(prompts.height)
        ]
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts["prompt_token_ids"].to_list()]
        t1 = time.time()
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        gen_seconds = time.time() - t1
        top = {"first_top": pl.List(pl.Struct({"token": pl.Utf8, "logprob": pl.Float64}))} if job.top_logprobs else {}
        if job.entropy_tokens:
            top["head_entropy"] = pl.Float64
        rows = _rows(outputs, prompts["prompt_id"].to_list(), "first_top" in top, job.entropy_tokens)
        df = pl.DataFrame(rows, schema={**top, **schema})
        df.write_parquet(job.out_path)
        timings.append(JobTiming(generate_seconds=gen_seconds, tokens=int(df["length"].sum())))
    return tuple(timings)


def make_answer(settings: VLLMSettings):
    """Resident mode: start one engine, then answer its messages: a GenerateRequest (answered with a GenerationReply,
    on the wire), or a WeightUpdateCall (one step of a sync from the trainer through vLLM's weight-transfer API,
    engines.weight_sync collective).

    A `generate` for other weights than the engine holds first syncs them in place from the checkpoint's files (tied
    embeddings included). After the start and after every sync the answer carries `sync_logprob_gap`, the sampler's gap
    to the trainer's probe logprobs, which the caller checks against its threshold.
    """
    import vllm

    from tasks.engines.launch import peak_rss_gib
    from tasks.engines.workers.lora import adapter_base, is_adapter

    t0 = time.time()
    # An engine asked to start on an adapter checkpoint starts on its base model and loads the adapter at the first
    # request, as for any later one (a DPO run's eval after training starts its engine there).
    base = adapter_base(settings.model_path) if is_adapter(settings.model_path) else settings.model_path
    llm = _start_engine(dataclasses.replace(settings, model_path=base))
    adapters = Adapters(llm, base) if settings.max_lora_rank else None
    # The KV cache the engine reserved (GiB; None where vLLM sized it from GPU memory): a default vLLM-CPU engine takes
    # a share of the machine's memory, which on a 135M model grew to 23 GB resident.
    reserved = llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes
    kv_cache_gib = reserved / 2**30 if reserved else None
    state = {"current": base, "start_seconds": time.time() - t0, "lora": None, "asleep": False}
    state.update(sync_t0=0.0, sync_bytes=0, adapter_dir=None)  # a weight sync's, between its calls (_weight_call)
    state["gap"] = sampler_probe_gap(llm, state["current"])

    def answer(msg: dict) -> dict:
        request = from_wire(msg["request"])
        _awake(llm, state)
        if isinstance(request, WeightUpdateCall):
            return _weight_call(llm, adapters, state, request)
        sync_seconds = 0.0
        if request.model_path != state["current"]:
            state["current"] = None  # a sync that fails halfway leaves weights that match no checkpoint
            t1 = time.time()
            if adapters is not None:  # LoRA: load the checkpoint's adapter; the base weights stay
                state["lora"] = adapters.request_for(request.model_path)
            else:
                sync_weights(llm, request.model_path)
            sync_seconds, state["current"] = time.time() - t1, request.model_path
            state["gap"] = sampler_probe_gap(llm, state["current"], state["lora"])
        timings = _run_jobs(llm, request.jobs, state["lora"])
        if settings.sleep:  # the trainer, colocated, may run next: its GPU memory back until the next request
            llm.sleep(level=1)
            state["asleep"] = True
        reply = GenerationReply(
            engine_start_seconds=state["start_seconds"],
            sync_seconds=sync_seconds,
            sync_logprob_gap=state["gap"],
            jobs=timings,
            vllm_version=vllm.__version__,
            peak_rss_gib=peak_rss_gib(),
            kv_cache_gib=kv_cache_gib,
        )
        state["start_seconds"] = 0.0  # only the first answer pays the start
        return to_wire(reply)

    return answer


def _awake(llm, state: dict) -> None:
    """engines.colocate_sleep: the engine back on its GPU (weights restored, KV cache reallocated) before anything reads
    or writes its weights; the probe after the next sync checks they are the trainer's (TRL #5312: after a sleep, the
    weights once silently never reached the sampler)."""
    if state["asleep"]:
        llm.wake_up()
        state["asleep"] = False


def _weight_call(llm, adapters: Adapters | None, state: dict, call: WeightUpdateCall) -> dict:
    """One of vLLM's weight-sync calls, made by the trainer's client (tasks/engines/workers/weight_transfer.py); the
    finish answers with the sync's seconds, bytes and probe gap."""
    from tasks.engines.workers.weight_transfer import adapter_folder, tensor_bytes

    if call.op == "init":
        llm.init_weight_transfer_engine({"init_info": call.info})
    elif call.op == "start":
        state["current"] = None  # a sync that fails halfway leaves weights that match no checkpoint
        state.update(sync_t0=time.time(), adapter_dir=None)
        llm.start_weight_update()
    elif call.op == "update":
        info = dict(call.info)
        if adapters is not None:  # LoRA: the adapter written as a folder, loaded at the finish
            info["adapter_dir"] = state["adapter_dir"] = adapter_folder(call.model_path)
        state["sync_bytes"] = sum(tensor_bytes(info["dtype_names"], info["shapes"]))
        llm.update_weights({"update_info": info})
    else:
        llm.finish_weight_update()
        if state["adapter_dir"] is not None:
            state["lora"] = adapters.received(state["adapter_dir"], call.model_path)
        else:
            llm.reset_prefix_cache()
        state["current"], seconds = call.model_path, time.time() - state["sync_t0"]
        state["gap"] = sampler_probe_gap(llm, state["current"], state["lora"])
        return {"sync_seconds": seconds, "sync_bytes": state["sync_bytes"], "sync_logprob_gap": state["gap"]}
    return {}


def warm() -> None:
    """What a server spawned held does before its settings come (tasks/engines/resident.py): vLLM's imports, ~10 s of
    its start on CPU. No engine setting is read at import (vLLM reads its environment variables when the engine
    starts)."""
    import polars  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
