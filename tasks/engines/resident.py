"""Resident engine processes: a worker kept alive across requests, spoken to over a local Unix socket.

The client starts `python -m tasks.engines.workers.<name> --serve SOCKET SETTINGS` (a typed request on the wire) on
first use, and again after the process died. Stage tasks send it paths and small settings; the data still travels as
Parquet on disk. Correctness never depends on the process's memory: every request names the checkpoint it starts from,
and a server reuses what it holds only when that is provably the same state (see each server's docstring).
Imports: the data-parallel broadcast only in a ranked server, psutil only at a server's exit."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Callable

from schemas.requests import from_wire, to_wire
from tasks.engines.launch import PROGRESS_PREFIX, WorkerError, end_group, failure_line, rank_envs, rank_log, start_ranks

HELD = "--held"  # a server's last argument instead of its settings: spawned held (ResidentProcess.spawn)


class ResidentProcess:
    """A resident server: `ranks` data-parallel processes (tasks/engines/workers/data_parallel.py) of which rank 0 owns
    the socket and passes every message on to the others; `env` and `devices` (CUDA ids) go to all of them."""

    def __init__(
        self,
        module: str,
        log: Path,
        ranks: int = 1,
        devices: list[int] | None = None,
        env: dict | None = None,
        hostfile: str | None = None,
    ):
        self.module, self.log, self.ranks, self.devices, self.env, self.hostfile = (
            module,
            log,
            ranks,
            devices,
            env or {},
            hostfile,
        )
        self.name = module.rsplit(".", 1)[-1]
        self.procs: list[subprocess.Popen] = []
        self.conn = None
        self.held_outputs: list[Path] = []  # while spawned held: each rank's output before it is released
        self.released = False

    def _died(self, what: str) -> WorkerError:
        """The group after one of its processes died or failed: all of them ended, the error names the rank that caused
        it."""
        if self.conn is not None:
            self.conn.close()
        rank = end_group(self.procs) or 0
        self._end_held()
        line = failure_line(self.name, self.procs, self.log, rank, what)
        self.procs, self.conn = [], None
        return WorkerError(line)

    def spawn(self, settings, held: bool = False) -> None:
        """Start the server's processes without waiting for them. Call it from a thread that lives as long as they
        should: PR_SET_PDEATHSIG fires when the *thread* that started a child exits (a pool thread would kill it).

        `held`: the processes only import their libraries (vLLM's alone is ~10 s), writing to a file of their own,
        then wait for their settings; a second `spawn` (or the first request) hands them over, and only then do they
        open their log and start the engine. A command spawns them held before it checks its input, so those seconds
        overlap the checks; on bad input `close` ends them, and no engine ever started. (Not with a hostfile:
        DeepSpeed's launcher starts those ranks when they are released.)"""
        if self.procs:
            if self.waiting_for_release and not held:
                self._release(settings)
            return
        if held and self.hostfile:
            return
        # In the temp dir, not the run folder: a Unix socket's path is limited to about 107 bytes.
        self.sock = os.path.join(tempfile.gettempdir(), f"{self.name}-{os.getpid()}-{secrets.token_hex(4)}.sock")
        self.key = secrets.token_bytes(16)
        envs = [
            {**self.env, "RLPIPE_AUTHKEY": self.key.hex(), **e}
            for e in rank_envs(self.ranks, self.devices, self.hostfile)
        ]
        cmd = [sys.executable, "-m", self.module, "--serve", self.sock]
        self.released = False
        if held:
            self.held_outputs = [Path(f"{self.sock.removesuffix('.sock')}.rank{r}.out") for r in range(self.ranks)]
            self.procs = start_ranks([*cmd, HELD], self.log, envs, outputs=self.held_outputs, stdin=subprocess.PIPE)
        else:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            self.procs = start_ranks([*cmd, json.dumps(_settings_wire(settings))], self.log, envs, self.hostfile)
        self.spawned = time.time()

    @property
    def waiting_for_release(self) -> bool:
        return bool(self.held_outputs) and not self.released

    def _release(self, settings) -> None:
        """Hand held processes their settings and their log (each copies what it printed while held into it first)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        for r, (proc, held) in enumerate(zip(self.procs, self.held_outputs)):
            go = {"settings": _settings_wire(settings), "log": str(rank_log(self.log, r)), "held_output": str(held)}
            try:
                proc.stdin.write((json.dumps(go) + "\n").encode())
                proc.stdin.close()
            except OSError:  # it died while held: the wait for its socket finds that and reads its log
                pass
        self.released, self.spawned = True, time.time()  # the start's deadline and progress count from here

    def _end_held(self) -> None:
        """After the processes ended: a held one's output goes to its log if it was released (it died before it could
        move it there itself), else away with it (bad input: no engine started, no log)."""
        for r, held in enumerate(self.held_outputs):
            if held.exists() and self.released:
                move_output(held, rank_log(self.log, r))
            held.unlink(missing_ok=True)
        self.held_outputs = []

    def _start(self, settings) -> None:
        self.spawn(settings)
        sock, key, started = self.sock, self.key, self.spawned
        deadline, next_note = started + 600, started + 10
        while not os.path.exists(sock):
            if any(p.poll() is not None for p in self.procs) or time.time() > deadline:
                raise self._died("server failed to start")
            if time.time() >= next_note:  # a start takes tens of seconds (vLLM loads and warms up): say so
                self._progress(f"starting {self.name}: {time.time() - started:.0f}s so far [log: {self.log}]")
                next_note += 10 * (
                    1 + int((time.time() - next_note) // 10)
                )  # spawned early: one line, not a catch-up burst
            time.sleep(0.2)
        if time.time() - started >= 10:
            self._progress(f"{self.name} started in {time.time() - started:.0f}s")
        self.conn = self._connect(sock, key, deadline)

    def _connect(self, sock: str, key: bytes, deadline: float):
        """The client end of the server's socket. The file appears at the server's bind(), a moment before its
        listen(): a connect in between is refused (seen once in CI, on a loaded machine), so it is tried again while
        the server lives."""
        while True:
            try:
                return Client(sock, family="AF_UNIX", authkey=key)
            except ConnectionRefusedError:
                if any(p.poll() is not None for p in self.procs) or time.time() > deadline:
                    raise self._died("server refused the connection") from None
                time.sleep(0.05)

    def _progress(self, text: str) -> None:
        """A progress line in the terminal and in the engine's log."""
        line = f"{PROGRESS_PREFIX} {text}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def call(self, request, settings=None, label: str = "") -> dict:
        """Send one typed request (schemas.requests), starting the server first if needed, with `settings` (a typed
        start-up request, or None)."""
        if self.conn is None:
            self._start(settings)
        msg = {"request": to_wire(request), "label": label}
        try:
            self.conn.send(msg)
            while not self.conn.poll(0.5):  # a rank that dies would leave the others waiting in a collective forever
                if any(p.poll() is not None for p in self.procs):
                    raise EOFError
            resp = self.conn.recv()
        except (EOFError, OSError):
            raise self._died("server died") from None
        if "error" in resp:
            if (
                self.ranks > 1
            ):  # the group ends on a failure (its ranks may be in different places); the next call restarts it
                raise self._died("failed")
            raise WorkerError(f"{self.name} failed: {resp['error']} [log: {self.log}]")
        return resp

    def close(self) -> None:
        error = self.request_shutdown()
        self.wait_ended()
        if error:
            raise WorkerError(error)

    def request_shutdown(self) -> str | None:
        """Ask the server to end (it finishes what it still writes, answers, then exits), or kill it if it was spawned
        early and never asked anything: no shutdown message reaches it. Returns the server's error line, if what it
        finished failed."""
        if self.conn is None:
            for proc in self.procs:
                proc.kill()
            return None
        try:
            self.conn.send({"shutdown": True})
            resp = self.conn.recv()
        except (EOFError, OSError):
            resp = {}
        self.conn.close()
        self.conn = None
        return f"{self.name} failed at its shutdown: {resp['error']} [log: {self.log}]" if "error" in resp else None

    def wait_ended(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.procs:  # a server killed after it opened its socket left the file behind (one that ended removed it)
            Path(self.sock).unlink(missing_ok=True)
        self._end_held()
        self.procs = []


def move_output(held: Path | str, log: Path | str) -> None:
    """Append what a held server printed to its log, and remove the held file."""
    with open(log, "ab") as out, open(held, "rb") as f:
        shutil.copyfileobj(f, out)
    os.unlink(held)


def _settings_wire(settings):
    return to_wire(settings) if settings is not None else None


_PROCESSES: dict[tuple[str, str], ResidentProcess] = {}


def resident(module: str, key: str, make: Callable[[], ResidentProcess]) -> ResidentProcess:
    """This process's server of `module` for `key` (a run id): one per Prefect worker process, made on first use."""
    if (module, key) not in _PROCESSES:
        _PROCESSES[(module, key)] = make()
    return _PROCESSES[(module, key)]


def close_all() -> None:
    """End every server, all asked first and then waited for, so that their exits overlap."""
    servers = list(_PROCESSES.values())
    _PROCESSES.clear()
    errors = [error for server in servers if (error := server.request_shutdown())]
    for server in servers:
        server.wait_ended()
    if errors:
        raise WorkerError(errors[0])


def close_held() -> None:
    """End the servers spawned held and never released (the command's input failed its checks)."""
    for key, proc in list(_PROCESSES.items()):
        if proc.waiting_for_release:
            _PROCESSES.pop(key).close()


atexit.register(close_all)


def _wait_until_released(warm: Callable[[], None] | None):
    """A held server (ResidentProcess.spawn): import what the engine needs, then wait for the settings and the log.
    Ends quietly when the command ends without releasing it (bad input)."""
    if warm is not None:
        warm()
    sys.stdout.flush()
    sys.stderr.flush()
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    go = json.loads(line)
    move_output(go["held_output"], go["log"])
    log = os.open(go["log"], os.O_WRONLY | os.O_APPEND)
    for fd in (1, 2):  # what the engine prints from now on (its own child processes too) goes to the log
        os.dup2(log, fd)
    os.close(log)
    return go["settings"]


def serve_main(make_answer: Callable[[object], Callable[[dict], dict]], warm: Callable[[], None] | None = None) -> None:
    """Server side: build the answering function from the settings (engine start-up happens here, before the
    socket exists, so the client's wait covers it), then answer messages until `shutdown` or the parent dies.
    `warm` is what a held server does before its settings come: the imports.
    A failed request is reported to the client as one line; a single-process server keeps serving.
    `answer.finish`, where the answering function has one, is called before a shutdown is acknowledged and when the
    client is gone: what the server still writes after its answers (the trainer's optimizer state).

    With several ranks (WORLD_SIZE > 1) rank 0 owns the socket and broadcasts each message to the others, which
    answer it too (they hold their share of the engines) and drop their answer. A failure on any rank ends that
    process, and the client ends the group."""
    socket_path = sys.argv[2]
    wire = _wait_until_released(warm) if sys.argv[3] == HELD else json.loads(sys.argv[3])
    answer = make_answer(from_wire(wire) if wire is not None else None)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from tasks.engines.workers.data_parallel import broadcast
    if rank > 0:
        while not (msg := broadcast(None)).get("shutdown"):
            try:
                answer(msg)
            except Exception:
                traceback.print_exc()
                sys.stdout.flush()
                os._exit(1)
            sys.stdout.flush()
        _exit_without_teardown()
        return
    authkey = bytes.fromhex(os.environ["RLPIPE_AUTHKEY"])
    finish = getattr(answer, "finish", lambda: None)
    with Listener(socket_path, family="AF_UNIX", authkey=authkey) as listener, listener.accept() as conn:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the client is gone: what the last answer left to write is still written
                finish()
                raise
            if world > 1:
                broadcast(msg)
            if msg.get("shutdown"):
                try:
                    finish()
                    conn.send({"ok": True})
                except Exception as exc:
                    traceback.print_exc()
                    conn.send({"error": f"{type(exc).__name__}: {exc}"})
                break
            try:
                resp = answer(msg)
            except Exception as exc:
                traceback.print_exc()
                resp = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.flush()
            conn.send(resp)
            if world > 1 and "error" in resp:
                os._exit(1)
    _exit_without_teardown()  # after the listener's close, which removes the socket file


def _exit_without_teardown() -> None:
    """End a server that was told to shut down, skipping the interpreter's teardown: every output it made is already
    on disk, and tearing down vLLM or DeepSpeed (their destructors, a loaded model's garbage) took 2.7 s and 1.2 s of
    every run's end (measured, demo model). A server with child processes of its own (vLLM's workers on GPUs) returns
    normally instead, so that their shutdown runs."""
    import psutil

    if psutil.Process().children():
        return
    sys.stdout.flush()  # what the engine's own threads printed since the last answer
    sys.stderr.flush()
    os._exit(0)
