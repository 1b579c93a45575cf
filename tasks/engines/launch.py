"""Run a heavy engine (vLLM, torch, DeepSpeed) as its own process, never inside the Prefect process.

A worker is `python -m tasks.engines.workers.<name> REQUEST.json`; it writes its result JSON next to the request.
Workers get SIGKILL when their parent dies (PR_SET_PDEATHSIG), so an interrupted run leaves no orphan engine
holding memory. Their chatty logs go to a file; a failure is re-raised as one line plus the log's path.
Imports: The data-parallel helpers are imported where a rank group is launched: this module is imported by every stage.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from schemas.errors import UserError
from schemas.requests import from_wire, to_wire

PROGRESS_PREFIX = "progress:"  # a worker line the client echoes to the terminal (tasks/engines/workers/training.py)


class WorkerError(UserError, RuntimeError):
    pass


def peak_rss_gib() -> float:
    """This process's peak resident memory so far, in GiB (what an engine reports of itself)."""

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


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


def rank_envs(ranks: int, devices: list[int] | None = None, hostfile: str | None = None) -> list[dict]:
    """The environment of each of `ranks` trainer processes on this machine: what torchrun or DeepSpeed's launcher
    set (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), the CUDA devices, and on CPU the cores shared out (ranks
    that each take every core slow each other down several times over; OMP_NUM_THREADS set by the user wins)."""
    from tasks.engines.workers.data_parallel import free_port

    visible = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))} if devices else {}
    if ranks == 1 or hostfile:  # DeepSpeed's launcher sets the rank variables on every host
        return [visible] * ranks
    base = {
        **visible,
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // ranks)),
    }
    return [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(ranks)]


def hostfile_slots(hostfile: str) -> int:
    """Total `slots=N` of a DeepSpeed hostfile (`host slots=N` per line, # comments)."""
    total = 0
    for line in Path(hostfile).read_text().splitlines():
        words = line.split("#")[0].split()
        if words:
            slots = [w.split("=", 1)[1] for w in words[1:] if w.startswith("slots=")]
            if not slots or not slots[0].isdigit():
                raise WorkerError(f"{hostfile}: line {line.strip()!r} is not 'HOST slots=N'")
            total += int(slots[0])
    return total


def multi_node_launch(cmd: list[str], hostfile: str, ranks: int, env: dict) -> tuple[list[str], dict]:
    """(command, environment) that start `cmd` (`python -m MODULE ARGS`) as trainer ranks on the hosts of a DeepSpeed
    hostfile, through DeepSpeed's own launcher (pdsh to each host, then one process per slot with RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR/PORT set). Rank 0 runs on the hostfile's first host, which must be this machine (it owns
    the local socket). The extra environment travels in a private file named by DS_ENV_FILE, which the launcher
    exports to every host; the repository (and storage_root) must be at the same path on every host."""

    from tasks.engines.workers.data_parallel import free_port

    slots = hostfile_slots(hostfile)
    if slots != ranks:
        raise WorkerError(
            f"engines.hostfile {hostfile} has {slots} slots in all and engines.train_ranks is {ranks}: make them equal"
        )
    fd, env_file = tempfile.mkstemp(prefix="rlpipe-ds-env-")
    with os.fdopen(fd, "w") as f:  # mkstemp: readable by this user only (it holds the socket's key)
        f.write("".join(f"{k}={v}\n" for k, v in {**env, "PYTHONPATH": worker_env()["PYTHONPATH"]}.items()))
    runner = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        hostfile,
        "--master_port",
        str(free_port()),
        "--no_local_rank",
        "--module",
        cmd[2],
        *cmd[3:],
    ]
    return runner, {**env, "DS_ENV_FILE": env_file}


def rank_log(log: Path, rank: int) -> Path:
    """Rank 0 writes the stage's log; rank r > 0 writes `<log>-rank<r>.log` beside it."""
    return log if rank == 0 else log.with_name(f"{log.stem}-rank{rank}{log.suffix}")


def start_ranks(
    cmd: list[str],
    log: Path,
    envs: list[dict],
    hostfile: str | None = None,
    outputs: list[Path] | None = None,
    stdin=None,
) -> list[subprocess.Popen]:
    """Start `cmd` once per rank environment on this machine, or, with a hostfile, once as DeepSpeed's multi-node
    launcher (which starts and watches every rank, and ends them all when one fails). Each rank's output goes to its
    log, or to `outputs[rank]` when given."""
    if hostfile:
        cmd, env = multi_node_launch(cmd, hostfile, len(envs), envs[0])
        envs = [env]
    procs = []
    for r, env in enumerate(envs):
        with open(outputs[r] if outputs else rank_log(log, r), "ab") as out:
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdin=stdin,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=worker_env(env),
                    cwd=os.getcwd(),
                    preexec_fn=die_with_parent,
                )
            )
    return procs


def failed_rank(procs: list[subprocess.Popen]) -> int | None:
    """The rank that brought the group down, or None while none has failed. A rank killed by a signal (SIGKILL, the
    OOM killer) is the cause rather than the peers that then exit on a broken connection; else the first failed."""
    dead = [(r, p.poll()) for r, p in enumerate(procs)]
    signalled = [r for r, code in dead if code is not None and code < 0]
    failed = [r for r, code in dead if code not in (None, 0)]
    return (signalled or failed or [None])[0]


def failure_line(name: str, procs: list[subprocess.Popen], log: Path, r: int, what: str = "failed") -> str:
    """One line for a failed worker or server: rank r (when there are several), its signal or last error line, its
    log."""
    code = procs[r].poll() if procs else None
    which = f" (rank {r} of {len(procs)})" if len(procs) > 1 else ""
    cause = f"killed by signal {-code}" if code is not None and code < 0 else last_error_line(rank_log(log, r))
    return f"{name} {what}{which}: {cause} [log: {rank_log(log, r)}]"


def end_group(procs: list[subprocess.Popen]) -> int | None:
    """After a failure: give the rest of the group a moment to fail too (so the rank found is the cause, not a peer that
    lost its connection), find that rank, then kill every process left."""
    time.sleep(0.5)
    rank = failed_rank(procs)
    kill_all(procs)
    return rank


def kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def worker_env(extra: dict | None = None) -> dict:
    """The environment of a worker process: ours, with the repository importable, and torch's compiled extensions
    (DeepSpeed's CPU collectives op) kept in this Python environment unless the user chose a folder: in the shared
    default (~/.cache/torch_extensions/<python>_<device>/) the op's build file names the installing environment's
    sources, so two environments on one machine (a second clone) rebuilt it for each other, ~30-60 s every switch."""
    root = Path(__file__).resolve().parents[2]
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions")
    return {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TORCH_EXTENSIONS_DIR": extensions,
        **(extra or {}),
    }


def run_worker(
    module: str,
    request,
    scratch: Path,
    log: Path,
    env: dict | None = None,
    ranks: int = 1,
    devices: list[int] | None = None,
    hostfile: str | None = None,
) -> dict:
    """Run the worker module (a path from tasks.engines.workers) on `request` (a schemas.requests dataclass) as `ranks`
    data-parallel processes; return the JSON rank 0 wrote, or raise WorkerError. Its `progress:` lines are shown in
    the terminal as they come."""

    name = module.rsplit(".", 1)[-1]
    scratch.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    req_path = scratch / f"{name}-{os.getpid()}.request.json"
    resp_path = req_path.with_name(req_path.name.replace(".request.", ".response."))
    resp_path.unlink(missing_ok=True)
    req_path.write_text(json.dumps({"request": to_wire(request), "response_path": str(resp_path)}))
    procs = start_ranks(
        [sys.executable, "-m", module, str(req_path)],
        log,
        [{**(env or {}), **e} for e in rank_envs(ranks, devices, hostfile)],
        hostfile,
    )
    failed = follow_progress(log, procs)
    if failed is not None or not resp_path.exists():
        raise WorkerError(failure_line(f"{name} worker", procs, log, failed or 0))
    return json.loads(resp_path.read_text())


def follow_progress(log: Path, procs: list[subprocess.Popen], poll: float = 1.0) -> int | None:
    """Wait for the processes (all ranks of a worker; the first failure ends them all, and its rank is returned),
    echoing the `progress:` lines rank 0 appends to its log to stderr (the terminal), so a long SFT, reward-model or
    DPO run shows steps done, rate and time left."""
    with open(log, "rb") as f:
        f.seek(0, os.SEEK_END)
        while True:
            failed = end_group(procs) if failed_rank(procs) is not None else None
            done = failed is not None or all(p.poll() is not None for p in procs)
            for line in f.read().decode(errors="replace").splitlines():
                if line.startswith(PROGRESS_PREFIX):
                    sys.stderr.write(line + "\n")
                    sys.stderr.flush()
            if done:
                return failed
            time.sleep(poll)


def worker_main(handler) -> None:
    """Entry point body for a worker module: read the typed request, call handler, write the response."""

    payload = json.loads(Path(sys.argv[1]).read_text())
    response = handler(from_wire(payload["request"]))
    if os.environ.get("RANK", "0") != "0":  # every rank did the work; rank 0 answers
        return
    tmp = Path(payload["response_path"] + ".tmp")
    tmp.write_text(json.dumps(response))
    tmp.replace(payload["response_path"])
