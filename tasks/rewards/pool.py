"""Reward functions run in a pool of worker processes, with a per-sample timeout.

A reward function returns a number, or a mapping with the number under "score" and anything else it wants kept
(JSON-serialisable: a judge's text, a program's test results), which the scores table stores as `info_<name>`.
A reward function that raises, hangs or returns something that is not a number gives that sample reward 0 and an
error string, and the run goes on (the error rate is a metric). The timeout is a SIGALRM timer in the worker's
main thread, which interrupts a function stuck in Python; a worker stuck inside C code is killed when its whole
chunk overruns, and its samples are marked as timed out. A worker that dies loses its chunk, which is retried once
on a fresh pool. A non-finite score is a bug in the function, not a sample to skip: the caller refuses it.

Workers receive function references (tasks/rewards/loader.py), not functions, and load them once per process (a
reference to an edited file loads again); they do not re-run the parent's main module (`_WorkerProcess`). The pool
is created on first use, or ahead of it by `start_workers`, and kept for the life of the process.
`workers=0` scores in the calling process, without the timeout, for debugging.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import types
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict

from schemas.errors import UserError
from tasks.rewards.loader import FunctionSpec, accepted_arguments, is_batched, load_function

# (score, or a process reward's step scores; error; the function's other keys as JSON, or None)
Result = tuple["float | list[float]", "str | None", "str | None"]
_POOL = None
_POOL_SIZE = 0


class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout()


def _number(value) -> float:
    """bool, int, float and numpy scalars count; None, text and containers are a bug in the function."""
    if not isinstance(value, (str, bytes, list, tuple, dict, set)) and value is not None:
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"returned {type(value).__name__} {str(value)[:40]!r}, not a number")


def _step_numbers(value, steps: list) -> list[float]:
    """A process reward's result: one number per step."""
    if isinstance(value, (str, bytes, dict, set)) or not hasattr(value, "__len__"):
        raise TypeError(f"returned {type(value).__name__} {str(value)[:40]!r}, not a list of step scores (per_step)")
    if len(value) != len(steps):
        raise ValueError(f"returned {len(value)} step scores for {len(steps)} steps")
    return [_number(v) for v in value]


def _converter(spec: FunctionSpec):
    """What turns the function's return value for one sample into (its score, the rest as JSON or None): the score
    is a list of step scores when per_step."""
    number = (lambda value, sample: _step_numbers(value, sample["steps"])) if spec.per_step else lambda v, s: _number(v)

    def convert(value, sample):
        if not isinstance(value, Mapping):
            return number(value, sample), None
        if "score" not in value:
            raise TypeError(f"returned a mapping without 'score' (keys: {', '.join(map(str, value))[:60]})")
        rest = {k: v for k, v in value.items() if k != "score"}
        return number(value["score"], sample), (json.dumps(rest, default=str) if rest else None)

    return convert


def _arguments(accepted, sample: dict) -> dict:
    return sample if accepted is None else {k: v for k, v in sample.items() if k in accepted}


def _guarded(call, timeout: float | None):
    """call() with the alarm set; (value, None) or (None, error string)."""
    if timeout:
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        return call(), None
    except _Timeout:
        return None, f"timeout: no result after {timeout:g}s"
    except Exception as exc:  # a broken reward function must not stop the run
        return None, f"{type(exc).__name__}: {exc}"[:200]
    finally:
        if timeout:
            signal.setitimer(signal.ITIMER_REAL, 0)


def _score_one_by_one(fn, spec: FunctionSpec, samples: list[dict], timeout: float | None) -> list[Result]:
    accepted, convert = accepted_arguments(fn), _converter(spec)
    out = []
    for sample in samples:
        value, error = _guarded(lambda: convert(fn(**_arguments(accepted, sample), **spec.kwargs), sample), timeout)
        out.append((0.0, error, None) if error else (value[0], None, value[1]))
    return out


def _score_batched(fn, spec: FunctionSpec, samples: list[dict], timeout: float | None) -> list[Result]:
    accepted, convert = accepted_arguments(fn), _converter(spec)
    columns = {k: [s[k] for s in samples] for k in samples[0]} if samples else {}
    if samples:  # TRL's names: chat prompts as their messages, text prompts as the model saw them
        columns["completions"] = columns["completion"]
        columns["prompts"] = [s["messages"] if isinstance(s["completion"], list) else s["prompt"] for s in samples]

    def call():
        values = list(fn(**_arguments(accepted, columns), **spec.kwargs))
        if len(values) != len(samples):
            raise ValueError(f"returned {len(values)} scores for {len(samples)} samples")
        return [convert(v, sample) for v, sample in zip(values, samples)]

    values, error = _guarded(call, timeout * len(samples) if timeout else None)
    return [(0.0, error, None)] * len(samples) if error else [(v, None, info) for v, info in values]


def score_chunk(specs: list[FunctionSpec], samples: list[dict], timeout: float | None) -> dict[str, list[Result]]:
    """Every function on every sample of the chunk (runs inside a worker when timeout is set). A function that cannot
    be loaded scores the whole chunk 0 with its load error (the run's preflight has normally caught it already)."""
    if timeout:
        signal.signal(signal.SIGALRM, _on_alarm)
    out = {}
    for spec in specs:
        try:
            fn = load_function(spec)
        except UserError as exc:
            out[spec.name] = [(0.0, str(exc)[:200], None)] * len(samples)
            continue
        score = _score_batched if is_batched(spec, fn) else _score_one_by_one
        out[spec.name] = score(fn, spec, samples, timeout)
    return out


class _WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned worker that does not run the parent's main module again.

    multiprocessing re-runs the parent's `__main__` in every spawned child, so that functions defined there can be
    unpickled. A reward worker runs only this module's `score_chunk` and loads the functions by reference, while the
    parent's main module is the `rlpipe` command (the CLI and Prefect: ~2 s of CPU per worker, measured, against 0.3 s
    for this module and the built-in rewards), a benchmark, or a Prefect worker's engine. Multiprocessing reads
    `__main__` only while it launches the child, so for that moment it sees a bare module with nothing to re-run.
    (Another thread pickling an object of the main module in that moment would fail: rlpipe's threads do not.)"""

    @staticmethod
    def _Popen(process_obj):
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__ and no __spec__: nothing to re-run
        try:
            return multiprocessing.context.SpawnProcess._Popen(process_obj)
        finally:
            sys.modules["__main__"] = main


class WorkerContext(multiprocessing.context.SpawnContext):
    # spawn, not fork: the caller is a multi-threaded Prefect process.
    Process = _WorkerProcess


def _pool(workers: int) -> ProcessPoolExecutor:
    global _POOL, _POOL_SIZE
    if _POOL is None or _POOL_SIZE != workers:
        _close()
        _POOL, _POOL_SIZE = ProcessPoolExecutor(workers, mp_context=WorkerContext()), workers
    return _POOL


def start_workers(specs: list[FunctionSpec], workers: int) -> None:
    """Spawn the pool's workers now, without waiting, each loading the functions (as its first chunk would): a command
    calls it once its checks have passed, so that the workers start while the engines do, not at the first scores.
    A worker that fails here is found, and explained, by the first `score_samples`."""
    if workers == 0 or not specs:
        return
    pool, wire = _pool(workers), json.dumps([asdict(s) for s in specs])
    for _ in range(workers):  # every submit finds no idle worker yet, so each spawns one
        pool.submit(worker_start_check, wire)


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


class RewardPoolError(UserError, RuntimeError):
    pass


def worker_start_check(specs_json: str) -> None:
    """What a reward worker does before its first sample: import this module and load every function. Run by each
    worker that `start_workers` spawns, and in a child by `why_workers_die`."""
    for spec in json.loads(specs_json):
        load_function(FunctionSpec(**spec))


def why_workers_die(specs: list[FunctionSpec]) -> str:
    """The real cause when spawned workers die at start: the last line a child with this process's sys.path prints
    when it does what a worker does (a broken pool only says that a child "terminated abruptly", and the child's
    traceback went to a terminal nobody reads, e.g. a Prefect worker's)."""
    code = "import sys; from tasks.rewards.pool import worker_start_check; worker_start_check(sys.argv[1])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps([asdict(s) for s in specs])],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the check could not run: {exc}"
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    if proc.returncode == 0:
        return "the workers import and load every function in a check; they died later (out of memory?)"
    return lines[-1] if lines else f"exit {proc.returncode}"


def score_samples(
    specs: list[FunctionSpec], samples: list[dict], timeout_s: float, workers: int
) -> dict[str, list[Result]]:
    """{function name: [(score, error, info) per sample]}, in sample order. `samples` hold the keyword arguments of each
    call (tasks/rewards/scoring.py builds them)."""
    if workers == 0 or not samples:
        return score_chunk(specs, samples, None)
    size = min(32, max(1, -(-len(samples) // (workers * 4))))
    chunks = [samples[i : i + size] for i in range(0, len(samples), size)]
    # Every sample may use its whole budget for every function, plus start-up slack for a fresh worker.
    budget = timeout_s * size * len(specs) + 30
    done: dict[int, dict[str, list[Result]]] = {}
    todo = list(range(len(chunks)))
    for _attempt in range(2):  # chunks lost to a dead worker get one more try on a fresh pool
        pool = _pool(workers)
        futures = {i: pool.submit(score_chunk, specs, chunks[i], timeout_s) for i in todo}
        lost = []
        for i, future in futures.items():
            try:
                done[i] = future.result(timeout=budget)
            except TimeoutError:
                _close()
                done[i] = {
                    s.name: [(0.0, f"timeout: worker killed after {budget:g}s", None)] * len(chunks[i]) for s in specs
                }
            except BrokenProcessPool:
                _close()
                lost.append(i)
        todo = lost
        if not todo:
            break
    if todo and not done:
        raise RewardPoolError(f"reward workers could not start or all died: {why_workers_die(specs)}")
    for i in todo:
        done[i] = {s.name: [(0.0, "reward worker died", None)] * len(chunks[i]) for s in specs}
    return {s.name: [r for i in range(len(chunks)) for r in done[i][s.name]] for s in specs}
