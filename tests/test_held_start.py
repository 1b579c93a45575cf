"""A server spawned held (tasks/engines/resident.py, ResidentProcess.spawn): it warms up before its settings exist,
writes nothing into the run's logs until it is released, then starts with the settings it was handed and writes its
held output and everything after it into its log; ended unreleased (the command's input was bad) it leaves no log
and no file; a warm-up that fails is reported after the release with its own error line. Told to shut down, a server
exits at once, its output in its log and its socket removed, without the interpreter's teardown."""

import glob
import os
import tempfile
import time

import pytest

from schemas.requests import GenerateRequest, VLLMSettings
from tasks.engines.launch import WorkerError
from tasks.engines.resident import ResidentProcess, close_held, resident

SETTINGS = VLLMSettings(model_path="models/x", dtype="float32", seed=7, kv_cache_gib=1.0, gpu_memory_utilization=0.5)
REQUEST = GenerateRequest(model_path="models/x", jobs=())


def held_outputs() -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"held_server-{os.getpid()}-*.out"))


def wait_until_warm(server: ResidentProcess) -> None:
    deadline = time.time() + 60
    while b"warming up" not in server.held_outputs[0].read_bytes():
        assert time.time() < deadline and server.procs[0].poll() is None
        time.sleep(0.1)


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
        text = log.read_text()
        assert text.index("warming up") < text.index("engine started")
        assert not held_outputs()
    finally:
        server.close()


def test_an_unreleased_server_is_ended_and_leaves_no_log_and_no_file(tmp_path):
    log = tmp_path / "logs" / "held.log"
    server = resident("tests.held_server", "held-test", lambda: ResidentProcess("tests.held_server", log))
    server.spawn(None, held=True)
    wait_until_warm(server)
    proc = server.procs[0]
    close_held()
    assert proc.poll() is not None
    assert not log.exists() and not held_outputs()


def test_a_warm_up_that_failed_is_reported_after_the_release_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HELD_TEST_FAIL", "1")
    log = tmp_path / "logs" / "held.log"
    server = ResidentProcess("tests.held_server", log)
    server.spawn(None, held=True)
    server.procs[0].wait(60)
    with pytest.raises(
        WorkerError, match="held_server server failed to start: RuntimeError: warm-up failed on purpose"
    ):
        server.call(REQUEST, SETTINGS)
    assert "warming up" in log.read_text() and not held_outputs()


def test_a_server_told_to_shut_down_exits_at_once_with_its_output_logged_and_its_socket_removed(tmp_path):
    log = tmp_path / "server.log"
    server = ResidentProcess("tests.held_server", log)
    server.spawn(SETTINGS)
    server.call(REQUEST)
    proc, sock = server.procs[0], server.sock
    server.close()
    assert proc.returncode == 0 and not os.path.exists(sock)
    text = log.read_text()
    assert "answered" in text and "interpreter teardown" not in text


def test_a_server_never_connected_is_killed_at_close_and_its_socket_removed(tmp_path):
    server = ResidentProcess("tests.held_server", tmp_path / "server.log")
    server.spawn(SETTINGS)  # started, never asked anything: it gets no shutdown message
    deadline = time.time() + 60
    while not os.path.exists(server.sock):
        assert time.time() < deadline and server.procs[0].poll() is None
        time.sleep(0.05)
    proc, sock = server.procs[0], server.sock
    server.close()
    assert proc.returncode is not None and not os.path.exists(sock)


def test_a_socket_that_exists_before_its_server_listens_is_connected_to_once_it_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HELD_TEST_LATE_LISTEN", "1")
    server = ResidentProcess("tests.held_server", tmp_path / "server.log")
    try:
        assert server.call(REQUEST, SETTINGS)["settings"]["fields"]["seed"] == 7
    finally:
        server.close()
