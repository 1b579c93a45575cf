"""An engine module for the tests of the actor layer (tests/test_held_start.py): its warm-up prints a line (and fails
with HELD_TEST_FAIL set); its answer echoes the settings it was started with, where its output now goes, its rank
variables and its process, and prints a line; with HELD_TEST_HANG_RANK set, that rank never answers (a hung rank);
the interpreter's teardown would print one more line."""

from __future__ import annotations

import atexit
import os
import time


def warm() -> None:
    print("warming up", flush=True)
    if os.environ.get("HELD_TEST_FAIL"):
        raise RuntimeError("warm-up failed on purpose")


def make_answer(settings):
    from schemas.requests import to_wire

    print("engine started", flush=True)
    atexit.register(lambda: print("interpreter teardown", flush=True))

    def answer(msg: dict) -> dict:
        print("answered")
        rank = os.environ.get("RANK", "0")
        if os.environ.get("HELD_TEST_HANG_RANK") == rank:
            time.sleep(3600)
        if os.environ.get("HELD_TEST_ERROR_RANK") == rank:
            raise ValueError(f"rank {rank} failed on purpose")
        return {
            "settings": to_wire(settings),
            "stdout": os.readlink("/proc/self/fd/1"),
            "stderr": os.readlink("/proc/self/fd/2"),
            "rank": rank,
            "world": os.environ.get("WORLD_SIZE"),
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "pid": os.getpid(),
            "threads": os.environ.get("OMP_NUM_THREADS"),
        }

    return answer
