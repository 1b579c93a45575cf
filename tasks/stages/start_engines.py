"""Start an RL run's resident engines before its first stage asks for them.

Each engine otherwise starts when a stage first needs it: vLLM at the first eval or rollout, the DeepSpeed trainer at
the first logprobs stage, one after the other, and the command's own start (Prefect's temporary API) before both.
Spawned here, without waiting, their imports and loads overlap each other and whatever the command does meanwhile;
the stages then connect to the processes already starting (tasks/engines/resident.py). The reward pool's workers are
spawned with them (tasks/rewards/pool.py, start_workers) rather than at the first scores. Nothing here decides a result:
a vLLM replica starts from the run's starting weights and syncs in place to the weights each request names, and the
trainer loads ahead only what its first requests would load (trainer_warm_start), under the engine cache's reuse rule.
(A trainer killed while it loads DeepSpeed's compiled op no longer blocks later ones: tasks/engines/workers/
data_parallel.py, load_comm_op.)
"""

from __future__ import annotations

from schemas.requests import EngineSettings, LoraSettings, TrainerWarmStart
from storage import read_manifest
from tasks.engines.trainer_client import resident_trainer
from tasks.rewards.loader import specs_from_config
from tasks.rewards.pool import start_workers
from tasks.stages.common import RunContext, load_run
from tasks.stages.rollouts import start_rollout_engines
from tasks.stages.weights import starting_weights


def start_engines(storage_root: str, run_id: str, held: bool = False) -> None:
    """Spawn the run's vLLM replicas, its resident trainer (if it uses one) and its reward workers, unless the run is
    complete. Call it from the thread that runs the flow (see ResidentProcess.spawn).

    `held`: before the run's input is checked, the processes only import their libraries and start nothing (the
    checks must fail before any engine starts, and vLLM's settings name the model the checks have not yet found);
    a second call without it, after the checks, lets them go on (tasks.engines.resident.close_held ends them when
    a check fails)."""
    ctx = load_run(storage_root, run_id)
    if ctx.layout.summary_path.exists():
        return
    start_rollout_engines(ctx, None if held else starting_weights(ctx).path)
    if ctx.cfg.engines.resident_trainer:
        resident_trainer(ctx.layout, ctx.cfg.engines).spawn(None if held else trainer_warm_start(ctx), held=held)
    if not held:  # the functions passed the checks
        start_workers(list(specs_from_config(ctx.cfg.reward).values()), ctx.cfg.reward.workers)


def trainer_warm_start(ctx: RunContext) -> TrainerWarmStart | None:
    """What the resident trainer may load before its first request: the run's starting weights, when the next update
    starts from them (no update is complete yet), with the policy's engine settings. A resumed run's trainer loads on
    demand instead: an engine built ahead and never taken would only hold memory."""
    if read_manifest(ctx.layout, "train_metrics", 1, verify=False) is not None:
        return None
    cfg = ctx.cfg
    lora = LoraSettings.from_config(cfg.lora, cfg.seed)
    return TrainerWarmStart(
        model_path=cfg.model.path, dtype=cfg.model.dtype, engine=EngineSettings.for_policy(cfg.optim, cfg.model, lora)
    )
