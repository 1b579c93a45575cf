"""Crash injection for the resume guarantees: `RLPIPE_CRASH_AT=STAGE:ITERATION` SIGKILLs the whole process
group at a named point inside that stage, as a machine failure would (engine workers and Prefect's temporary
API server included). Nothing is flushed or cleaned up, which is the point: the tests then resume the run
and check that every complete stage is untouched.

The points: every stage, after its Parquet part is in place and before its manifest; `optimize`, inside the
DeepSpeed worker after the new weights are saved and before the optimizer state is; `optimize:K:rankR`, trainer rank
R alone (SIGKILL of that one process) after its first micro-step of iteration K's update, the others mid-step;
`optimize:K:state`, the resident trainer after update K is marked complete and before its optimizer state, written
after the answer, is moved into the checkpoint (tasks/engines/workers/deferred_state.py).
"""

from __future__ import annotations

import os
import signal

CRASH_ENV = "RLPIPE_CRASH_AT"


def crash_point(name: str, whole_group: bool = True) -> None:
    if os.environ.get(CRASH_ENV) == name:
        if whole_group:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
