"""`rlpipe demo`: post-train a model into one run folder, with rich progress, and summarise it.

The demo config (infra/configs/demo.yaml) starts from a real pretrained model that set-up fetched (`make model`): the
run is RL with evals, started as `rlpipe run` starts it (engines spawned while the input is checked). A config whose
model is built from a recipe (infra/configs/arithmetic_tiny.yaml: `rlpipe demo --config ...`) runs init-model and SFT
first. The progress bars are read off the run's manifests by a watcher thread, so they show exactly what storage says
is complete, whether a stage ran now or was skipped on a resume.
Imports: The flows are imported inside `run_demo`, after the local API's settings are made (Prefect reads them when it
is imported).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from schemas.config import load_config
from schemas.errors import UserError
from storage import RunLayout, read_manifest


def _watch(layout, progress, bars, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        _update_bars(layout, progress, bars)
    _update_bars(layout, progress, bars)  # the last eval ends just before the run does


def _update_bars(layout, progress, bars) -> None:
    done = sum(
        1 for it in layout.iterations("train_metrics") if read_manifest(layout, "train_metrics", it, verify=False)
    )
    evals = sum(1 for it in layout.iterations("eval") if read_manifest(layout, "eval", it, verify=False))
    progress.update(bars["rl"], completed=done)
    progress.update(bars["eval"], completed=evals)


def run_demo(config: str, overrides: list[str], run_id: str, console: Console) -> dict:
    from flows.deployments import prepare_checked_run, prepare_run
    from flows.local_prefect import local_flow_settings

    started = time.time()
    cfg = load_config(config, overrides)
    phases: dict[str, float] = {}
    if cfg.model.recipe is None:
        if not (Path(cfg.model.path) / "config.json").exists():
            raise UserError(
                f"model {cfg.model.path} is not there yet: `make model` fetches and imports it (`make demo` runs it)"
            )
        prepare_checked_run(config, overrides, run_id)  # the engines import while the data and rewards are checked
        with local_flow_settings():
            _rl_with_progress(cfg, run_id, console, phases, build=False)
    else:
        cfg, _ = prepare_run(config, overrides, run_id, command="demo")
        with local_flow_settings():
            _rl_with_progress(cfg, run_id, console, phases, build=True)
    extra = {
        "wall_seconds": round(time.time() - started, 1),
        "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
    }
    from tasks.stages.summary import summary_task

    return summary_task.fn(cfg.storage_root, run_id, extra=extra)


def _rl_with_progress(cfg, run_id: str, console: Console, phases: dict, build: bool) -> None:
    """RL with evals (and, with `build`, init-model and SFT before), progress bars read off the manifests."""
    from flows.rl import rl_run
    from flows.sft import sft_flow
    from tasks.data.model_recipe import init_model
    from tasks.stages.preflight import preflight

    layout = RunLayout(Path(cfg.storage_root), run_id)
    n = cfg.rl.iterations
    n_evals = len({0, n, *range(cfg.rl.eval_every, n + 1, cfg.rl.eval_every)})
    columns = (
        TextColumn("{task.description:<22}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        bars = {}
        if build:
            bars = {
                "init": progress.add_task("init-model", total=1),
                "sft": progress.add_task("SFT (DeepSpeed)", total=1),
            }
        bars |= {
            "rl": progress.add_task("RL iterations", total=n),
            "eval": progress.add_task("eval (vLLM)", total=n_evals),
        }
        if build:
            t = time.time()
            init_model(cfg.model.recipe, cfg.model.base_path)
            preflight(cfg.storage_root, run_id, "sft")  # the task's files and the demonstrations, before any engine
            progress.update(bars["init"], completed=1)
            phases["init_model"] = time.time() - t
            t = time.time()
            sft_flow(run_id, cfg.storage_root)
            progress.update(bars["sft"], completed=1)
            phases["sft"] = time.time() - t
            preflight(cfg.storage_root, run_id, "rl")  # the SFT model exists now: the prompts and rewards against it
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(layout, progress, bars, stop), daemon=True)
        watcher.start()
        t = time.time()
        try:
            rl_run(run_id, cfg.storage_root)
        finally:
            stop.set()
            watcher.join()
        phases["rl_and_eval"] = time.time() - t
