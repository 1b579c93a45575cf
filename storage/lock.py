"""One writer per run: an advisory lock (`runs/RUN/_lock`) held by every command that writes a run (run, resume,
rerun, sft, dpo, rm-train, demo, and the deployments' flows) for the life of its process.

The lock is an flock on the file, so the kernel releases it when the holder dies, however it dies: a crashed run
never leaves a stale lock on the machine it ran on. The file also names the holder (pid, host, command, since), which
is what a second writer is told. On a shared filesystem that does not honour flock across hosts, a lock file naming
another host is honoured as written (stopped writers leave it; delete it by hand once that host's writer is gone).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from schemas.errors import UserError
from storage.layout import RunLayout

_HELD: dict[str, int] = {}  # lock path → the open descriptor that holds it (released at exit)


class RunLocked(UserError):
    pass


def _holder(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def acquire_run_lock(layout: RunLayout, command: str) -> None:
    """Hold the run's lock for this process, or raise RunLocked naming the writer that holds it."""
    path = layout.lock_path
    if str(path) in _HELD:
        return
    layout.run_dir.mkdir(parents=True, exist_ok=True)
    holder = _holder(path)
    if holder and holder.get("host") != socket.gethostname() and holder.get("pid"):
        raise RunLocked(_message(layout, holder))
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunLocked(_message(layout, _holder(path))) from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    _HELD[str(path)] = fd


def release_run_lock(layout: RunLayout) -> None:
    fd = _HELD.pop(str(layout.lock_path), None)
    if fd is not None:
        os.ftruncate(fd, 0)  # an empty lock file names no holder
        os.close(fd)


def _message(layout: RunLayout, holder: dict) -> str:
    who = (
        (
            f"`rlpipe {holder.get('command', '?')}` (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
            f"since {holder.get('since', '?')})"
        )
        if holder
        else "another rlpipe process"
    )
    return f"run {layout.run_id!r} is being written by {who}; wait for it to finish or stop it"
