"""Client of the resident vLLM engines: each replica a Ray actor, one set per Prefect process, reused across rounds,
iterations and eval.

Correctness never depends on the engine's memory: every request names the weights it must use, and the
server syncs to them in place before generating, and reports its logprob gap to the trainer's probe
(tasks/engines/workers/sync_probe.py). If a replica dies, the next request starts a new one from the requested weights.
"""

from __future__ import annotations

from pathlib import Path

from schemas.requests import GenerateRequest, GenerationReply, VLLMSettings, from_wire
from tasks.engines.ray_cluster import Placement
from tasks.engines.resident import ResidentProcess, resident
from tasks.engines.workers import VLLM_SERVER
from tasks.engines.workers.lora import is_adapter


class ResidentEngine(ResidentProcess):
    def __init__(self, log: Path, devices: list[int] | None = None, placement: Placement = Placement()):
        super().__init__(VLLM_SERVER, log, devices=devices, placement=placement)
        # The weights the engine holds, as this client last saw them: what it started from, was synced to or generated
        # with (None: unknown, e.g. an adapter to load). tasks/engines/weight_sync.py reads and sets it.
        self.weights: str | None = None

    def generate(self, request: GenerateRequest, settings: VLLMSettings) -> GenerationReply:
        """Run the request's jobs with its weights; `settings` start the engine when none is running."""
        reply = from_wire(self.call(request, settings))
        self.weights = request.model_path
        return reply

    def _release(self, settings) -> None:
        super()._release(settings)
        self.weights = settings.model_path if settings is not None and not is_adapter(settings.model_path) else None

    def kill(self) -> None:
        super().kill()
        self.weights = None


def resident_engine(
    key: str, log: Path, placement: Placement, replica: int = 0, devices: list[int] | None = None
) -> ResidentEngine:
    """This process's vLLM replica number `replica` for `key` (a run id), logging to `log`."""
    return resident(VLLM_SERVER, f"{key}#{replica}", lambda: ResidentEngine(log, devices, placement))
