"""Start an RL run's resident engines before its first stage asks for them.

Each engine otherwise starts when a stage first needs it: vLLM at the first eval or rollout, the DeepSpeed trainer at
the first logprobs stage, one after the other, and the command's own start (Prefect's temporary API) before both.
Spawned here, without waiting, their imports and loads overlap each other and whatever the command does meanwhile;
the stages then call the actors already starting (tasks/engines/resident.py). The reward pool's workers are
spawned with them (tasks/rewards/pool.py, start_workers) rather than at the first scores. Nothing here decides a result:
a vLLM replica starts from the run's starting weights and syncs in place to the weights each request names, and the
trainer loads ahead only what its first requests would load (trainer_warm_start), under the engine cache's reuse rule.
(A trainer killed while it loads DeepSpeed's compiled op no longer blocks later ones: tasks/engines/workers/
data_parallel.py, load_comm_op.)
"""

from __future__ import annotations

import threading

from schemas.requests import EngineSettings, LoraSettings, TrainerWarmStart
from storage import read_manifest
from tasks.engines.resident import close_held
from tasks.engines.trainer_client import resident_trainer
from tasks.rewards.loader import specs_from_config
from tasks.rewards.pool import start_workers
from tasks.stages.common import RunContext, load_run
from tasks.stages.rollouts import start_rollout_engines
from tasks.stages.weights import starting_weights

_HELD: dict = {"thread": None}


def start_engines(storage_root: str, run_id: str, held: bool = False) -> None:
    """Spawn the run's vLLM replicas, its resident trainer (if it uses one) and its reward workers, unless the run is
    complete.

    `held`: before the run's input is checked, Ray starts and the engines' actors only import their libraries, all in
    the background (Ray's start and vLLM's imports are seconds each), and start nothing (the checks must fail before
    any engine starts, and vLLM's settings name the model the checks have not yet found); a second call without it,
    after the checks, waits for that and lets them go on (`end_held` ends them when a check fails)."""
    ctx = load_run(storage_root, run_id)
    if ctx.layout.summary_path.exists():
        return
    if held:
        _HELD["thread"] = threading.Thread(target=_spawn_held, args=(ctx,), name="held-engines", daemon=True)
        _HELD["thread"].start()
        return
    _join_held()
    start_rollout_engines(ctx, starting_weights(ctx).path)
    if ctx.cfg.engines.resident_trainer:
        resident_trainer(ctx.layout, ctx.cfg.engines).spawn(trainer_warm_start(ctx))
    start_workers(list(specs_from_config(ctx.cfg.reward).values()), ctx.cfg.reward.workers)


def _spawn_held(ctx: RunContext) -> None:
    try:
        start_rollout_engines(ctx, None)
        if ctx.cfg.engines.resident_trainer:
            resident_trainer(ctx.layout, ctx.cfg.engines).spawn(None, held=True)
    except Exception:  # noqa: BLE001  (Ray that could not start is reported by the call that waits for it)
        pass


def _join_held() -> None:
    if _HELD["thread"] is not None:
        _HELD["thread"].join()
        _HELD["thread"] = None


def end_held() -> None:
    """End the engines spawned held (the command's input failed its checks): no engine started, no log written."""
    _join_held()
    close_held()


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
