"""Deployment against a real `prefect server`: deploy infra/prefect.yaml, start a process worker, trigger a
deployment run with parameters from the CLI and wait for Completed. Everything started is stopped."""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
import yaml

from flows.local_prefect import LOCAL_API_ENV
from storage import RunLayout
from tests.conftest import ROOT, free_port, tiny_config, wait_healthy

pytestmark = pytest.mark.e2e


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL what is left (a worker may keep retrying a dead server)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def deployment_run(env, cwd, name: str, cfg, run_id: str, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "prefect",
            "--no-prompt",
            "deployment",
            "run",
            name,
            "--param",
            f"config={cfg}",
            "--param",
            f"run_id={run_id}",
            "--param",
            "overrides=" + json.dumps(overrides),
            "--watch",
            "--watch-interval",
            "1",
            "--watch-timeout",
            "600",
        ],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=700,
    )


def flow_run_message(api: str, name: str) -> str:
    """The state message of the flow run named `name`, as the Prefect API holds it."""
    body = json.dumps({"flow_runs": {"name": {"any_": [name]}}}).encode()
    request = urllib.request.Request(f"{api}/flow_runs/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        runs = json.loads(resp.read())
    return runs[0]["state"]["message"]


def heartbeat_count(api: str) -> int:
    """How many flow-run heartbeat events the server holds (local commands turn heartbeats off; deployed runs keep
    them)."""
    body = json.dumps({"filter": {"event": {"name": ["prefect.flow-run.heartbeat"]}}, "limit": 50}).encode()
    request = urllib.request.Request(f"{api}/events/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return len(json.loads(resp.read())["events"])


@pytest.mark.long
def test_deploy_to_a_real_server_and_run_with_parameters(tmp_path):
    cfg = tiny_config(tmp_path)
    api = f"http://127.0.0.1:{free_port()}/api"
    # A real server keeps Prefect's defaults (this process may have set the local commands' settings).
    inherited = {k: v for k, v in os.environ.items() if k not in LOCAL_API_ENV}
    env = {
        **inherited,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": api,
        "PYTHONPATH": str(ROOT),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    host, port = api.removeprefix("http://").removesuffix("/api").split(":")
    started = []
    try:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", port],
            env=env,
            cwd=tmp_path,
            stdout=open(tmp_path / "server.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(server)
        wait_healthy(api, server, 180, "prefect server")

        deployed = subprocess.run(
            [sys.executable, "-m", "flows.cli", "deploy"], env=env, cwd=ROOT, capture_output=True, text=True
        )
        assert deployed.returncode == 0, deployed.stderr[-2000:]
        names = yaml.safe_load((ROOT / "infra/prefect.yaml").read_text())["deployments"]
        assert {d["name"] for d in names} >= {"rl", "sft"}
        assert "deployed rlpipe-sft/sft" in deployed.stderr and "deployed rlpipe-rl/rl" in deployed.stderr

        worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", "rlpipe", "--type", "process"],
            env=env,
            cwd=ROOT,
            stdout=open(tmp_path / "worker.log", "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(worker)
        triggered = subprocess.run(
            [
                sys.executable,
                "-m",
                "prefect",
                "--no-prompt",
                "deployment",
                "run",
                "rlpipe-sft/sft",
                "--param",
                f"config={cfg}",
                "--param",
                "run_id=deployed",
                "--param",
                "overrides=" + json.dumps(["sft.steps=6"]),
                "--watch",
                "--watch-interval",
                "1",
                "--watch-timeout",
                "600",
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=700,
        )
        worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-2000:]
        assert triggered.returncode == 0 and "Completed" in triggered.stdout, (
            f"{triggered.stdout[-2000:]}\n{worker_log}"
        )

        # RL from that model with the default reward pool (2 spawned workers): the entrypoint's folder is on sys.path in
        # a deployed run, and flows/inspect.py once shadowed the standard library there and killed every reward worker.
        rl = deployment_run(env, tmp_path, "rlpipe-rl/rl", cfg, "deployed-rl", ["rl.iterations=1", "rl.eval_every=1"])
        worker_log = (tmp_path / "worker.log").read_text(errors="replace")[-2000:]
        assert rl.returncode == 0 and "Completed" in rl.stdout, f"{rl.stdout[-2000:]}\n{worker_log}"
        # A failed run's message in the API carries its real cause, not a pointer to a terminal.
        bad = deployment_run(env, tmp_path, "rlpipe-rl/rl", cfg, "deployed-bad", ["rollout.group_sizee=4"])
        assert bad.returncode == 1 and "Failed" in bad.stdout
        assert "rollout.group_sizee: unknown key" in flow_run_message(api, "deployed-bad")
        assert heartbeat_count(api) >= 1
    finally:
        for proc in reversed(started):
            stop(proc)

    rl_run = RunLayout(tmp_path / "runs", "deployed-rl")
    assert json.loads(rl_run.summary_path.read_text())["iterations"] == 1
    scores = json.loads(rl_run.manifest_path("scores", 1).read_text())
    assert scores["rows"] > 0
    layout = RunLayout(tmp_path / "runs", "deployed")
    saved = yaml.safe_load(layout.config_path.read_text())
    assert saved["sft"]["steps"] == 6  # the parameter reached the flow run
    manifest = json.loads(layout.manifest_path("sft_metrics", 0).read_text())
    assert manifest["rows"] == 6 and manifest["engines"]["deepspeed"] == "0.19.8"
    assert (tmp_path / "models/sft/model.safetensors").exists()
