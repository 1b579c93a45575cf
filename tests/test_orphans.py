"""No process outlives its `rlpipe run`: after a SIGKILL of the command alone (not its process group), and after a
SIGTERM, no process it started survives (the embedded Ray instance's head, agents and engine actors: vLLM, the trainer;
reward workers, Prefect's temporary API server) and no socket or temporary file is left; SIGTERM exits promptly with
one line. Every socket the run's processes open is on loopback."""

import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tasks.engines.ray_cluster import temp_dir_for
from tests.conftest import cli_env, rlpipe, tiny_config

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The recipe's untrained model is enough: the run is stopped while it generates."""
    workspace = tmp_path_factory.mktemp("orphans")
    cfg = tiny_config(
        workspace,
        model={"path": str(workspace / "models/base")},
        rollout={"max_tokens": 40, "prompts_per_round": 64},
        task={"max_operand": 40},
    )
    rlpipe("init-model", "--config", str(cfg), cwd=workspace)
    return workspace, cfg


def start_run(workspace, cfg, run_id: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "run", str(cfg), "--run-id", run_id],
        cwd=workspace,
        env=cli_env(workspace),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def engines_running(proc: subprocess.Popen, log: Path, timeout: float = 300) -> list[psutil.Process]:
    """Wait until the vLLM actor under the command has started its engine (its log says so); return every process the
    command started so far (Ray's head and agents are its children, the actors the raylet's)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        if log.exists() and "init engine" in log.read_text(errors="replace"):
            children = psutil.Process(proc.pid).children(recursive=True)
            assert any("ray::EngineActor" in " ".join(c.cmdline()) for c in _alive(children))
            return children
        time.sleep(0.2)
    raise AssertionError("the vLLM engine did not start")


def _alive(procs):
    out = []
    for p in procs:
        try:
            p.cmdline()
            out.append(p)
        except psutil.Error:
            pass
    return out


def assert_nothing_left(pid: int, children: list[psutil.Process], seconds: float = 30) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and (_alive(children) or _files(pid)):
        time.sleep(0.5)
    assert not _alive(children), [" ".join(p.cmdline())[:120] for p in _alive(children)]
    assert not _files(pid)
    from tasks.engines.reaper import marked

    assert not marked(pid)


def _files(pid: int) -> list[str]:
    """The command's temporary files: actors' held output, the embedded Ray instance's folder (its session, the
    engines' own temporary files, the process groups' meeting files), sockets."""
    temp = tempfile.gettempdir()
    return (
        glob.glob(os.path.join(temp, f"*-{pid}-*.sock"))
        + glob.glob(os.path.join(temp, f"*-{pid}-*.out"))
        + glob.glob(os.path.join(temp, f"*-{pid}-*.store"))
        + ([temp_dir_for(pid)] if os.path.exists(temp_dir_for(pid)) else [])
    )


def inet_sockets(procs: list[psutil.Process]) -> list[tuple[str, str, str]]:
    """(process, local address, remote address) of every TCP/UDP socket the processes hold."""
    out = []
    for p in _alive(procs):
        try:
            for c in p.net_connections(kind="inet"):
                out.append((p.name(), c.laddr.ip if c.laddr else "", c.raddr.ip if c.raddr else ""))
        except psutil.Error:
            pass
    return out


def on_loopback(ip: str) -> bool:
    return ip in ("", "::1") or ip.startswith("127.") or ip.startswith("::ffff:127.")


def test_sigkill_of_the_command_leaves_no_process_and_no_socket_and_its_sockets_were_on_loopback(workspace):
    ws, cfg = workspace
    proc = start_run(ws, cfg, "killed")
    children = engines_running(proc, ws / "runs/killed/logs/vllm.log")
    assert any("uvicorn" in " ".join(c.cmdline()) for c in children)  # Prefect's temporary API server is among them
    assert any("raylet" in " ".join(c.cmdline()) for c in children)  # the embedded Ray instance
    sockets = inet_sockets([psutil.Process(proc.pid), *children])
    assert sockets and all(on_loopback(local) and on_loopback(remote) for _, local, remote in sockets), sockets
    os.kill(proc.pid, signal.SIGKILL)  # the command alone: its children are not signalled
    proc.wait(10)
    assert_nothing_left(proc.pid, children)


def engine_starting(proc: subprocess.Popen, timeout: float = 120) -> list[psutil.Process]:
    """Wait until an engine actor's process exists (its engine still loading)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        children = _alive(psutil.Process(proc.pid).children(recursive=True))
        if any("ray::EngineActor" in " ".join(c.cmdline()) for c in children):
            return children
        time.sleep(0.1)
    raise AssertionError("no engine actor started")


STOP_LINE = "terminated: complete stages are kept; run the same command again to resume"


@pytest.mark.parametrize("moment", ["importing", "engine-starting", "generating"])
def test_sigterm_exits_promptly_with_one_line_last_and_leaves_nothing(workspace, moment):
    """However the signal lands (during the command's imports, while an engine loads and progress lines are being
    written by another thread, or while it generates), the stop line is the last thing printed."""
    ws, cfg = workspace
    proc = start_run(ws, cfg, f"terminated-{moment}")
    if moment == "importing":
        time.sleep(0.8)
        children = []
    elif moment == "engine-starting":
        children = engine_starting(proc)
    else:
        children = engines_running(proc, ws / f"runs/terminated-{moment}/logs/vllm.log")
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert time.time() - t0 < 10 and proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    last = err.strip().splitlines()[-1]
    # Early in the imports the command does not yet know that it will run stages: the line is the bare word.
    assert last == STOP_LINE or (moment == "importing" and last == "terminated"), err[-2000:]
    assert_nothing_left(proc.pid, children)
