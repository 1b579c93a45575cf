"""Reward functions run in a pool of worker processes, with a per-sample timeout.

A reward function that raises or hangs gives that sample reward 0 and an error string, and the run goes on
(the error rate is a metric). The timeout is a SIGALRM timer in the worker's main thread, which interrupts
a function stuck in Python; a worker stuck inside C code is killed when its whole chunk overruns, and its
samples are marked as timed out. A worker that dies loses its chunk, which is retried once on a fresh pool. A non-finite score is a bug in the function, not a sample to skip: the
caller refuses it.

The pool is created on first use and kept for the life of the process (spawned workers import the reward
registry once). `workers=0` scores in the calling process, without the timeout, for debugging.
"""

from __future__ import annotations

import atexit
import multiprocessing
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

from schemas.config import RewardConfig

Result = tuple[float, "str | None"]  # (score, error)
_POOL = None
_POOL_SIZE = 0


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _score_one(fn, sample, cfg, timeout: float | None) -> Result:
    if timeout:
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return float(fn(sample, cfg)), None
    except _Timeout:
        return 0.0, f"timeout: no result after {timeout:g}s"
    except Exception as exc:  # a broken reward function must not stop the run
        return 0.0, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)


def score_chunk(fns: dict[str, Callable], samples: list, cfg: RewardConfig, timeout: float | None) -> dict[str, list[Result]]:
    """Every function on every sample of the chunk (runs inside a worker when timeout is set)."""
    if timeout:
        signal.signal(signal.SIGALRM, _on_alarm)
    return {name: [_score_one(fn, s, cfg, timeout) for s in samples] for name, fn in fns.items()}


def _pool(workers: int) -> ProcessPoolExecutor:
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE != workers:
        _close()
        # spawn, not fork: the caller is a multi-threaded Prefect process.
        _POOL, _POOL_SIZE = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")), workers
    return _POOL


def _close() -> None:
    """Stop the pool now, killing a worker stuck where the alarm cannot reach it (Python 3.11 has no
    public way to terminate a ProcessPoolExecutor's workers)."""
    global _POOL
    if _POOL is not None:
        for proc in list((_POOL._processes or {}).values()):
            proc.kill()
        _POOL.shutdown(wait=False, cancel_futures=True)
        _POOL = None


atexit.register(_close)


class RewardPoolError(RuntimeError):
    pass


def score_samples(fns: dict[str, Callable], samples: list, cfg: RewardConfig, workers: int) -> dict[str, list[Result]]:
    """{function name: [(score, error) per sample]}, in sample order."""
    if workers == 0 or not samples:
        return score_chunk(fns, samples, cfg, None)
    size = min(32, max(1, -(-len(samples) // (workers * 4))))
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    # Every sample may use its whole budget for every function, plus start-up slack for a fresh worker.
    budget = cfg.timeout_s * size * len(fns) + 30
    done: dict[int, dict[str, list[Result]]] = {}
    todo = list(range(len(chunks)))
    for _attempt in range(2):  # chunks lost to a dead worker get one more try on a fresh pool
        pool = _pool(workers)
        futures = {i: pool.submit(score_chunk, fns, chunks[i], cfg, cfg.timeout_s) for i in todo}
        lost = []
        for i, future in futures.items():
            try:
                done[i] = future.result(timeout=budget)
            except TimeoutError:
                _close()
                done[i] = {name: [(0.0, f"timeout: worker killed after {budget:g}s")] * len(chunks[i]) for name in fns}
            except BrokenProcessPool:
                _close()
                lost.append(i)
        todo = lost
        if not todo:
            break
    if todo and not done:
        raise RewardPoolError("reward workers could not start or all died (see the log above)")
    for i in todo:
        done[i] = {name: [(0.0, "reward worker died")] * len(chunks[i]) for name in fns}
    return {name: [r for i in range(len(chunks)) for r in done[i][name]] for name in fns}
