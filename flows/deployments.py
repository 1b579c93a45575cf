"""Entry flows for Prefect deployments (`infra/prefect.yaml`), and `rlpipe deploy`.

A deployed run is triggered with parameters alone (from `prefect deployment run` or the UI), so each entry
flow takes a config path, `--set`-style overrides and a run id, validates and saves the config exactly as
the CLI does, and then runs the same flow the CLI runs. Paths are relative to the repository root: the
deployments' pull step makes it the working directory of every flow run.
Imports: The flows and engine helpers are imported inside the functions that run them: the CLI imports this module for
every command (its config paths), and `import flows.rl` is 2.7 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from prefect import flow

from schemas.config import ConfigError, build_config, dump_config, load_config
from schemas.errors import UserError
from storage import RunLayout
from storage.lock import acquire_run_lock
from storage.stage_io import write_bytes_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "infra" / "prefect.yaml"
WORK_POOL = "rlpipe"
DEMO_CONFIG = "infra/configs/demo.yaml"  # the real pretrained model (`make model`): RL, reward model, DPO
TINY_CONFIG = "infra/configs/arithmetic_tiny.yaml"  # a model built from a recipe: init-model and SFT


def prepare_run(
    config: str,
    overrides: list[str] | None,
    run_id: str,
    algo: str | None = None,
    reconfigure: bool = False,
    command: str = "run",
):
    """Validate the config, take the run's writer lock, check a changed config against what the run already holds,
    and save the resolved config. Returns (cfg, layout)."""

    cfg = load_config(config, overrides, algo)
    layout = RunLayout(Path(cfg.storage_root), run_id)
    try:
        acquire_run_lock(layout, command)
        if layout.config_path.exists():
            reconcile_config(layout, cfg, reconfigure, [*(overrides or []), *([f"--algo {algo}"] if algo else [])])
        save_config(layout, cfg)
    except OSError as exc:
        raise UserError(f"cannot write to storage root {cfg.storage_root!r}: {exc.strerror}") from None
    return cfg, layout


def save_config(layout, cfg) -> None:
    write_bytes_atomic(layout.config_path, dump_config(cfg).encode())


def reconcile_config(layout, cfg, reconfigure: bool, overrides: list[str]) -> None:
    """A run that exists with another config: fine when no complete stage's fingerprinted sections change (more
    iterations, another engine placement); otherwise refused, unless `reconfigure`, which moves the outputs the new
    config would recompute aside first (as `rlpipe rerun` does), so nothing finished is overwritten in place."""

    from flows.rerun import changed_by, supersede_changed

    old = build_config(yaml.safe_load(layout.config_path.read_text()))
    if old == cfg:
        return
    changed = changed_by(layout, cfg)
    if not changed:
        return
    if not reconfigure:
        keys = _differences(old.model_dump(mode="json"), cfg.model_dump(mode="json"))
        stages = sorted({name for name, _ in changed})
        raise ConfigError(
            f"run {layout.run_id!r} exists with another config ({', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''} "
            f"differ), which would recompute its {', '.join(stages)}; pass --reconfigure to move those outputs "
            "aside first, or choose another --run-id"
        )
    supersede_changed(layout, changed, {"reconfigure": True, "overrides": overrides})


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


@flow(name="rlpipe-rl", flow_run_name="{run_id}")
def rl_deployment(
    config: str = DEMO_CONFIG, run_id: str = "rl", overrides: list[str] | None = None, algo: str | None = None
) -> dict:
    """RL from the SFT model (or resume the run): the `rl` flow on a saved config."""
    from flows.rl import rl_run
    from tasks.engines.reaper import start_reaper

    start_reaper()  # no engine outlives this flow run, however the worker's process ends
    return rl_run(run_id, prepare_checked_run(config, overrides, run_id, algo))


@flow(name="rlpipe-reward-model", flow_run_name="{run_id}")
def reward_model_deployment(config: str = DEMO_CONFIG, run_id: str = "rm", overrides: list[str] | None = None) -> dict:
    """A Bradley–Terry reward model on preference data (generated from the task unless preference.data)."""
    from flows.reward_model import reward_model_flow
    from tasks.engines.reaper import start_reaper

    start_reaper()
    return reward_model_flow(run_id, prepare_checked_run(config, overrides, run_id, flow="rm"))


@flow(name="rlpipe-dpo", flow_run_name="{run_id}")
def dpo_deployment(config: str = DEMO_CONFIG, run_id: str = "dpo", overrides: list[str] | None = None) -> dict:
    """DPO from model.path on preference data."""
    from flows.dpo import dpo_flow
    from tasks.engines.reaper import start_reaper

    start_reaper()
    return dpo_flow(run_id, prepare_checked_run(config, overrides, run_id, flow="dpo"))


def prepare_checked_run(
    config: str,
    overrides: list[str] | None,
    run_id: str,
    algo: str | None = None,
    flow: str = "rl",
    reconfigure: bool = False,
) -> str:
    """Save the run's config (under its writer lock) and check everything that can be checked before an engine starts
    (the model folder, the data, the reward functions: tasks/stages/preflight.py); the storage root.

    The seconds of those checks are not idle: a local command's Prefect API starts meanwhile, and an RL run's engine
    processes import their libraries, spawned held (they start no engine and write no log until the checks pass, and
    are ended if one fails). Then the engines load while the first stages run."""
    cfg, _ = prepare_run(config, overrides, run_id, algo, reconfigure, command=flow)
    check_then_start(cfg.storage_root, run_id, flow)
    return cfg.storage_root


def check_then_start(root: str, run_id: str, flow: str = "rl") -> None:
    """A saved run's checks (preflight) while its engines import their libraries, held; then the engines load.
    `run` and `resume` both start so: a reward, judge or model that broke since the run began stops `resume` with
    the same line as `run`, before any engine starts."""
    from flows.local_prefect import start_local_api, wait_for_local_api
    from tasks.stages.preflight import preflight
    from tasks.stages.start_engines import end_held, start_engines

    if flow == "rl":
        start_engines(root, run_id, held=True)
    start_local_api()
    try:
        preflight(root, run_id, flow)
    except BaseException:
        end_held()  # no engine started, no log written
        raise
    if flow == "rl":
        start_engines(root, run_id)
    wait_for_local_api()


@flow(name="rlpipe-sft", flow_run_name="{run_id}")
def sft_deployment(config: str = TINY_CONFIG, run_id: str = "sft", overrides: list[str] | None = None) -> dict:
    """The SFT warm start; the base model is built from the recipe first if it is not there yet."""
    from flows.sft import sft_flow
    from tasks.data.model_recipe import init_model
    from tasks.engines.reaper import start_reaper
    from tasks.stages.preflight import preflight

    start_reaper()
    cfg, _ = prepare_run(config, overrides, run_id, command="sft")
    if cfg.model.recipe:
        init_model(cfg.model.recipe, cfg.model.base_path)
    preflight(cfg.storage_root, run_id, "sft")
    return sft_flow(run_id, cfg.storage_root)


class DeployError(UserError, RuntimeError):
    pass


def _prefect(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )


def deploy(api_url: str | None) -> list[str]:
    """Create the `rlpipe` process work pool if needed and register every deployment in infra/prefect.yaml
    on the server at `api_url`. Returns the deployment names."""

    api_url = api_url or os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise DeployError("no Prefect server: pass --api-url or set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api)")
    env = {**os.environ, "PREFECT_API_URL": api_url, "RLPIPE_HOME": str(REPO_ROOT)}
    pool = _prefect("work-pool", "create", WORK_POOL, "--type", "process", env=env)
    if pool.returncode != 0 and "already exists" not in pool.stdout + pool.stderr:
        raise DeployError(f"cannot create work pool {WORK_POOL!r} at {api_url}: {_last_line(pool)}")
    out = _prefect("deploy", "--all", "--prefect-file", str(PREFECT_FILE), env=env)
    if out.returncode != 0:
        raise DeployError(f"prefect deploy failed at {api_url}: {_last_line(out)}")
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    # Every entrypoint is a flow of this module: its name is the first half of the deployment's full name.
    return [f"{globals()[d['entrypoint'].split(':')[1]].name}/{d['name']}" for d in spec["deployments"]]


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {proc.returncode}"
