"""Run a heavy engine (vLLM, torch, DeepSpeed) as its own process, never inside the Prefect process.

A worker is `python -m tasks.engines.workers.<name> REQUEST.json`; it writes its result JSON next to the request.
Workers get SIGKILL when their parent dies (PR_SET_PDEATHSIG), so an interrupted run leaves no orphan engine
holding memory. Their chatty logs go to a file; a failure is re-raised as one line plus the log's path.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from schemas.errors import UserError

PROGRESS_PREFIX = "progress:"  # a worker line the client echoes to the terminal (tasks/engines/workers/training.py)


class WorkerError(UserError, RuntimeError):
    pass


def die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def last_error_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "empty log"


def worker_env(extra: dict | None = None) -> dict:
    """The environment of a worker process: ours, with the repository importable."""
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(extra or {})}


def run_worker(module: str, request, scratch: Path, log: Path, env: dict | None = None) -> dict:
    """Run the worker module (a path from tasks.engines.workers) on `request` (a schemas.requests dataclass); return
    the JSON it wrote, or raise WorkerError. Its `progress:` lines are shown in the terminal as they come."""
    from schemas.requests import to_wire

    name = module.rsplit(".", 1)[-1]
    scratch.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    req_path = scratch / f"{name}-{os.getpid()}.request.json"
    resp_path = req_path.with_name(req_path.name.replace(".request.", ".response."))
    resp_path.unlink(missing_ok=True)
    req_path.write_text(json.dumps({"request": to_wire(request), "response_path": str(resp_path)}))
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(req_path)],
            stdout=out, stderr=subprocess.STDOUT, env=worker_env(env), cwd=os.getcwd(), preexec_fn=die_with_parent,
        )
        follow_progress(log, proc)
    if proc.returncode != 0 or not resp_path.exists():
        raise WorkerError(f"{name} worker failed (exit {proc.returncode}): {last_error_line(log)} [log: {log}]")
    return json.loads(resp_path.read_text())


def follow_progress(log: Path, proc: subprocess.Popen, poll: float = 1.0) -> None:
    """Wait for `proc`, echoing the `progress:` lines it appends to its log to stderr (the terminal), so a long SFT,
    reward-model or DPO run shows steps done, rate and time left."""
    with open(log, "rb") as f:
        f.seek(0, os.SEEK_END)
        while True:
            done = proc.poll() is not None
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith(PROGRESS_PREFIX):
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
            if done:
                return
            time.sleep(poll)


def worker_main(handler) -> None:
    """Entry point body for a worker module: read the typed request, call handler, write the response."""
    from schemas.requests import from_wire

    payload = json.loads(Path(sys.argv[1]).read_text())
    response = handler(from_wire(payload["request"]))
    tmp = Path(payload["response_path"] + ".tmp")
    tmp.write_text(json.dumps(response))
    tmp.replace(payload["response_path"])
