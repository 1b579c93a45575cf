"""No process outlives its `rlpipe` command, whatever kills it (SIGKILL included).

The command marks its environment with `RLPIPE_OWNER=<its pid>`, which every process it starts inherits: the
embedded Ray instance's processes (its head, its agents, the engine actors' workers, which Ray's own parent-death
signal does not all reach: a raylet killed leaves its agents behind), reward workers and multiprocessing's resource
trackers, Prefect's temporary API server. Ray does this job on a cluster (a driver's actors end with it); on this
machine it is the reaper's. A reaper process, started first and in its own session (so a signal to
the command's process group leaves it standing), waits for the command to end, by exit or by any signal, then
kills every process that carries the mark and removes the command's Unix sockets and API database copy. A
parent-death signal (PR_SET_PDEATHSIG) wakes it at once; it also polls.

    python -m tasks.engines.reaper OWNER_PID
Imports: psutil is imported inside the reaper's own process and the sweep: the CLI imports this module at every start.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tasks.engines.ray_cluster import temp_dir_for

OWNER_ENV = "RLPIPE_OWNER"
API_DATABASE_PREFIX = "rlpipe-prefect-api"  # a command's copy of the temporary API's database (flows/local_prefect.py)


def shared_memory_dir() -> str:
    """Where a command keeps files written often and needed only while it runs: shared memory where the machine
    has it, else the temp dir."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def api_database_path(owner: int, token: str) -> str:
    return os.path.join(shared_memory_dir(), f"{API_DATABASE_PREFIX}-{owner}-{token}.db")


def owned_files(owner: int) -> list[str]:
    """The files a command leaves while it runs: its servers' Unix sockets and held servers' outputs
    (tasks/engines/resident.py), the files its process groups meet through on a joined cluster (`.store`: the trainer
    ranks', the weight sync's), its API database copy (with SQLite's -wal and -shm)."""
    temp = tempfile.gettempdir()
    return (
        glob.glob(os.path.join(temp, f"*-{owner}-*.sock"))
        + glob.glob(os.path.join(temp, f"*-{owner}-*.out"))
        + glob.glob(os.path.join(temp, f"*-{owner}-*.store"))
        + glob.glob(api_database_path(owner, "*") + "*")
    )


def remove_files(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def marked(owner: int) -> list:
    """Processes carrying the owner's mark (this one excepted)."""
    import psutil

    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(OWNER_ENV) == str(owner):
                out.append(proc)
        except (psutil.Error, OSError):
            continue
    return out


def sweep(owner: int, seen: list | None = None) -> int:
    """Kill the owner's processes until none is left (a dying server may still start one), and those `seen` under it
    while it ran (psutil.Process objects: one whose pid was reused since is not killed); remove its files and the
    embedded Ray instance's folder (its session files, and the engines' own temporary files)."""
    import psutil

    killed = 0
    for attempt in range(5):
        procs = marked(owner) + [p for p in (seen or []) if attempt == 0 and p.is_running()]
        if not procs:
            break
        for proc in procs:
            try:
                proc.kill()
                killed += 1
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
    remove_files(owned_files(owner))
    shutil.rmtree(temp_dir_for(owner), ignore_errors=True)
    return killed


def start_reaper() -> None:
    """Mark this process's environment and start its reaper (once per process)."""

    from tasks.engines.launch import worker_env

    if os.environ.get(OWNER_ENV) == str(os.getpid()):
        return
    os.environ[OWNER_ENV] = str(os.getpid())
    env = {k: v for k, v in worker_env().items() if k != OWNER_ENV}  # the reaper is not its own target
    subprocess.Popen(
        [sys.executable, "-m", "tasks.engines.reaper", str(os.getpid())],
        env=env,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def _wait_for(owner: int) -> list:
    """Wait for the owner to end; return every process seen under it meanwhile. Ray's raylet starts its agents with an
    environment of their own (no mark), and a raylet killed with the owner leaves them behind, no longer under it."""
    import psutil

    seen: dict[int, psutil.Process] = {}
    try:
        created = psutil.Process(owner).create_time()
    except psutil.Error:
        return []
    woken = []
    signal.signal(signal.SIGUSR1, lambda *_: woken.append(True))
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGUSR1)  # PR_SET_PDEATHSIG: our parent is the owner
    except OSError:
        pass
    if os.getppid() != owner:  # the owner died before the signal was armed
        return []
    while not woken:
        try:
            process = psutil.Process(owner)
            if process.create_time() != created:  # a reused pid is not the owner
                break
        except psutil.Error:
            break
        try:
            for child in process.children(recursive=True):
                if child.pid != os.getpid():  # the reaper is the owner's child too
                    seen.setdefault(child.pid, child)
        except psutil.Error:  # a child that ended during the scan; the owner is still there
            pass
        time.sleep(0.5)
    return list(seen.values())


if __name__ == "__main__":
    owner_pid = int(sys.argv[1])
    sweep(owner_pid, _wait_for(owner_pid))
