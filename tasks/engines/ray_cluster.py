"""The Ray instance the engines run on: a private local one by default, a cluster when `engines.ray_address` names one.

Embedded (no address): the command starts its own Ray head, bound to 127.0.0.1 only, without a dashboard, with an
object store capped to what engine messages need (stage data travels as Parquet on storage every node sees, never
through Ray), and its session files in a private temporary folder that is removed when the command ends (the reaper
removes it when the command is killed: tasks/engines/reaper.py). Starting it with `address="local"` means a stale
`/tmp/ray` session, or a RAY_ADDRESS in the environment, is never joined by mistake.

Ray starts its head processes with a parent-death signal bound to the *thread* that called `ray.init`, so the
instance is started from a thread of its own that lives as long as the process: it may then be started early, in the
background (`start_in_background`), while the command checks its input, and used from any thread.

Cluster (`engines.ray_address`: `auto` or `HOST:PORT`): the command joins as a driver and leaves the cluster as it
found it, its actors ended. The repository must be at the same path on every node (a shared filesystem, as for the
stage data), and is put on the actors' PYTHONPATH.
Imports: ray (0.6 s) is imported inside functions: the CLI imports this module at every start.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from schemas.errors import UserError
from tasks.engines.launch import engine_env
from tasks.engines.workers.data_parallel import DEFAULT_TIMEOUT_S

LOOPBACK = "127.0.0.1"
NAMESPACE = "rlpipe"
# The object store carries only requests, answers and small metrics: Ray's minimum (75 MiB) would do; a little more.
OBJECT_STORE_BYTES = 128 * 2**20
TEMP_PREFIX = "rlpipe-ray"  # the embedded instance's session folder: <tmp>/rlpipe-ray-<pid>
# Measured with Ray 2.60: with this variable every listener of a local instance, and of a cluster_utils.Cluster, is
# on 127.0.0.1; without it, Ray's agents listen on the machine's external interface.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

_STATE: dict = {"thread": None, "done": threading.Event(), "error": None, "address": None}


class RayStartError(UserError, RuntimeError):
    pass


def temp_dir_for(owner: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"{TEMP_PREFIX}-{owner}")


def meeting_file(address: str | None, what: str) -> Path:
    """A file a process group's members on this machine meet through: in the embedded instance's folder, or on a
    joined cluster in the temporary folder, named so that the reaper of a killed command removes it too."""
    folder = tempfile.gettempdir() if address else temp_dir_for(os.getpid())
    return Path(folder) / f"rlpipe-{what}-{os.getpid()}-{os.urandom(4).hex()}.store"


def pin_to_loopback() -> None:
    """Every listener of a Ray instance started from this process on 127.0.0.1: the variable is read when ray is
    imported (here, and in the processes the instance starts, which inherit it)."""
    os.environ.update(LOOPBACK_ENV)
    if "ray" in sys.modules:
        import ray._private.ray_constants

        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False


def own_auth_token() -> None:
    """The embedded instance's token authentication, on a token of its own in its session folder. Ray 2.60 turns token
    auth on for a new local instance and writes ~/.ray/auth_token; after that, on the same machine, the user's own
    `ray start --head` turned auth on and their second node, `ray status` and `--set engines.ray_address` were
    refused. Here RAY_AUTH_TOKEN_PATH points into the folder removed with the instance, so nothing of ~/.ray is read
    or written; the instance keeps authentication (another user of the machine cannot drive it over loopback). The
    variables are inherited by every process the instance starts."""
    import secrets

    folder = Path(temp_dir_for(os.getpid()))
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = folder / "auth_token"
    token.touch(mode=0o600)
    token.write_text(secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN", None)  # a token in the environment would win over the path
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    # Ray reads the variables into its config and caches the token once it is imported: read them again now (as
    # Ray's own tests do when they change them), for a process that imported Ray before starting the instance.
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _init(address: str | None) -> None:
    import logging

    if not address:
        pin_to_loopback()
        own_auth_token()
    import ray
    import ray._private.ray_constants

    # Ray's driver installs Abseil's failure-signal handler over the process's SIGTERM (read here, when the driver
    # connects): a SIGTERM after that printed a C stack and aborted, so the command's own stop (flows/cli.py::_stop)
    # never ran until a flow run put its handler back. The actors keep theirs: this is the driver's module state.
    ray._private.ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    common = dict(namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR, configure_logging=True)
    if address:  # the actors' workers import the actor class's module before its __init__ sets their environment
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": engine_env()["PYTHONPATH"]}}, **common)
        return
    ray.init(
        address="local",
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        # No idle workers started ahead: every actor imports its own engine, and on 2 cores two idle workers importing
        # Ray at the start only slow the engines' imports down.
        # Engines at the priority of the command's other processes: Ray's default niceness for workers (15) let
        # Prefect's API server and the command take the 2 cores from vLLM's start and the trainer's updates.
        _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False, "worker_niceness": 0},
        object_store_memory=OBJECT_STORE_BYTES,
        _node_ip_address=LOOPBACK,
        _temp_dir=temp_dir_for(os.getpid()),
        **common,
    )


def _owner(address: str | None) -> None:
    """The thread that starts Ray and then lives as long as the process (see the module docstring)."""
    try:
        _init(address)
    except Exception as exc:  # noqa: BLE001  (any failure to start or join is the user's one line)
        where = f"the Ray cluster at {address}" if address else "a local Ray instance"
        line = f"could not start or join {where}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        if address and (isinstance(exc, ConnectionError) or "auth" in str(exc).lower()):
            line += (
                " (a cluster with token authentication on needs RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN "
                "or RAY_AUTH_TOKEN_PATH: docs/operations.md, 'Scale out')"
            )
        _STATE["error"] = line
    _STATE["done"].set()
    threading.Event().wait()


def start_in_background(address: str | None) -> None:
    """Start (or join) Ray without waiting; `connect` waits for it. Idempotent: the first address wins."""
    if _STATE["thread"] is not None:
        return
    _STATE["address"] = address
    _STATE["thread"] = threading.Thread(target=_owner, args=(address,), name="ray-owner", daemon=True)
    _STATE["thread"].start()
    atexit.register(stop)


def connect(address: str | None) -> None:
    """Ray started or joined, ready for actors (raises RayStartError with one line if it could not be)."""
    start_in_background(address)
    _STATE["done"].wait()
    if _STATE["error"]:
        raise RayStartError(_STATE["error"])


def stop() -> None:
    """End this process's Ray: its actors, and the embedded instance with its session folder."""
    if not _STATE["done"].is_set() or _STATE["error"]:
        return
    import ray

    if ray.is_initialized():
        workers = [] if _STATE["address"] else _raylet_descendants()
        if not _STATE["address"]:
            _end_autoscaler_monitor()
        ray.shutdown()
        _wait_until_ended(workers)
    if not _STATE["address"]:
        shutil.rmtree(temp_dir_for(os.getpid()), ignore_errors=True)


def _raylet_descendants() -> list:
    """The processes the embedded instance's raylet started: its agents and every actor's worker."""
    import psutil

    raylets = [p for p in psutil.Process().children() if _ask(p, "name", "") == "raylet"]
    return [d for raylet in raylets for d in _ask(raylet, "children", [], recursive=True)]


def _ask(process, method: str, default, **kw):
    """process.method(**kw), or `default` for a process that has gone (or may not be read)."""
    import psutil

    try:
        return getattr(process, method)(**kw)
    except psutil.Error:
        return default


def _wait_until_ended(processes: list, timeout: float = 10.0) -> None:
    """The embedded instance's workers ended (or zombies, which their new parent reaps) before the command exits;
    one still running after `timeout` is killed. `ray.shutdown` ends the raylet, and the actors' workers under it
    notice and exit by themselves, a vLLM or DeepSpeed engine in about a second of teardown (measured): a command that
    exits first leaves them running, and on 2 cores they slow the next command down."""
    import psutil

    def running(process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.time() + timeout
    while (left := [p for p in processes if running(p)]) and time.time() < deadline:
        time.sleep(0.05)
    for process in left:
        try:
            process.kill()
        except psutil.Error:
            pass


def _end_autoscaler_monitor() -> None:
    """The embedded instance's autoscaler monitor, killed before `ray.shutdown`. That ends the GCS first and the monitor
    after it with SIGTERM, whose handler retries writing "the autoscaler failed" to the gone GCS until Ray kills it a
    second later (measured: 1.0 s of the 1.4 s `ray.shutdown` took, at the end of every command). SIGTERM before the
    GCS goes is no better: the handler's message reaches this driver, which prints it. The monitor of a private
    one-node instance keeps nothing; with it gone `ray.shutdown` takes 0.1-0.4 s."""
    import psutil

    monitors = [
        child
        for child in psutil.Process().children()
        if any(arg.endswith(os.path.join("autoscaler", "_private", "monitor.py")) for arg in _ask(child, "cmdline", []))
    ]
    for monitor in monitors:
        monitor.kill()
    psutil.wait_procs(monitors, timeout=1.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where an engine's actors go: the Ray cluster (None: the command's own local instance), the Ray resources each
    actor reserves (empty: none, so they share the machine with whatever else runs; {"GPU": 1} on a GPU cluster), the
    placement group's strategy over nodes, and the collective timeout of a group of ranks."""

    ray_address: str | None = None
    bundle: tuple[tuple[str, float], ...] = ()
    strategy: str = "PACK"
    collective_timeout_s: float = DEFAULT_TIMEOUT_S
    placement_timeout_s: float = 60.0
    # Engines that share one placement group (the vLLM replicas, so that SPREAD spreads them): its key, how many engines
    # share it, and which of them this is. Unshared ("") an engine has a group of its own, removed with it.
    share: str = ""
    replicas: int = 1
    index: int = 0

    @classmethod
    def from_config(cls, engines, bundle: dict[str, float]) -> "Placement":
        return cls(
            ray_address=engines.ray_address,
            bundle=tuple(sorted(bundle.items())),
            strategy=engines.placement_strategy,
            collective_timeout_s=engines.collective_timeout_s,
            placement_timeout_s=engines.placement_timeout_s,
        )


def why_unplaceable(bundle: dict[str, float], count: int, strategy: str, nodes: list[dict[str, float]]) -> str | None:
    """Why `count` bundles of `bundle` can never be placed with `strategy` on nodes with these resources (each node's,
    as `ray.nodes()` reports them: totals, or what is free), or None when they can. Ray itself keeps an unplaceable
    group pending without a word."""
    need = {k: v for k, v in bundle.items() if v > 0}
    if not need:
        return None

    def fits(node: dict[str, float]) -> int:  # how many bundles one node holds
        return min(int(node.get(k, 0.0) // v) for k, v in need.items())

    def have(k: str) -> str:
        return "/".join(f"{node.get(k, 0.0):g}" for node in nodes) or "none"

    wanted = bundle_text(need)
    lacking = [k for k, v in need.items() if not any(node.get(k, 0.0) >= v for node in nodes)]
    if lacking:
        return f"no node has {lacking[0]} {need[lacking[0]]:g} (the nodes have {lacking[0]} {have(lacking[0])})"
    held = [fits(node) for node in nodes]
    if strategy == "STRICT_PACK" and max(held) < count:
        return f"no node holds all {count} bundles of {wanted} together (at most {max(held)} on one)"
    if strategy == "STRICT_SPREAD" and sum(h > 0 for h in held) < count:
        return f"{count} bundles of {wanted} need {count} nodes that each hold one; {sum(h > 0 for h in held)} do"
    if sum(held) < count:
        per = ", ".join(f"{k} {have(k)}" for k in sorted(need))
        return f"{count} bundles of {wanted} need more than the nodes have: at most {sum(held)} fit ({per})"
    return None


def bundle_text(bundle: dict[str, float]) -> str:
    """A bundle as the one-line errors name it: {CPU 2, GPU 1}."""
    return "{" + ", ".join(f"{k} {v:g}" for k, v in sorted(bundle.items())) + "}"


def node_resources(free: bool = False) -> list[dict[str, float]]:
    """Each live node's resources (`free`: what is not reserved now), for why_unplaceable."""
    import ray

    if not free:
        return [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
    from ray._private.state import available_resources_per_node  # the one per-node view Ray has without a dashboard

    return [dict(r) for r in available_resources_per_node().values()]
