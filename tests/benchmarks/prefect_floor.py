"""Prefect's own cost per iteration: the mean wall seconds of a flow run of 8 no-op tasks (as many as a one-round
iteration has) on the temporary local API, after one run that pays the client's start.

`python -m tests.benchmarks.prefect_floor` times it with the settings the rlpipe command uses (flows/local_prefect.py:
in-memory API database, no task-run recorder or event persister, no heartbeats, no logs to the API); `--defaults`
with Prefect's defaults (a database file, heartbeats on). Each
in its own process, since the temporary API is started once per process with the settings it finds then.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from flows.local_prefect import LOCAL_API_ENV

TASKS, RUNS = 8, 8


def floor_seconds(tasks: int = TASKS, runs: int = RUNS) -> float:
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(name="no-op", cache_policy=NO_CACHE)
    def no_op(i: int) -> int:
        return i

    @flow(name="no-op-iteration")
    def no_op_iteration(n: int) -> None:
        for i in range(n):
            no_op(i)

    no_op_iteration(tasks)  # the first run pays the client's and the API's start
    t0 = time.perf_counter()
    for _ in range(runs):
        no_op_iteration(tasks)
    return (time.perf_counter() - t0) / runs


def measure(defaults: bool) -> float:
    """The floor in a fresh process with its own Prefect home (the rlpipe settings or Prefect's defaults)."""
    with tempfile.TemporaryDirectory() as home:
        env = {
            **os.environ,
            "PREFECT_HOME": home,
            "PREFECT_LOGGING_LEVEL": "WARNING",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        }  # as flows/cli.py sets it
        for key in ("PREFECT_API_URL", *LOCAL_API_ENV):
            env.pop(key, None)
        cmd = [sys.executable, "-m", "tests.benchmarks.prefect_floor", *(["--defaults"] if defaults else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if "--defaults" in sys.argv:
        print(floor_seconds())
    else:
        from flows.local_prefect import local_flow_settings, use_local_api_settings

        use_local_api_settings()
        with local_flow_settings():
            print(floor_seconds())
