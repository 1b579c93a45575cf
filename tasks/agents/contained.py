"""A call into the user's code (a tool, an environment) that cannot stop the run: a timeout and any exception become
an error string."""

from __future__ import annotations

import signal
from typing import Callable


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def contained(call: Callable[[], object], timeout_s: float, what: str) -> tuple[object, str | None]:
    """(call(), None), or (None, an error naming `what`). The timeout is SIGALRM's: call it from a process's main
    thread (the reward workers run these calls in theirs)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return call(), None
    except _Timeout:
        return None, f"{what}: no result after {timeout_s:g}s"
    except Exception as exc:  # the user's code: whatever it raises is reported, not raised
        return None, f"{what}: {type(exc).__name__}: {exc}"[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
