"""Resident trainer: one process per run that keeps the DeepSpeed engines (policy, critic) and the frozen
reference between iterations, and answers the `logprobs` and `optimize` stages.

Started by tasks/engines/trainer_client.py as `python -m tasks.engines.workers.trainer_server --serve SOCKET SETTINGS`.
A message is {"op": "logprobs" | "train", "request": ...}, the same request the one-shot workers
(torch_logprobs, deepspeed_train) take; inputs and outputs stay Parquet and checkpoints on disk. What it
reuses, and when, is tasks/engines/workers/engine_cache.py: only state that provably equals the requested checkpoint.
No Prefect import: this runs in its own process.
"""

from __future__ import annotations

import time


def make_answer(settings: dict):
    import deepspeed  # noqa: F401  (the imports are paid once, here)
    import torch  # noqa: F401

    from tasks.engines.workers import deepspeed_train, torch_logprobs
    from tasks.engines.workers.engine_cache import EngineCache

    cache = EngineCache()
    handlers = {"logprobs": torch_logprobs.handle, "train": deepspeed_train.handle}

    def answer(msg: dict) -> dict:
        if msg["op"] not in handlers:
            raise ValueError(f"unknown trainer op {msg['op']!r}")
        hits = dict(cache.hits)
        t0 = time.time()
        print(f"[trainer] {msg['op']} {msg.get('label', '')}", flush=True)
        resp = handlers[msg["op"]](msg["request"], cache)
        reused = {f"reused_{k}": cache.hits[k] - hits[k] for k in hits}
        print(f"[trainer] {msg['op']} done in {time.time() - t0:.2f}s {reused}", flush=True)
        return {**resp, **reused}

    return answer


if __name__ == "__main__":
    from tasks.engines.resident import serve_main

    serve_main(make_answer)
