"""Start an RL run's vLLM replicas before its first stage asks for them.

vLLM otherwise starts when the first eval or rollout needs it, after the command's own start (Prefect's temporary
API). Spawned here, without waiting, its import and load overlap whatever the command does meanwhile; the stages then
connect to the process already starting (tasks/engines/resident.py). Nothing here decides a result: a replica starts
from the run's starting weights and syncs in place to the weights each request names.

The DeepSpeed trainer is not started early: a trainer killed while it loads DeepSpeed's compiled op (a command
stopped in its first seconds) leaves torch's build lock in ~/.cache/torch_extensions, and every later trainer on the
machine waits on it forever.
"""

from __future__ import annotations

from tasks.stages.common import load_run
from tasks.stages.rollouts import start_rollout_engines
from tasks.stages.weights import starting_weights


def start_engines(storage_root: str, run_id: str) -> None:
    """Spawn the run's vLLM replicas, unless the run is complete. Call it from the thread that runs the flow (see
    ResidentProcess.spawn)."""
    ctx = load_run(storage_root, run_id)
    if ctx.layout.summary_path.exists():
        return
    start_rollout_engines(ctx, starting_weights(ctx).path)
