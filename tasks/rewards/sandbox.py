"""Run model-written Python in a sandbox: bubblewrap's namespaces plus resource limits, or the limits alone.

Two modes (reward.sandbox.mode; docs/operations.md, "Security", says what each guarantees):

- `bwrap` (the default): bubblewrap (the `bubblewrap` Debian package) starts the program in new user, mount, PID,
  network, IPC and UTS namespaces. It sees a read-only /usr and the Python it runs on, a size-limited tmpfs as its
  working folder and /tmp, and nothing else of the host: no /etc, no home folders, no host paths it could write or
  delete. Its network namespace has only its own loopback, so no socket reaches the host or beyond. It is PID 1's
  child in its own PID namespace: when it ends or is killed, the kernel kills every process it started.
- `rlimits`: the resource limits alone, on a process group of its own. No filesystem or network isolation, and a
  process that leaves the group outlives the run. rlpipe uses it only when the config names it.

In both modes a launcher (tasks/rewards/sandbox_launcher.py, copied beside the program) sets the limits inside,
before any of the program runs: address space (memory), CPU seconds, the size of any file written (stdout and stderr
are files: gigabytes of output end at the limit), open files, no core dumps, and the number of processes. The
wall-clock timeout kills it from outside.

With a test (assert statements), the program runs in a child process of the launcher and the test in the launcher,
which reads the program's results as plain data and gives the verdict as its exit status: nothing the program can
reach says that the test passed (the launcher's docstring says how). A program that exits before its tests (`exit(0)`)
fails, whatever its exit status.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from schemas.config import SandboxConfig
from schemas.errors import UserError


class SandboxError(UserError, RuntimeError):
    pass


@dataclass(frozen=True)
class Outcome:
    """One program run: `status` is passed, failed (an AssertionError, or wrong output), error (any other exception
    or exit status), timeout, or output_limit; `detail` is the last line of its stderr (or what ended it)."""

    status: str
    detail: str
    stdout: str
    seconds: float


LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")  # runs inside: `python -I -S launcher.py SRC`
TEST_FAILED = 1  # the launcher's exit status when the test raised AssertionError (0: passed; 2: any other error)
SRC = "/sandbox"  # where the program and its test are, read-only, inside a bwrap sandbox


NOBODY = 65534  # run as root, rlpipe runs the sandbox as this user: root is exempt from the process limit


@functools.lru_cache(maxsize=4)
def interpreter(python: str | None) -> tuple[str, str]:
    """The interpreter programs run on, and the prefix holding its standard library: reward.sandbox.python, or
    this Python outside any virtual environment (programs get the standard library, not rlpipe's packages). Run as
    root, the sandbox runs as `nobody`, which must be able to read it: a Python under /root (pyenv's) is swapped
    for the system's /usr/bin/python3."""
    if python is None:
        python = os.path.realpath(sys.executable)
        if os.geteuid() == 0 and not _readable_by_all(python) and os.path.exists("/usr/bin/python3"):
            python = "/usr/bin/python3"
    python = os.path.realpath(python)
    if not os.access(python, os.X_OK):
        raise SandboxError(f"reward.sandbox.python: {python} is not an executable")
    if os.geteuid() == 0 and not _readable_by_all(python):
        raise SandboxError(
            f"reward.sandbox.python: {python} is not readable by the user `nobody`, which runs the sandbox when "
            "rlpipe runs as root; name a Python outside /root"
        )
    prefix = subprocess.run(
        [python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    return python, os.path.realpath(prefix or os.path.dirname(os.path.dirname(python)))


def _readable_by_all(path: str) -> bool:
    """Every folder above `path` can be entered by any user, and the file read and run."""
    parents = Path(path).parents
    return all(os.stat(p).st_mode & 0o001 for p in parents) and os.stat(path).st_mode & 0o005 == 0o005


@functools.lru_cache(maxsize=4)
def _bwrap_mounts(prefix: str) -> tuple[str, ...]:
    """The host paths a program needs to run Python, read-only: /usr, the dynamic loader's cache, the interpreter's
    prefix; /bin, /lib and /lib64 as the host has them (links on a merged-/usr system)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    return tuple(args)


def _bwrap_command(settings: SandboxConfig, src: str, env: dict[str, str], prefix: str) -> list[str]:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxError(
            "reward.sandbox.mode=bwrap: bubblewrap is not installed (apt install bubblewrap); or set "
            "reward.sandbox.mode=rlimits to run model-written code with resource limits but no isolation"
        )
    scratch = str(settings.scratch_mb * 2**20)
    return [
        bwrap,
        *_bwrap_mounts(prefix),
        *("--ro-bind", src, SRC),
        *("--size", scratch, "--tmpfs", "/work", "--size", scratch, "--tmpfs", "/tmp"),
        *("--proc", "/proc", "--dev", "/dev", "--chdir", "/work"),
        *("--unshare-all", "--unshare-user", "--disable-userns", "--hostname", "sandbox"),
        *("--uid", str(NOBODY), "--gid", str(NOBODY)),
        *("--die-with-parent", "--new-session", "--clearenv"),
        *(arg for name, value in env.items() for arg in ("--setenv", name, value)),
    ]


def _limits(settings: SandboxConfig) -> str:
    """RLIMIT_AS, CPU, FSIZE, NOFILE, CORE and NPROC for the launcher. In a bwrap sandbox the process count is the
    sandbox's own (its user namespace's); in rlimits mode it counts all the processes of the user it runs as, so the
    limit is raised by those running now."""
    processes = settings.max_processes
    if settings.mode == "rlimits":
        processes += _processes_of(_user())
    cpu = int(settings.timeout_s) + 1
    return ",".join(str(v) for v in (settings.memory_mb * 2**20, cpu, settings.max_output_kb * 1024, 64, 0, processes))


def _user() -> int:
    return NOBODY if os.geteuid() == 0 else os.geteuid()


def _processes_of(uid: int) -> int:
    count = 0
    for entry in Path("/proc").iterdir():
        try:
            count += entry.name.isdigit() and entry.stat().st_uid == uid
        except OSError:  # a process that ended while we counted
            pass
    return count


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def run_python(
    program: str, *, test: str | None = None, stdin: str = "", settings: SandboxConfig, keep_chars: int = 1000
) -> Outcome:
    """Run `program` (then `test`, Python in the same namespace) under `settings`, with `stdin` as its input. Its
    stdout (the first keep_chars) and the last line of its stderr come back in the Outcome."""
    python, prefix = interpreter(settings.python)
    with tempfile.TemporaryDirectory(prefix="rlpipe-sandbox-") as tmp:
        src, work = Path(tmp, "src"), Path(tmp, "work")
        src.mkdir()
        work.mkdir()
        (src / "solution.py").write_text(program)
        shutil.copyfile(LAUNCHER, src / "launcher.py")
        if test is not None:
            (src / "test.py").write_text(test)
        # The sandbox's user (nobody, when rlpipe is root) reads the program and, in rlimits mode, writes in work:
        # and nothing else of the folder.
        os.chmod(tmp, 0o711)
        for path in (src, *src.iterdir()):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        os.chown(work, _user(), -1)
        env = {"RLPIPE_LIMITS": _limits(settings), "PATH": "/usr/bin:/bin", "HOME": "/work"}
        if settings.mode == "bwrap":
            command, where, cwd = _bwrap_command(settings, str(src), env, prefix), SRC, "/"
        else:
            command, where, cwd = [], str(src), str(work)
            env["HOME"] = str(work)
        command += [python, "-I", "-S", f"{where}/launcher.py", where]
        (Path(tmp) / "stdin").write_text(stdin)
        with (
            open(Path(tmp, "stdin"), "rb") as fin,
            open(Path(tmp, "out"), "wb") as fout,
            open(Path(tmp, "err"), "wb") as ferr,
        ):
            start = time.perf_counter()
            drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
            proc = subprocess.Popen(
                command, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, env=env, start_new_session=True, **drop
            )
            try:
                code, timed_out = proc.wait(timeout=settings.timeout_s), False
            except subprocess.TimeoutExpired:
                code, timed_out = None, True
            finally:  # also on an exception (the reward pool's own timeout): nothing is left running
                _kill_group(proc)
            seconds = time.perf_counter() - start
        stdout = _head(Path(tmp, "out"), keep_chars)
        stderr = _tail(Path(tmp, "err"), 64 * 1024)
    if timed_out:
        return Outcome("timeout", f"no exit after {settings.timeout_s:g}s", stdout, seconds)
    if code in (-25, 128 + 25) or "File too large" in stderr:  # SIGXFSZ, or EFBIG where the signal is ignored
        return Outcome("output_limit", f"wrote more than {settings.max_output_kb} KiB to a file", stdout, seconds)
    if code in (-24, 128 + 24, -9, 128 + 9):  # SIGXCPU, then SIGKILL past the hard CPU limit
        return Outcome("timeout", f"used more than {int(settings.timeout_s) + 1} CPU seconds", stdout, seconds)
    if code == 0:
        return Outcome("passed", "", stdout, seconds)
    detail = _last_line(stderr) or f"exit status {code}"
    failed = code == TEST_FAILED if test is not None else detail.startswith("AssertionError")
    return Outcome("failed" if failed else "error", detail, stdout, seconds)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group (in bwrap mode, bwrap: its PID namespace dies with it) and reap it."""
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _head(path: Path, chars: int) -> str:
    with open(path, "rb") as f:
        return f.read(chars * 4).decode("utf-8", "replace")[:chars]


def _tail(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - size))
        return f.read().decode("utf-8", "replace")


def check_sandbox(settings: SandboxConfig) -> None:
    """Run a one-line program in the configured sandbox: a machine where it cannot run (no bubblewrap, user
    namespaces turned off) fails here, with one line, before any engine starts."""
    outcome = run_python("print(6 * 7)", settings=settings)
    if outcome.status != "passed" or outcome.stdout.strip() != "42":
        raise SandboxError(
            f"reward.sandbox (mode {settings.mode}) cannot run a test program on this machine: "
            f"{outcome.status}: {outcome.detail or outcome.stdout[:200]}"
        )
