"""Crash injection for the resume guarantees: `RLPIPE_CRASH_AT=STAGE:ITERATION` SIGKILLs the whole process
group at a named point inside that stage, as a machine failure would (engine workers and Prefect's temporary
API server included). Nothing is flushed or cleaned up, which is the point: the tests then resume the run
and check that every complete stage is untouched.

The points: every stage, after its Parquet part is in place and before its manifest; `optimize`, inside the
DeepSpeed worker after the new weights are saved and before the optimizer state is; `optimize:K:rankR`, trainer rank
R alone (SIGKILL of that one process) after its first micro-step of iteration K's update, the others mid-step
(`optimize:K:rankR:hang`: that rank stops there, printing HANG_MARK to its log, and waits to be killed with its node;
`optimize:K:rank*:hang`, every rank);
`optimize:K:state`, the resident trainer after update K is marked complete and before its optimizer state, written
after the answer, is moved into the checkpoint (tasks/engines/workers/deferred_state.py).
"""

from __future__ import annotations

import fnmatch
import os
import signal

CRASH_ENV = "RLPIPE_CRASH_AT"
# The command's process group, for an engine actor that crashes "the whole group": Ray starts each actor's worker in a
# process group of its own (tasks/engines/launch.py, engine_env, passes it along with CRASH_ENV).
GROUP_ENV = "RLPIPE_CRASH_GROUP"
HANG_MARK = "crash point: hanging"


def crash_point(name: str, whole_group: bool = True) -> None:
    if os.environ.get(CRASH_ENV) == name:
        if whole_group:
            os.killpg(int(os.environ.get(GROUP_ENV) or os.getpgid(0)), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if fnmatch.fnmatchcase(f"{name}:hang", os.environ.get(CRASH_ENV) or "-"):
        print(HANG_MARK, flush=True)
        signal.pause()


def crash_env() -> dict:
    """The crash point of this command (none in normal use), for the engines it starts."""
    return {CRASH_ENV: os.environ[CRASH_ENV], GROUP_ENV: str(os.getpgid(0))} if os.environ.get(CRASH_ENV) else {}
