"""The engine actors (tasks/engines/resident.py) on the command's embedded Ray: a server spawned held warms up before
its settings exist and writes nothing into the run's logs until it is released, then starts with the settings it was
handed and writes its held output and everything after it into its log; ended unreleased (the command's input was
bad) it leaves no log and no file; a warm-up that fails is reported after the release with its own error line. Ranks
get the torch.distributed variables at rank 0's address; a rank that fails or hangs ends the group with one line
naming it; ended, no actor process is left."""

import glob
import os
import tempfile
import time

import psutil
import pytest

from schemas.requests import GenerateRequest, VLLMSettings
from tasks.engines.launch import WorkerError
from tasks.engines.resident import ResidentProcess, close_held, resident

SETTINGS = VLLMSettings(model_path="models/x", dtype="float32", seed=7, kv_cache_gib=1.0, gpu_memory_utilization=0.5)
REQUEST = GenerateRequest(model_path="models/x", jobs=())


def held_outputs() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"held_server-{os.getpid()}-*.out"))


def wait_until_warm(server: ResidentProcess) -> None:
    """A call queued behind the actor's creation returns once its imports (`warm`) are done."""
    import ray

    ray.get(server.actors[0].where.remote(), timeout=60)


def gone(pid: int) -> bool:
    deadline = time.time() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_released_server_starts_with_its_settings_and_moves_its_held_output_into_its_log(tmp_path):
    log = tmp_path / "logs" / "held.log"
    server = ResidentProcess("tests.held_server", log)
    server.spawn(None, held=True)
    try:
        wait_until_warm(server)
        assert not log.parent.exists()  # held: nothing in the run's logs yet
        server.spawn(SETTINGS)  # released
        answer = server.call(REQUEST)
        assert answer["settings"]["fields"]["seed"] == 7 and answer["settings"]["fields"]["model_path"] == "models/x"
        assert answer["stdout"] == answer["stderr"] == str(log)
        assert answer["threads"] is None  # one rank chooses its own threads (Ray would have set 1)
        text = log.read_text()
        assert text.index("warming up") < text.index("engine started") < text.index("answered")
        assert not held_outputs()
    finally:
        server.close()
    assert gone(answer["pid"]) and "interpreter teardown" not in log.read_text()


def test_two_stages_asking_a_held_server_at_once_start_it_once(tmp_path):
    """One-step off-policy training generates iteration k + 1 in a thread beside iteration k: both stages' first
    requests reach the held engine together. It starts once (both releasing it started every actor twice)."""
    from concurrent.futures import ThreadPoolExecutor

    log = tmp_path / "logs" / "held.log"
    server = ResidentProcess("tests.held_server", log)
    server.spawn(None, held=True)
    try:
        wait_until_warm(server)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: server.call(REQUEST, SETTINGS), range(2)))
        assert answers[0]["pid"] == answers[1]["pid"]
        assert log.read_text().count("engine started") == 1 and log.read_text().count("answered") == 2
    finally:
        server.close()


def test_an_unreleased_server_is_ended_and_leaves_no_log_and_no_file(tmp_path):
    log = tmp_path / "logs" / "held.log"
    server = resident("tests.held_server", "held-test", lambda: ResidentProcess("tests.held_server", log))
    server.spawn(None, held=True)
    wait_until_warm(server)
    close_held()
    assert not server.running and not log.exists() and not held_outputs()


def test_a_warm_up_that_failed_is_reported_after_the_release_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HELD_TEST_FAIL", "1")
    log = tmp_path / "logs" / "held.log"
    server = ResidentProcess("tests.held_server", log, env={"HELD_TEST_FAIL": "1"})
    server.spawn(None, held=True)
    with pytest.raises(
        WorkerError,
        match=r"held_server failed to start \(actor \w+ on node 127\.0\.0\.1 .*\): RuntimeError: warm-up failed",
    ):
        server.call(REQUEST, SETTINGS)
    assert "warming up" in log.read_text() and not held_outputs() and not server.running


def test_ranks_meet_at_rank_0_and_a_failed_or_hung_rank_ends_the_group_with_one_line(tmp_path):
    log = tmp_path / "ranks.log"
    server = ResidentProcess("tests.held_server", log, ranks=2)
    answer = server.call(REQUEST, SETTINGS)
    assert (answer["rank"], answer["world"]) == ("0", "2") and answer["master"].startswith("127.0.0.1:")
    assert answer["threads"] == str(max(1, os.cpu_count() // 2))  # the cores shared out
    assert (tmp_path / "ranks-rank1.log").read_text().count("answered") == 1  # every rank got the request
    server.close()

    failing = ResidentProcess("tests.held_server", log, ranks=2, env={"HELD_TEST_ERROR_RANK": "1"})
    with pytest.raises(
        WorkerError, match=r"held_server failed \(rank 1 of 2, actor \w+ on node 127\.0\.0\.1 .*rank 1 failed on"
    ):
        failing.call(REQUEST, SETTINGS)
    assert not failing.running

    hung = ResidentProcess(
        "tests.held_server", log, ranks=2, env={"HELD_TEST_HANG_RANK": "1", "HELD_TEST_ERROR_RANK": "0"}
    )
    t0 = time.time()
    with pytest.raises(WorkerError, match=r"rank 1 on node 127\.0\.0\.1 .* did not answer \(hung\)"):
        hung.call(REQUEST, SETTINGS)
    assert time.time() - t0 < 30 and not hung.running


STOP_SCRIPT = """
import json, signal, sys, time
import psutil
from tasks.engines import ray_cluster

terms = []
signal.signal(signal.SIGTERM, lambda *_: terms.append(True))

def monitors():
    lines = {c.pid: " ".join(c.cmdline()) for c in psutil.Process().children()}
    return [pid for pid, line in lines.items() if "autoscaler" in line and "monitor" in line]

ray_cluster.connect(None)
# The command's own handler still runs once Ray's driver is connected, and nothing aborts the process 3 s later (Ray's
# driver installed Abseil's failure handler, whose alarm does).
signal.raise_signal(signal.SIGTERM)
time.sleep(3.5)
before = monitors()
ended = []

def watch(pid):  # when the monitor stopped running: gone, or a zombie left for its parent to reap
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.Error:
            break
        time.sleep(0.01)
    ended.append(time.time())

import threading
watcher = threading.Thread(target=watch, args=(before[0],), daemon=True)
t = time.time()
watcher.start()
ray_cluster.stop()
watcher.join(5)
left = len(psutil.Process().children(recursive=True))
print(json.dumps({"monitors": before, "monitor_seconds": ended[0] - t, "left": left, "terms": len(terms)}))
"""


def test_stopping_the_embedded_instance_ends_its_autoscaler_monitor_first_and_quietly():
    """The monitor's SIGTERM handler, which `ray.shutdown` meets after the GCS is gone, held every command's exit for
    Ray's 1 s grace; stop() kills it first: nothing is left, nothing is printed, and the monitor has stopped well
    within that grace. (Timed from the monitor's end, not the whole stop's: the stop also waits for the workers'
    teardown, which a loaded machine stretches towards 1 s by itself.)
    A SIGTERM after Ray's start reaches the command's own handler, and the process is not aborted after it."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["monitors"]) == 1 and out["left"] == 0 and out["terms"] == 1, out
    assert out["monitor_seconds"] < 0.5 and "autoscaler" not in proc.stderr, (out, proc.stderr[-1000:])
