"""What the engine actors (tasks/engines/resident.py) and their worker modules share: the error a failed engine raises
(one line plus its log's path), each rank's log and the progress lines a client echoes from it, the environment an
engine runs in, and the few facts an engine reports of itself.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

from schemas.errors import UserError
from storage.crash import crash_env

PROGRESS_PREFIX = "progress:"  # a worker line the client echoes to the terminal (tasks/engines/workers/training.py)


class WorkerError(UserError, RuntimeError):
    pass


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (what an engine reports of itself)."""

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def last_error_line(log: Path) -> str:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "empty log"


def rank_log(log: Path, rank: int) -> Path:
    """Rank 0 writes the engine's log; rank r > 0 writes `<log>-rank<r>.log` beside it."""
    return log if rank == 0 else log.with_name(f"{log.stem}-rank{rank}{log.suffix}")


class LogTail:
    """The `progress:` lines appended to a log since the wait began, echoed to the terminal."""

    def __init__(self, log: Path):
        self.log, self.at = log, log.stat().st_size if log.exists() else 0

    def echo(self) -> None:
        if not self.log.exists():
            return
        with open(self.log, "rb") as f:
            f.seek(self.at)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.at += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(PROGRESS_PREFIX):
                sys.stderr.write(line + "\n")
        sys.stderr.flush()


def engine_env() -> dict:
    """What an engine needs in its environment besides its node's own: the repository importable, and torch's compiled
    extensions (DeepSpeed's CPU collectives op) kept in this Python environment unless the user chose a folder: in the
    shared default (~/.cache/torch_extensions/<python>_<device>/) the op's build file names the installing
    environment's sources, so two environments on one machine (a second clone) rebuilt it for each other, ~30-60 s
    every switch."""
    root = Path(__file__).resolve().parents[2]
    return {
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions"),
        **crash_env(),  # the tests' crash points reach the engines on every node
    }


def worker_env(extra: dict | None = None) -> dict:
    """The environment of a process this command starts on this machine: ours, with engine_env's additions."""
    return {**os.environ, **engine_env(), **(extra or {})}
