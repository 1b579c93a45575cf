"""Prefect for commands run on this machine without a server (no PREFECT_API_URL): Prefect's temporary local API.

Some settings differ there from Prefect's defaults, all for the orchestration floor paid on every iteration (one
flow run each; docs/benchmarks.md). Deployed runs (PREFECT_API_URL set, a worker starts them) keep the defaults.

- The API's task-run recorder and event persister are off: they write every task's state events (three per task)
  into tables that only a UI or an automation reads, and nothing reads them once the command ends. Their writes
  were what made creating a flow run fail with "database is locked": creating one reads and then writes in one
  deferred transaction, and whenever the recorder had committed the previous flow run's events in between, SQLite
  could not turn the read snapshot into a write, so its busy timeout never applied. The server answered 503 and the
  client retried after about 2 s.
- Each command's API gets its own database file, a copy of one made once per machine and Prefect version
  (`api_database_template`, under ~/.cache/rlpipe): a fresh database runs Prefect's ~200 schema migrations first,
  about 9 s of every start (an in-memory database paid them on every command), and a shared one grows with every
  flow run ever made and is written by every command at once. The copy is removed when the command ends (by the
  reaper if it is killed). It lives in shared memory (/dev/shm) where the machine has it.
- Block types are not registered at the API's start (nothing rlpipe runs uses blocks).
- No flow-run heartbeats (`local_flow_settings`). They feed a server's detection of runs whose process died,
  which only a deployment uses; with them on, every flow run ends by joining the heartbeat thread, which sleeps in
  1 s steps (0.85 s per flow run measured). That delay was also what had kept the recorder's writes out of the
  next flow run's way.
- Log lines stay in the terminal and the engines' log files instead of also being shipped to the API.
- The API starts in the background while the command checks its input (`start_local_api`), not at its first flow
  run: about 10 s of a command's start. Prefect's "Starting/Stopping temporary server" lines are left out, so that
  bad input is still one line.
The run's own record is its Parquet stages, manifests and logs, as for every run.
Imports: Prefect's modules inside the functions: this module sets Prefect's settings, which must happen before Prefect
is imported.
"""

from __future__ import annotations

import atexit
import fcntl
import glob
import logging
import multiprocessing
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Iterator

from tasks.engines.reaper import api_database_path, remove_files

DATABASE_URL = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
# For the temporary API's process (it is started with this process's environment); the database URL is set per command.
LOCAL_API_ENV = {
    DATABASE_URL: None,
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_API_BLOCKS_REGISTER_ON_START": "false",
}
DATABASE_OWNER = "RLPIPE_PREFECT_DATABASE_OWNER"  # the pid whose copy DATABASE_URL names (children make their own)


def sqlite_url(path: Path | str) -> str:
    return f"sqlite+aiosqlite:///{path}"


def api_database_template() -> Path:
    """A database with Prefect's schema, made once per machine and Prefect version (`prefect server database upgrade`,
    ~10 s) under a lock, so that concurrent first commands make it once."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlpipe"
    template = cache / f"prefect-api-{version('prefect')}.db"
    if template.exists():
        return template
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{template.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if template.exists():  # made by the command we waited for
            return template
        with tempfile.TemporaryDirectory(dir=cache) as work:
            draft = Path(work) / template.name
            env = {**os.environ, DATABASE_URL: sqlite_url(draft), "PREFECT_HOME": work}
            env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)
            proc = subprocess.run(
                [sys.executable, "-m", "prefect", "--no-prompt", "server", "database", "upgrade", "-y"],
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0 or not draft.exists():
                raise RuntimeError(
                    f"could not make Prefect's API database: {(proc.stderr or proc.stdout).strip()[-500:]}"
                )
            os.replace(draft, template)
    return template


def is_local() -> bool:
    return not os.environ.get("PREFECT_API_URL")


def use_local_api_settings() -> None:
    """Call before Prefect starts its temporary API, which reads these from the environment it passes on to the API's
    process. A value the user set (a database URL, the legacy PREFECT_API_DATABASE_CONNECTION_URL included) is kept;
    a database copy made by a parent rlpipe process is not shared (two APIs would write one file)."""
    # A spawned worker (reward functions) re-imports the command's module but starts no API. (Its name is set before
    # that import; multiprocessing.parent_process() only after it.)
    if not is_local() or multiprocessing.current_process().name != "MainProcess":
        return
    for key, value in LOCAL_API_ENV.items():
        if value is not None:
            os.environ.setdefault(key, value)
    inherited = os.environ.get(DATABASE_OWNER, str(os.getpid())) != str(os.getpid())  # a parent command's copy
    if (os.environ.get(DATABASE_URL) and not inherited) or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return  # the user's database, or this process's copy
    copy = api_database_path(
        os.getpid(), secrets.token_hex(4)
    )  # in shared memory: the API writes on every state change
    shutil.copyfile(api_database_template(), copy)
    # Registered before Prefect's own stop of the API, so it runs after it; the reaper removes it if this is killed.
    atexit.register(lambda: remove_files(glob.glob(copy + "*")))
    os.environ.update({DATABASE_URL: sqlite_url(copy), DATABASE_OWNER: str(os.getpid())})


@contextmanager
def local_flow_settings() -> Iterator[None]:
    """Flow runs started inside run without heartbeats when no server is configured (see the module docstring); in
    either case a stage's error meant for the user is the command's one line alone (_UserErrorsOnce)."""
    quiet_user_errors()
    if not is_local():
        yield
        return
    from prefect.context import SyncClientContext
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

    # One API client for every flow run inside, as the iterations of one `rlpipe run` (subflows) share their parent's:
    # a top-level flow run otherwise builds its own client, TLS context and connection (~60 ms).
    # Logs stay in the terminal and the engines' log files: shipping each line to an API that ends with the command
    # only costs time.
    off = {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None, PREFECT_LOGGING_TO_API_ENABLED: False}
    with temporary_settings(updates=off), SyncClientContext.get_or_create():
        yield


class _QuietTemporaryServer(logging.Filter):
    """Drops Prefect's lines about starting and stopping its temporary API: a command starts it before it knows whether
    its input is good, and its error must stay one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("Starting temporary server", "Stopping temporary server"))


_QUIET = _QuietTemporaryServer()


class _UserErrorsOnce(logging.Filter):
    """Drops the task and flow runs' error records about an error meant for the user (schemas.errors.UserError): the
    command prints it as one line (flows/cli.py `_guard`), and Prefect's own records of it were three tracebacks, some
    170 lines, in front of that line. Its records that carry no exception ("Finished in state Failed(...)") follow
    the one that does and repeat its message, so they go too. Any other error keeps Prefect's tracebacks."""

    RUN_LOGGERS = ("prefect.task_runs", "prefect.flow_runs", "prefect.task_engine", "prefect.flow_engine")

    def __init__(self):
        super().__init__()
        self.messages: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        from schemas.errors import UserError

        if record.levelno < logging.ERROR or not record.name.startswith(self.RUN_LOGGERS):
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, UserError):
            self.messages.add((str(exc).splitlines() or [type(exc).__name__])[0])
            return False
        text = record.getMessage()
        return not any(message in text for message in self.messages)


def quiet_user_errors() -> None:
    """Install _UserErrorsOnce on the handlers that print Prefect's records (once per process)."""
    if any(isinstance(f, _UserErrorsOnce) for h in logging.getLogger("prefect").handlers for f in h.filters):
        return
    quiet = _UserErrorsOnce()
    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(quiet)


_API_START: list[threading.Thread] = []  # the one background start of this process's temporary API, once begun


def start_local_api() -> None:
    """Start Prefect's temporary API in a background thread (this process's import of Prefect's server code, ~3 s,
    and the API's process), so that it comes up while the command does its checks; `wait_for_local_api` before the
    first flow run. Nothing with a configured server; once per process (a running API is left as it is).

    The thread imports while the checks import the tokenizer's libraries and the reward files. Python serialises
    imports of one module across threads; the two sets share only a few self-contained packages (jinja2, psutil),
    so neither can wait on the other in a cycle. Bad input therefore fails as fast as without it."""
    if not is_local() or _API_START:
        return
    logging.getLogger("prefect").addFilter(_QUIET)

    def start() -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            SubprocessASGIServer().start()
        except Exception:  # left to the first flow run's client, which starts it again and reports the failure
            pass

    _API_START.append(threading.Thread(target=start, name="rlpipe-prefect-api-start", daemon=True))
    _API_START[0].start()


def wait_for_local_api() -> None:
    """Until the background start has ended: a client made while it runs would find the API marked running, not yet
    answering."""
    for thread in _API_START:
        thread.join()
