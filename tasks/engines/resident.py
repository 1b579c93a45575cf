"""Resident engine processes: a worker kept alive across requests, spoken to over a local Unix socket.

The client starts `python -m tasks.engines.workers.<name> --serve SOCKET SETTINGS` (a typed request on the wire) on first use, and again after
the process died. Stage tasks send it paths and small settings; the data still travels as Parquet on disk.
Correctness never depends on the process's memory: every request names the checkpoint it starts from, and a
server reuses what it holds only when that is provably the same state (see each server's docstring).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import Callable

from schemas.requests import from_wire, to_wire
from tasks.engines.launch import PROGRESS_PREFIX, WorkerError, die_with_parent, last_error_line, worker_env


class ResidentProcess:
    def __init__(self, module: str, log: Path):
        self.module, self.log = module, log
        self.name = module.rsplit(".", 1)[-1]
        self.proc: subprocess.Popen | None = None
        self.conn = None

    def _start(self, settings) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # In the temp dir, not the run folder: a Unix socket's path is limited to about 107 bytes.
        sock = os.path.join(tempfile.gettempdir(), f"{self.name}-{os.getpid()}-{secrets.token_hex(4)}.sock")
        key = secrets.token_bytes(16)
        args = json.dumps(to_wire(settings) if settings is not None else None)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", self.module, "--serve", sock, args],
                stdout=out, stderr=subprocess.STDOUT, env=worker_env({"RLPIPE_AUTHKEY": key.hex()}),
                cwd=os.getcwd(), preexec_fn=die_with_parent,
            )
        started = time.time()
        deadline, next_note = started + 600, started + 10
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.time() > deadline:
                raise WorkerError(f"{self.name} server failed to start: {last_error_line(self.log)} [log: {self.log}]")
            if time.time() >= next_note:  # a start takes tens of seconds (vLLM loads and warms up): say so
                self._progress(f"starting {self.name}: {time.time() - started:.0f}s so far [log: {self.log}]")
                next_note += 10
            time.sleep(0.2)
        if time.time() - started >= 10:
            self._progress(f"{self.name} started in {time.time() - started:.0f}s")
        self.conn = Client(sock, family="AF_UNIX", authkey=key)

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
            resp = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            raise WorkerError(f"{self.name} server died: {last_error_line(self.log)} [log: {self.log}]") from None
        if "error" in resp:
            raise WorkerError(f"{self.name} failed: {resp['error']} [log: {self.log}]")
        return resp

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send({"shutdown": True})
                self.conn.recv()
            except (EOFError, OSError):
                pass
            self.conn.close()
            self.conn = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


_PROCESSES: dict[tuple[str, str], ResidentProcess] = {}


def resident(module: str, key: str, make: Callable[[], ResidentProcess]) -> ResidentProcess:
    """This process's server of `module` for `key` (a run id): one per Prefect worker process, made on first use."""
    if (module, key) not in _PROCESSES:
        _PROCESSES[(module, key)] = make()
    return _PROCESSES[(module, key)]


def close_all() -> None:
    while _PROCESSES:
        _PROCESSES.popitem()[1].close()


atexit.register(close_all)


def serve_main(make_answer: Callable[[object], Callable[[dict], dict]]) -> None:
    """Server side: build the answering function from the settings (engine start-up happens here, before the
    socket exists, so the client's wait covers it), then answer messages until `shutdown` or the parent dies.
    A failed request is reported to the client as one line; the server keeps serving."""
    socket_path, wire = sys.argv[2], json.loads(sys.argv[3])
    answer = make_answer(from_wire(wire) if wire is not None else None)
    authkey = bytes.fromhex(os.environ["RLPIPE_AUTHKEY"])
    with Listener(socket_path, family="AF_UNIX", authkey=authkey) as listener, listener.accept() as conn:
        while True:
            msg = conn.recv()
            if msg.get("shutdown"):
                conn.send({"ok": True})
                return
            try:
                resp = answer(msg)
            except Exception as exc:
                traceback.print_exc()
                resp = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.flush()
            conn.send(resp)
