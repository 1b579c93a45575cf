"""Client of the resident vLLM engines: each replica a Ray actor, one set per Prefect process, reused across rounds,
iterations and eval.

Correctness never depends on the engine's memory: every request names the weights it must use, and the
server syncs to them in place before generating, and reports its logprob gap to the trainer's probe
(tasks/engines/workers/sync_probe.py). If a replica dies, the next request starts a new one from the requested weights.
"""

from __future__ import annotations

from pathlib import Path

from schemas.requests import GenerateRequest, VLLMSettings
from tasks.engines.ray_cluster import Placement
from tasks.engines.resident import ResidentProcess, resident
from tasks.engines.workers import VLLM_SERVER


class ResidentEngine(ResidentProcess):
    def __init__(self, log: Path, devices: list[int] | None = None, placement: Placement = Placement()):
        super().__init__(VLLM_SERVER, log, devices=devices, placement=placement)

    def generate(self, request: GenerateRequest, settings: VLLMSettings) -> dict:
        """Run the request's jobs with its weights; `settings` start the engine when none is running."""
        return self.call(request, settings)


def resident_engine(
    key: str, log: Path, placement: Placement, replica: int = 0, devices: list[int] | None = None
) -> ResidentEngine:
    """This process's vLLM replica number `replica` for `key` (a run id), logging to `log`."""
    return resident(VLLM_SERVER, f"{key}#{replica}", lambda: ResidentEngine(log, devices, placement))
