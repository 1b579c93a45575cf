"""Engines as Ray actors: a worker module kept alive across requests, one actor per rank, placed by Ray.

A server module (tasks/engines/workers/: vLLM, the trainer) defines `make_answer(settings) -> answer(msg) -> dict`
and, optionally, `warm()` (its imports); a one-shot worker module defines `handle(request) -> dict`. `EngineActor`
(tasks/engines/workers/engine_actor.py) hosts either: created, it imports (~10 s for vLLM); started, it builds the
engine from the typed settings; then it answers typed requests (schemas/requests.py) until it is ended. Stage data
never travels through Ray: requests name Parquet files and checkpoints on storage every node sees, and answers are
small dicts.

An engine of several ranks (data-parallel DeepSpeed) is one actor per rank, placed by one placement group
(`Placement`: the Ray resources each rank reserves, and the strategy, e.g. SPREAD over nodes); the ranks make their
torch.distributed group themselves, at rank 0's node address (gloo on CPU, NCCL on GPU), with a timeout the config
sets. Every request goes to every rank, and rank 0's answer is kept: no relay between ranks. A rank that dies (its
process, its node) or fails ends the whole group with one line naming the rank, its node and the cause; the next
request starts a new group. Where the ranks go and what each starts with (its placement group, its environment, where
the ranks meet) is tasks/engines/placing.py's.

Correctness never depends on an actor's memory: every request names the checkpoint it starts from, and a server reuses
what it holds only when that is provably the same state (see each server's docstring).
Imports: ray (0.6 s) is imported inside functions: the CLI imports this module at every start.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from schemas.requests import to_wire
from tasks.engines import placing, ray_cluster
from tasks.engines.launch import PROGRESS_PREFIX, LogTail, WorkerError, engine_env, last_error_line, rank_log
from tasks.engines.ray_cluster import Placement
from tasks.engines.workers.engine_actor import EngineActor

POLL_S = 0.5  # how often a waiting client checks the ranks (and echoes their progress lines)
START_DEADLINE_S = 600  # an engine that has not started by then is reported as failed
HUNG_GRACE_S = 5.0  # after one rank fails, how long the others get to answer before they are named as hung
NODE_DEATH_S = 30.0  # after a rank died, how long to look for a node of the group that Ray marks dead


_ACTOR_CLASS: list = []


def _actor_class():
    import ray

    if not _ACTOR_CLASS:
        _ACTOR_CLASS.append(ray.remote(max_restarts=0, max_task_retries=0)(EngineActor))  # a rank that died is not
        # silently restarted without its peers: it is reported
    return _ACTOR_CLASS[0]


class ResidentProcess:
    """A resident engine: `ranks` actors of `module`; `env` and `devices` (CUDA ids, on one node) go to all of them."""

    def __init__(
        self,
        module: str,
        log: Path,
        *,
        ranks: int = 1,
        devices: list[int] | None = None,
        env: dict | None = None,
        placement: Placement = Placement(),
    ):
        self.module, self.log, self.ranks, self.devices = module, Path(log), ranks, devices
        self.env, self.placement = env or {}, placement
        self.name = module.rsplit(".", 1)[-1]
        self.actors: list = []
        self.group = None  # the placement group
        self.placed = None  # (its group, the group's ready() ref, its bundles) until Ray has placed it
        self.starting = None  # the start's ObjectRefs, until the first request waits for them
        self.released = False
        self.nodes: list[dict] = []
        self.rendezvous: Path | None = None  # the ranks' meeting file, removed with them
        self.noted = 0.0  # when the last "starting" progress line was shown
        # One start at a time: with one-step off-policy training two stages (iteration k's rollouts and k + 1's,
        # generated ahead in a thread) can ask a held engine for its first request at once; both releasing it started
        # every actor twice (the second start closed the log the first was writing).
        self.starting_lock = threading.Lock()

    @property
    def running(self) -> bool:
        return bool(self.actors)

    @property
    def waiting_for_release(self) -> bool:
        return bool(self.actors) and not self.released

    def spawn(self, settings, held: bool = False) -> None:
        """Create the actors without waiting for them. `held`: they only import their libraries (vLLM's alone is
        ~10 s), writing to unnamed files of their own, then wait for their settings; a second `spawn` (or the first
        request) hands them over, and only then do they open their log and start the engine. A command spawns them
        held before it checks its input, so those seconds overlap the checks; on bad input `kill` ends them, and no
        engine ever started, no log or file was written."""
        with self.starting_lock:
            self._spawn(settings, held)

    def _spawn(self, settings, held: bool) -> None:
        if self.actors:
            if self.waiting_for_release and not held:
                self._release(settings)
            return
        ray_cluster.connect(self.placement.ray_address)
        _register_exit()
        actor = _actor_class()
        options, self.group, self.placed = placing.actor_options(self.name, self.ranks, self.placement)
        env = {**engine_env(), **self.env, **placing.thread_env(self.ranks), **placing.temp_env(self.placement)}
        if self.devices:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.devices))
        self.actors = [actor.options(**options(r)).remote(self.module, env) for r in range(self.ranks)]
        self.released, self.spawned = False, time.time()
        if not held:
            self._release(settings)

    def _release(self, settings) -> None:
        """Hand the actors their settings, their log and their rank variables (at rank 0's node address)."""
        self.nodes = self._wait(
            [a.where.remote() for a in self.actors], "failed to start", deadline=time.time() + START_DEADLINE_S
        )
        wire = to_wire(settings) if settings is not None else None
        meet, self.rendezvous = placing.meeting_place(self.name, self.ranks, self.nodes, self.placement)
        self.starting = [
            actor.start.remote(
                wire,
                str(rank_log(self.log, r)),
                {**placing.rank_env(r, self.ranks, self.nodes, self.devices, self.placement), **meet},
            )
            for r, actor in enumerate(self.actors)
        ]
        self.released, self.spawned = True, time.time()  # the start's deadline and progress count from here

    def call(self, request, settings=None, label: str = "", extra: dict | None = None) -> dict:
        """Send one typed request (schemas.requests) to every rank, starting the engine first if needed, with
        `settings` (a typed start-up request, or None), and `extra` beside it in the message (what is not data: Ray
        actor handles); rank 0's answer."""
        self.start(settings)
        msg = {"request": to_wire(request), "label": label, **(extra or {})}
        answers = self._wait([a.call.remote(msg) for a in self.actors], "died", deadline=None)
        failed = [r for r, a in enumerate(answers) if "error" in a]
        if failed:
            if self.ranks > 1:  # the ranks may be in different places: the group ends, the next call restarts it
                raise self._ended("failed", answers[failed[0]]["error"], rank=failed[0])
            raise WorkerError(f"{self.name} failed: {answers[0]['error']} [log: {self.log}]")
        return answers[0]

    def start(self, settings=None) -> None:
        """The engine started with `settings` (a typed start-up request, or None) if it is not running, and waited
        for."""
        with self.starting_lock:
            self._spawn(settings, held=False)
            if self.starting is not None:
                errors = self._wait(self.starting, "failed to start", deadline=self.spawned + START_DEADLINE_S)
                self.starting = None
                if any(errors):
                    raise self._ended("failed to start", next(e for e in errors if e), rank=_first(errors))
                if time.time() - self.spawned >= 10:
                    self._progress(f"{self.name} started in {time.time() - self.spawned:.0f}s")

    def _wait(self, refs: list, what: str, deadline: float | None) -> list:
        """Every rank's result, echoing rank 0's progress lines meanwhile. A rank whose actor died (its process, its
        node) or that errs ends the group with one line; ranks still silent HUNG_GRACE_S after a peer failed are
        named as hung (a collective waiting for them times out by itself)."""
        import ray

        results: list = [None] * len(refs)
        pending = {ref: r for r, ref in enumerate(refs)}
        tail = LogTail(rank_log(self.log, 0))
        while pending:
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                r = pending.pop(ref)
                try:
                    results[r] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise self._died(what, r, _actor_death(exc), pending) from None
                except ray.exceptions.RayError as exc:
                    raise self._ended(what, str(exc).strip().splitlines()[-1], rank=r) from None
                if _is_error(results[r]) and self.ranks > 1 and pending:
                    self._name_hung(pending, results, r)
            tail.echo()
            if not pending:
                break
            if deadline is not None and time.time() > deadline:
                raise self._ended(what, f"not started within {START_DEADLINE_S}s", rank=min(pending.values()))
            if deadline is not None:
                self._check_placed()
            if deadline is not None and time.time() - self.spawned >= 10:
                self._note_starting()
        return results

    def _check_placed(self) -> None:
        """While the actors wait for their placement group: once Ray has placed it, nothing more; past
        engines.placement_timeout_s, the engine ended with one line (placing.not_placed)."""
        import ray

        if self.placed is None:
            return
        if ray.wait([self.placed[1]], timeout=0)[0]:
            self.placed = None
            return
        if time.time() - self.spawned < self.placement.placement_timeout_s:
            return
        error = placing.not_placed(self.name, self.placed, self.placement)  # before the kill frees what the group holds
        self.kill()
        raise error

    def _died(self, what: str, rank: int, cause: str, pending: dict) -> WorkerError:
        """Rank `rank`'s actor died. Its peers, in a collective with it, may die or fail a moment later, and the first
        to be reported is not always the cause: with ranks on several nodes, a rank whose node is gone is named (Ray
        marks a node dead after its health checks fail, seconds after its raylet)."""
        import ray

        nodes = [n["node_id"] for n in self.nodes]
        deadline = time.time() + (NODE_DEATH_S if len(set(nodes)) > 1 and cause != "its node died" else 0)
        while True:
            dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
            lost = [r for r, node in enumerate(nodes) if node in dead]
            if lost:
                return self._ended(what, "its node died", rank=lost[0])
            if time.time() >= deadline:
                return self._ended(what, cause, rank=rank)
            if pending:
                ray.wait(list(pending), num_returns=len(pending), timeout=POLL_S)
            else:
                time.sleep(POLL_S)

    def _name_hung(self, pending: dict, results: list, failed: int) -> None:
        import ray

        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=HUNG_GRACE_S)
        hung = sorted(r for ref, r in pending.items() if ref not in done)
        error = results[failed] if isinstance(results[failed], str) else results[failed]["error"]
        if hung:
            where = ", ".join(f"rank {r} on node {self.node(r)}" for r in hung)
            raise self._ended("failed", f"{error}; {where} did not answer (hung)", rank=failed)

    def node(self, r: int) -> str:
        """Rank r's node, as the error lines name it."""
        n = self.nodes[r] if r < len(self.nodes) else None
        return f"{n['ip']} ({n['node_id'][:12]})" if n else "unknown"

    def _note_starting(self) -> None:
        now = time.time()
        if now - self.noted >= 10:
            self.noted = now
            self._progress(f"starting {self.name}: {now - self.spawned:.0f}s so far [log: {self.log}]")

    def _ended(self, what: str, cause: str, rank: int) -> WorkerError:
        """The group after one of its ranks died or failed: every actor ended, one line naming the rank and its node."""
        actor = f"actor {self.actors[rank]._actor_id.hex()[:12]}" if rank < len(self.actors) else "actor"
        which = f" ({f'rank {rank} of {self.ranks}, ' if self.ranks > 1 else ''}{actor} on node {self.node(rank)})"
        if "not answer" not in cause and cause.endswith("died"):
            cause = f"{cause}; its log: {last_error_line(rank_log(self.log, rank))}"
        self.kill()
        return WorkerError(f"{self.name} {what}{which}: {cause} [log: {rank_log(self.log, rank)}]")

    def _progress(self, text: str) -> None:
        """A progress line in the terminal (not in the log, whose own progress lines the client echoes)."""
        sys.stderr.write(f"{PROGRESS_PREFIX} {text}\n")
        sys.stderr.flush()

    def close(self) -> None:
        error = self.request_shutdown()
        self.kill()
        if error:
            raise WorkerError(error)

    def request_shutdown(self) -> str | None:
        """Let every started rank finish what it still writes (the trainer's deferred state); the server's error
        line, if that failed. An engine never started (held, or its start failed) has nothing to finish."""
        import ray

        if not self.actors or not self.released:
            return None
        try:
            errors = ray.get([a.finish.remote() for a in self.actors], timeout=600)
        except ray.exceptions.RayError:
            return None
        error = next((e for e in errors if e), None)
        return f"{self.name} failed at its shutdown: {error} [log: {self.log}]" if error else None

    def kill(self) -> None:
        """End every actor (their processes exit without the interpreter's teardown) and the placement group."""
        import ray

        if self.actors and self.released:  # a started engine exits by itself at once (ray.kill alone would run the
            # interpreter's teardown first); a held one is still importing, and has nothing to tear down
            ray.wait([a.end.remote() for a in self.actors], num_returns=len(self.actors), timeout=5)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except ray.exceptions.RayError:
                pass
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        if self.rendezvous is not None:
            self.rendezvous.unlink(missing_ok=True)
        self.actors, self.group, self.starting, self.released, self.rendezvous = [], None, None, False, None
        self.placed = None


def _is_error(result) -> bool:
    return isinstance(result, str) or (isinstance(result, dict) and "error" in result)


def _first(errors: list) -> int:
    return next(r for r, e in enumerate(errors) if e)


def _actor_death(exc) -> str:
    """One line for an actor that died: its node lost, or its process killed."""
    text = str(exc)
    if "node" in text.lower() and ("died" in text.lower() or "dead" in text.lower()):
        return "its node died"
    return "its process died"


def run_worker(
    module: str,
    request,
    log: Path,
    *,
    ranks: int = 1,
    devices: list[int] | None = None,
    placement: Placement = Placement(),
) -> dict:
    """One request answered by a one-shot engine of `ranks` actors (a worker module's `handle`), ended after it:
    rank 0's answer, or WorkerError with one line. Its `progress:` lines are shown in the terminal as they come."""
    engine = ResidentProcess(module, log, ranks=ranks, devices=devices, placement=placement)
    try:
        return engine.call(request)
    finally:
        engine.kill()


_PROCESSES: dict[tuple[str, str], ResidentProcess] = {}
_EXIT = {"registered": False}


def _register_exit() -> None:
    """At exit, the engines finish what they still write while Ray is up, then Ray stops: registered after Ray's own
    exit handler, so that it runs before it (atexit is last in, first out)."""
    if not _EXIT["registered"]:
        _EXIT["registered"] = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    try:
        close_all()
    finally:
        ray_cluster.stop()


def resident(module: str, key: str, make: Callable[[], ResidentProcess]) -> ResidentProcess:
    """This process's engine of `module` for `key` (a run id): one per Prefect worker process, made on first use."""
    if (module, key) not in _PROCESSES:
        _PROCESSES[(module, key)] = make()
    return _PROCESSES[(module, key)]


def close_all() -> None:
    """End every engine, all asked first and then ended, so that their shutdowns overlap."""
    servers = list(_PROCESSES.values())
    _PROCESSES.clear()
    errors = [error for server in servers if (error := server.request_shutdown())]
    for server in servers:
        server.kill()
    if placing.SHARED_GROUPS:
        import ray

        for group in placing.SHARED_GROUPS.values():
            ray.util.remove_placement_group(group)
        placing.SHARED_GROUPS.clear()
    if errors:
        raise WorkerError(errors[0])


def close_held() -> None:
    """End the engines spawned held and never released (the command's input failed its checks)."""
    for key, proc in list(_PROCESSES.items()):
        if proc.waiting_for_release:
            _PROCESSES.pop(key).kill()
