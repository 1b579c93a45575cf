"""The optimizer state of an update, written while the next stages run.

An update's checkpoint is the weights (what vLLM loads next, 0.54 GB for a 135M model in fp32) and DeepSpeed's state
(what an exact resume needs besides: Adam's two moments, 2× that). The sampler needs only the weights, so
a resident trainer with one rank writes the weights, answers, and writes the state in a thread of its own while the
next iteration's rollouts run (it holds the engine untouched until then):

1. before answering: the weights, the sync probe, and `trainer_state.json` marked pending, under the update's
   temporary folder; the caller renames that folder into place and marks the stage complete;
2. in the thread: DeepSpeed's state into a staging folder beside the checkpoint (`iter=K.state-tmp/`), which no rename
   of the checkpoint disturbs;
3. `finish`, before the trainer's next request and before it shuts down: join the thread, move the state into the
   committed checkpoint and mark it complete (the policy's last, after the critic's).

A checkpoint still marked pending after its command stopped (killed mid-write) has weights but no state: the
`optimize` stage of that iteration redoes the update from the state before it, which gives the same weights
(tasks/stages/optimize.py). With several ranks the state is written before answering, as the one-shot worker does:
DeepSpeed's save has collectives, which must not run beside the next request's.
No Prefect import: this runs in the resident trainer."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from storage import state_dir_for
from storage.crash import crash_point
from tasks.engines.workers.engine_cache import read_state_id, write_state_id
from tasks.engines.workers.training import save_optimizer_state


@dataclass
class _Job:
    engines: list[tuple[str, object, str]]  # (folder relative to the checkpoint, engine, its state id); policy last
    checkpoint_dir: str  # where the caller commits the update's folder
    crash_name: str
    thread: threading.Thread | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class DeferredState:
    """At most one update's optimizer state in flight."""

    def __init__(self) -> None:
        self._job: _Job | None = None

    def start(self, engines: list[tuple[str, object, str]], checkpoint_dir: str, crash_name: str = "") -> None:
        """Write each engine's DeepSpeed state in a thread; `finish` publishes it into `checkpoint_dir`. The engines
        must not change before `finish`. The staging folder is empty: the optimize stage clears what a killed command
        left there before it asks for the update."""
        self.finish()
        job = _Job(engines, checkpoint_dir, crash_name)
        staged = str(state_dir_for(Path(checkpoint_dir)))

        def write() -> None:
            t0 = time.time()
            background_priority()
            try:
                for rel, engine, _ in job.engines:
                    save_optimizer_state(engine, os.path.join(staged, rel, "ds_state"))
            except BaseException as exc:  # reported by finish, on the trainer's next request
                job.error = exc
            job.seconds = time.time() - t0

        job.thread = threading.Thread(target=write, name="optimizer-state-writer", daemon=True)
        job.thread.start()
        self._job = job

    def finish(self) -> tuple[float, float] | None:
        """Wait for the state in flight and publish it; (the seconds its writing took, the seconds waited for it here),
        or None when none was in flight. Raises what the writer raised. A checkpoint that was not committed (its update
        failed on the caller's side, or another update replaced it) gets nothing: its staged state is removed."""
        job, self._job = self._job, None
        if job is None:
            return None
        t0 = time.time()
        job.thread.join()
        waited = time.time() - t0
        staged = state_dir_for(Path(job.checkpoint_dir))
        if job.error is not None:
            shutil.rmtree(staged, ignore_errors=True)
            raise RuntimeError(
                f"writing the optimizer state of {job.checkpoint_dir} failed: {type(job.error).__name__}: {job.error}"
            ) from job.error
        crash_point(job.crash_name)  # the stage is complete and its checkpoint's state is not
        if all(read_state_id(os.path.join(job.checkpoint_dir, rel)) == sid for rel, _, sid in job.engines):
            for rel, _, sid in job.engines:
                folder = os.path.join(job.checkpoint_dir, rel)
                os.replace(os.path.join(staged, rel, "ds_state"), os.path.join(folder, "ds_state"))
                write_state_id(folder, state_id=sid)
        shutil.rmtree(staged, ignore_errors=True)
        return job.seconds, waited


def background_priority() -> None:
    """The lowest CPU priority for the calling thread (Linux gives each thread its own nice value): the writer takes
    what the sampler's weight sync and generation leave of the cores, instead of slowing them down."""
    if sys.platform == "linux":
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
