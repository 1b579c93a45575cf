"""Client of the resident vLLM server: one engine per Prefect process, reused across rounds, iterations and eval.

Correctness never depends on the engine's memory: every request names the weights it must use, and the
server syncs to them in place before generating, and reports its logprob gap to the trainer's probe
(tasks/engines/workers/sync_probe.py). If the server dies, the next request starts a new one from the requested weights.
"""

from __future__ import annotations

from pathlib import Path

from tasks.engines.resident import ResidentProcess, resident
from tasks.engines.workers import VLLM_SERVER


class ResidentEngine(ResidentProcess):
    def __init__(self, log: Path, settings: dict):
        super().__init__(VLLM_SERVER, log, settings)

    def generate(self, model_path: str, jobs: list[dict]) -> dict:
        return self.call({"op": "generate", "model_path": model_path, "jobs": jobs}, {"model_path": model_path})


def resident_engine(key: str, log: Path, settings: dict) -> ResidentEngine:
    return resident(VLLM_SERVER, key, lambda: ResidentEngine(log, settings))
