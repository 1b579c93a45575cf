"""Prefect for commands run on this machine without a server (no PREFECT_API_URL): Prefect's temporary local API.

Some settings differ there from Prefect's defaults, all for the orchestration floor paid on every iteration (one
flow run each; README "Benchmarks"). Deployed runs (PREFECT_API_URL set, a worker starts them) keep the defaults.

- The temporary API keeps its state in an in-memory SQLite database. Prefect serves an in-memory database through
  one pooled connection, so the API's writers take turns. On the default database file each request and each
  server service has its own connection, and creating a flow run, which reads and then writes in one deferred
  transaction, failed at once with "database is locked" whenever the task-run recorder had committed the previous
  flow run's task-run events in between: SQLite cannot turn a read snapshot that another writer has moved past into
  a write, so its busy timeout never applies. The server answered 503 and the client retried after about 2 s.
- The API's task-run recorder and event persister are off: they write every task's state events (three per task)
  into tables that only a UI or an automation reads, and nothing can read them once the command ends and its
  in-memory state with it. Their writes were the ones still in flight when the next flow run was created.
- No flow-run heartbeats (`local_flow_settings`). They feed a server's detection of runs whose process died,
  which only a deployment uses; with them on, every flow run ends by joining the heartbeat thread, which sleeps in
  1 s steps (0.85 s per flow run measured). That delay was also what had kept the recorder's writes out of the
  next flow run's way.
- Log lines stay in the terminal and the engines' log files instead of also being shipped to the API.
The run's own record is its Parquet stages, manifests and logs, as for every run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

# For the temporary API's process (it is started with this process's environment).
LOCAL_API_ENV = {
    "PREFECT_SERVER_DATABASE_CONNECTION_URL": "sqlite+aiosqlite:///:memory:",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
}


def is_local() -> bool:
    return not os.environ.get("PREFECT_API_URL")


def use_local_api_settings() -> None:
    """Call before Prefect starts its temporary API, which reads these from the environment it passes on to the API's
    process. A value the user set (the legacy PREFECT_API_DATABASE_CONNECTION_URL included) is kept."""
    if not is_local() or os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL"):
        return
    for key, value in LOCAL_API_ENV.items():
        os.environ.setdefault(key, value)


@contextmanager
def local_flow_settings() -> Iterator[None]:
    """Flow runs started inside run without heartbeats when no server is configured (see the module docstring)."""
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
