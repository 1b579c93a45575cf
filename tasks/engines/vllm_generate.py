"""vLLM server: one resident engine answering generation jobs (rollout rounds, eval passes).

Started by tasks/engines/vllm_client.py as `python -m tasks.engines.vllm_generate --serve SOCKET SETTINGS`.
A job is {prompts_path, out_path, n, temperature, top_p, max_tokens, seed}; it reads Parquet (prompt_id,
prompt_token_ids) and writes Parquet with one row per sample: prompt_id, sample_idx, token_ids (EOS
included when it stopped), text, sampler_logprobs, finish_reason, truncated, length.
No Prefect import: this runs in its own process.
"""

from __future__ import annotations

import os
import time


def _rows(outputs, prompt_ids):
    rows = []
    for pid, out in zip(prompt_ids, outputs):
        for k, o in enumerate(out.outputs):
            token_ids = list(o.token_ids)
            # logprobs=0 returns the sampled token's own logprob at each step.
            lps = [float(step[tid].logprob) for tid, step in zip(token_ids, o.logprobs or [])]
            rows.append(
                {
                    "prompt_id": pid, "sample_idx": k, "token_ids": token_ids, "text": o.text,
                    "sampler_logprobs": lps, "finish_reason": str(o.finish_reason),
                    "truncated": o.finish_reason == "length", "length": len(token_ids),
                }
            )
    return rows


def _start_engine(request: dict):
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(request.get("kv_cache_gib", 1))))
    from vllm import LLM

    return LLM(
        model=request["model_path"], dtype=request.get("dtype", "float32"), seed=request.get("seed", 0),
        enforce_eager=True, enable_prefix_caching=True,
    )


def _run_jobs(llm, jobs: list[dict]) -> list[dict]:
    import polars as pl
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    schema = {
        "prompt_id": pl.Utf8, "sample_idx": pl.Int32, "token_ids": pl.List(pl.Int32), "text": pl.Utf8,
        "sampler_logprobs": pl.List(pl.Float32), "finish_reason": pl.Utf8, "truncated": pl.Boolean,
        "length": pl.Int32,
    }
    timings = []
    for job in jobs:
        prompts = pl.read_parquet(job["prompts_path"])
        params = [
            SamplingParams(
                n=job["n"], temperature=job["temperature"], top_p=job.get("top_p", 1.0),
                max_tokens=job["max_tokens"], logprobs=0, seed=job["seed"] + i,
            )
            for i in range(prompts.height)
        ]
        inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts["prompt_token_ids"].to_list()]
        t1 = time.time()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        gen_seconds = time.time() - t1
        df = pl.DataFrame(_rows(outputs, prompts["prompt_id"].to_list()), schema=schema)
        df.write_parquet(job["out_path"])
        timings.append({"generate_seconds": gen_seconds, "tokens": int(df["length"].sum())})
    return timings


def ties_embeddings(model_path: str) -> bool:
    import json

    with open(os.path.join(model_path, "config.json")) as f:
        return bool(json.load(f).get("tie_word_embeddings", False))


def serve(socket_path: str, authkey: bytes, request: dict) -> None:
    """Resident mode: keep one engine and answer `generate` messages until `shutdown` or the parent dies.

    A `generate` for other weights first syncs them in place (`reload_weights`), which DESIGN §4 measured
    exact for untied embeddings and wrong for tied ones; for a tied model the server answers
    `restart_required` and exits, and the client starts a fresh engine on the new weights.
    """
    from multiprocessing.connection import Listener

    import vllm

    t0 = time.time()
    llm = _start_engine(request)
    current = request["model_path"]
    start_seconds = time.time() - t0
    with Listener(socket_path, family="AF_UNIX", authkey=authkey) as listener:
        with listener.accept() as conn:
            while True:
                msg = conn.recv()
                if msg["op"] == "shutdown":
                    conn.send({"ok": True})
                    return
                sync_seconds = 0.0
                if msg["model_path"] != current:
                    if ties_embeddings(msg["model_path"]):
                        conn.send({"restart_required": True})
                        return
                    t1 = time.time()
                    llm.collective_rpc("reload_weights", kwargs={"weights_path": msg["model_path"]})
                    llm.reset_prefix_cache()
                    sync_seconds, current = time.time() - t1, msg["model_path"]
                try:
                    timings = _run_jobs(llm, msg["jobs"])
                except Exception as exc:  # report to the client; the engine itself is still usable
                    conn.send({"error": f"{type(exc).__name__}: {exc}"})
                    continue
                conn.send({
                    "engine_start_seconds": start_seconds, "sync_seconds": sync_seconds, "jobs": timings,
                    "vllm_version": vllm.__version__,
                })
                start_seconds = 0.0  # only the first answer pays the start


if __name__ == "__main__":
    import json
    import sys

    serve(sys.argv[2], bytes.fromhex(os.environ["RLPIPE_AUTHKEY"]), json.loads(sys.argv[3]))
