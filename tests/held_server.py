"""A resident server for the tests of a held start and of the shutdown (tests/test_held_start.py): its warm-up prints a
line (and fails with HELD_TEST_FAIL set); its answer echoes the settings it was released with and where its output now
goes, and prints a line; the interpreter's teardown would print one more. With HELD_TEST_LATE_LISTEN set, its socket
file exists for a second before anything listens on it (the moment between a server's bind() and listen(), drawn out).
"""

from __future__ import annotations

import atexit
import os


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
        return {
            "settings": to_wire(settings),
            "stdout": os.readlink("/proc/self/fd/1"),
            "stderr": os.readlink("/proc/self/fd/2"),
        }

    return answer


def bind_without_listening(path: str, seconds: float) -> None:
    import socket
    import time

    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        time.sleep(seconds)
    os.unlink(path)


if __name__ == "__main__":
    import sys

    from tasks.engines.resident import serve_main

    if os.environ.get("HELD_TEST_LATE_LISTEN"):
        bind_without_listening(sys.argv[2], 1.0)

    serve_main(make_answer, warm)
