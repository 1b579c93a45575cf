"""Client of the resident vLLM server: one engine per Prefect process, reused across rounds, iterations and eval.

Correctness never depends on the engine's memory: every request names the weights it must use, and the
server syncs to them in place before generating, and reports its logprob gap to the trainer's probe
(tasks/engines/sync_probe.py). If the server dies, the next request starts a new one from the requested weights.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import subprocess
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path

from tasks.engines.launch import WorkerError, die_with_parent, last_error_line, worker_env


class ResidentEngine:
    def __init__(self, socket_dir: Path, log: Path, settings: dict):
        self.socket_dir, self.log, self.settings = socket_dir, log, settings
        self.proc: subprocess.Popen | None = None
        self.conn = None

    def _start(self, model_path: str) -> None:
        self.socket_dir.mkdir(parents=True, exist_ok=True)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        sock = str(self.socket_dir / f"vllm-{os.getpid()}-{secrets.token_hex(4)}.sock")
        key = secrets.token_bytes(16)
        env = worker_env({"RLPIPE_AUTHKEY": key.hex()})
        args = json.dumps({**self.settings, "model_path": model_path})
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tasks.engines.vllm_generate", "--serve", sock, args],
                stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent,
            )
        deadline = time.time() + 600
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.time() > deadline:
                raise WorkerError(f"vLLM server failed to start: {last_error_line(self.log)} [log: {self.log}]")
            time.sleep(0.2)
        self.conn = Client(sock, family="AF_UNIX", authkey=key)

    def generate(self, model_path: str, jobs: list[dict]) -> dict:
        if self.conn is None:
            self._start(model_path)
        try:
            self.conn.send({"op": "generate", "model_path": model_path, "jobs": jobs})
            resp = self.conn.recv()
        except (EOFError, OSError):
            self.close()
            raise WorkerError(f"vLLM server died: {last_error_line(self.log)} [log: {self.log}]") from None
        if "error" in resp:
            raise WorkerError(f"vLLM generation failed: {resp['error']}")
        return resp

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.send({"op": "shutdown"})
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


_ENGINES: dict[str, ResidentEngine] = {}


def resident_engine(key: str, socket_dir: Path, log: Path, settings: dict) -> ResidentEngine:
    if key not in _ENGINES:
        _ENGINES[key] = ResidentEngine(socket_dir, log, settings)
    return _ENGINES[key]


def close_all() -> None:
    while _ENGINES:
        _ENGINES.popitem()[1].close()


atexit.register(close_all)
