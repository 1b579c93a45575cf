"""`rlpipe demo`: init-model → SFT → RL (with eval) into one run folder, with rich progress.

The progress bar is read off the run's manifests by a watcher thread, so it shows exactly what storage
says is complete, whether a stage ran now or was skipped on a resume.
"""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _watch(layout, progress, bars, stop: threading.Event) -> None:
    from storage import read_manifest

    while not stop.wait(1.0):
        done = sum(1 for it in layout.iterations("train_metrics") if read_manifest(layout, "train_metrics", it, verify=False))
        evals = sum(1 for it in layout.iterations("eval") if read_manifest(layout, "eval", it, verify=False))
        progress.update(bars["rl"], completed=done)
        progress.update(bars["eval"], completed=evals)


def run_demo(config: str, overrides: list[str], run_id: str, console: Console) -> dict:
    from flows.deployments import prepare_run
    from flows.rl import rl_run
    from flows.sft import sft_flow
    from tasks.data.model_recipe import init_model
    from tasks.stages.preflight import preflight
    from tasks.stages.summary import summary_task

    started = time.time()
    cfg, layout = prepare_run(config, overrides, run_id, command="demo")
    n = cfg.rl.iterations
    n_evals = len({0, n, *range(cfg.rl.eval_every, n + 1, cfg.rl.eval_every)})
    columns = (TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        bars = {
            "init": progress.add_task("init-model", total=1),
            "sft": progress.add_task("SFT (DeepSpeed)", total=1),
            "rl": progress.add_task("RL iterations", total=n),
            "eval": progress.add_task("eval (vLLM)", total=n_evals),
        }
        t = time.time()
        init_model(cfg.model.recipe, cfg.model.base_path)
        preflight(cfg.storage_root, run_id, "sft")  # the task's files and the demonstrations, before any engine
        progress.update(bars["init"], completed=1)
        init_seconds = time.time() - t
        t = time.time()
        sft_flow(run_id, cfg.storage_root)
        progress.update(bars["sft"], completed=1)
        sft_seconds = time.time() - t
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
        rl_seconds = time.time() - t
    extra = {
        "wall_seconds": round(time.time() - started, 1),
        "phase_seconds": {"init_model": round(init_seconds, 1), "sft": round(sft_seconds, 1), "rl_and_eval": round(rl_seconds, 1)},
    }
    return summary_task.fn(cfg.storage_root, run_id, extra=extra)
