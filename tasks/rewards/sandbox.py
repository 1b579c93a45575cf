"""Run model-written Python in a sandbox: bubblewrap's namespaces plus resource limits, or the limits alone.

Two modes (reward.sandbox.mode; docs/operations.md, "Security", says what each guarantees):

- `bwrap` (the default): bubblewrap (the `bubblewrap` Debian package) starts the program in new user, mount, PID,
  network, IPC and UTS namespaces. It sees a read-only /usr and the Python it runs on, a size-limited tmpfs as its
  working folder and /tmp, and nothing else of the host: no /etc, no home folders, no host paths it could write or
  delete. Its network namespace has only its own loopback, so no socket reaches the host or beyond. It is PID 1's
  child in its own PID namespace: when it ends or is killed, the kernel kills every process it started.
- `rlimits`: the resource limits alone, as the user `nobody` when rlpipe is root (refused without root unless
  `allow_unisolated`). No filesystem or network isolation. A reaper (tasks/rewards/sandbox_reaper.py) is the child
  subreaper of the program's processes and kills every one of them, daemons included, when the run ends.

In both modes a launcher (tasks/rewards/sandbox_launcher.py, copied beside the program) sets the limits inside,
before any of the program runs: address space (memory), CPU seconds, the size of any file written (stdout and stderr
are files: gigabytes of output end at the limit), open files, no core dumps, and the number of processes. The
wall-clock timeout kills it from outside.

With a test (assert statements), the test never enters the sandbox: a runner outside it
(tasks/rewards/sandbox_verdict.py, whose docstring says how) runs the test against the program's names, which stand
for the program's objects, reads what they return as plain data, and sends its verdict to rlpipe on a pipe no
process in the sandbox holds. Nothing the program can reach says that the test passed: not its exit status, not
bwrap's. A program that exits before its tests (`exit(0)`) fails.
"""

from __future__ import annotations

import functools
import json
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


LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")  # runs inside: `python -I -S launcher.py SRC [RFD WFD]`
VERDICT = Path(__file__).with_name("sandbox_verdict.py")  # runs outside and holds the test
REAPER = Path(__file__).with_name("sandbox_reaper.py")  # rlimits: ends every process the program started
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


def check_isolation(settings: SandboxConfig) -> None:
    """rlimits mode without root runs the program as rlpipe's own user: refused unless the config accepts that."""
    if settings.mode == "rlimits" and os.geteuid() != 0 and not settings.allow_unisolated:
        raise SandboxError(
            "reward.sandbox.mode=rlimits without root runs model-written code as your own user, which can reach "
            "rlpipe's processes and files, the tests and the verdict included: use mode bwrap, run rlpipe as root, "
            "or set reward.sandbox.allow_unisolated=true to accept it"
        )


def run_python(
    program: str, *, test: str | None = None, stdin: str = "", settings: SandboxConfig, keep_chars: int = 1000
) -> Outcome:
    """Run `program` under `settings`, with `stdin` as its input; with `test` (Python that uses the program's
    names), the test runs outside the sandbox and gives the verdict. Its stdout (the first keep_chars) and the last
    line of its stderr come back in the Outcome."""
    python, prefix = interpreter(settings.python)
    check_isolation(settings)
    with tempfile.TemporaryDirectory(prefix="rlpipe-sandbox-") as tmp:
        tmp = Path(tmp)
        command, cwd, env = _sandbox_command(settings, tmp, program, python=python, prefix=prefix)
        (tmp / "stdin").write_text(stdin)
        with open(tmp / "stdin", "rb") as fin, open(tmp / "out", "wb") as fout, open(tmp / "err", "wb") as ferr:
            start = time.perf_counter()
            # As root, bwrap itself runs as nobody (root is exempt from the process limit); the reaper drops to
            # nobody only for the program, so that it stays out of the program's reach.
            drop = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
            drop = drop if os.geteuid() == 0 and settings.mode == "bwrap" else {}
            spawn = functools.partial(
                subprocess.Popen, stdin=fin, stdout=fout, stderr=ferr, cwd=cwd, env=env, start_new_session=True, **drop
            )
            if test is None:
                code, verdict = _run_alone(spawn, command, settings=settings), None
            else:
                code, verdict = _run_with_test(spawn, command, test=test, settings=settings)
            seconds = time.perf_counter() - start
        stdout = _head(tmp / "out", keep_chars)
        stderr = _tail(tmp / "err", 64 * 1024)
    return _outcome(code, verdict, stdout=stdout, stderr=stderr, seconds=seconds, settings=settings)


def _sandbox_command(
    settings: SandboxConfig, tmp: Path, program: str, *, python: str, prefix: str
) -> tuple[list[str], str, dict]:
    """The program and the launcher in tmp/src (no test: it never enters the sandbox), a working folder in
    tmp/work, and the command that runs the launcher: through bwrap, or through the reaper (rlimits)."""
    src, work = tmp / "src", tmp / "work"
    src.mkdir()
    work.mkdir()
    (src / "solution.py").write_text(program)
    shutil.copyfile(LAUNCHER, src / "launcher.py")
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
        command, where, cwd = [sys.executable, "-I", "-S", str(REAPER), str(_user())], str(src), str(work)
        env["HOME"] = str(work)
    return [*command, python, "-I", "-S", f"{where}/launcher.py", where], cwd, env


def _run_alone(spawn, command: list[str], *, settings: SandboxConfig) -> int | None:
    """The program as __main__: its exit status, or None past the timeout."""
    proc = spawn(command)
    try:
        return proc.wait(timeout=settings.timeout_s)
    except subprocess.TimeoutExpired:
        return None
    finally:  # also on an exception (the reward pool's own timeout): nothing is left running
        _stop(proc, reaper=settings.mode == "rlimits")


def _run_with_test(spawn, command: list[str], *, test: str, settings: SandboxConfig) -> tuple[int | None, dict | None]:
    """The program in the sandbox, serving; the test in the runner outside it, joined by two pipes. The runner's
    verdict (None past the timeout), and the program's exit status if it had ended by then (a limit that killed it
    names the outcome better than the runner's "exited")."""
    to_program, from_runner = os.pipe()
    to_runner, from_program = os.pipe()
    held, proc, runner = [to_program, from_runner, to_runner, from_program], None, None
    try:
        proc = spawn([*command, str(to_program), str(from_program)], pass_fds=(to_program, from_program))
        runner = subprocess.Popen(
            [sys.executable, "-I", "-S", str(VERDICT), str(to_runner), str(from_runner)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            pass_fds=(to_runner, from_runner), start_new_session=True,
        )  # fmt: skip
        while held:  # the two processes hold them now: the runner sees the program's end as the pipe's
            os.close(held.pop())
        try:
            out, _ = runner.communicate(test, timeout=settings.timeout_s)
        except subprocess.TimeoutExpired:
            return None, None
        try:
            verdict = json.loads(out.strip().splitlines()[-1])
        except (IndexError, ValueError):  # the runner died (the test's own fault, or the host's memory)
            detail = f"the test runner gave no verdict (exit status {runner.returncode})"
            verdict = {"status": "error", "detail": detail}
        if verdict["status"] == "error":  # give a program killed by a limit the moment to be reported
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        return proc.poll(), verdict
    finally:
        for fd in held:  # a start that failed
            os.close(fd)
        if runner is not None:
            _stop(runner, reaper=False)
        if proc is not None:
            _stop(proc, reaper=settings.mode == "rlimits")


def _outcome(
    code: int | None, verdict: dict | None, *, stdout: str, stderr: str, seconds: float, settings: SandboxConfig
) -> Outcome:
    if code is None and verdict is None:
        return Outcome("timeout", f"no exit after {settings.timeout_s:g}s", stdout, seconds)
    if code in (-25, 128 + 25) or "File too large" in stderr:  # SIGXFSZ, or EFBIG where the signal is ignored
        return Outcome("output_limit", f"wrote more than {settings.max_output_kb} KiB to a file", stdout, seconds)
    if code in (-24, 128 + 24, -9, 128 + 9):  # SIGXCPU, then SIGKILL past the hard CPU limit
        return Outcome("timeout", f"used more than {int(settings.timeout_s) + 1} CPU seconds", stdout, seconds)
    if verdict is not None:
        return Outcome(str(verdict["status"]), str(verdict["detail"]), stdout, seconds)
    if code == 0:
        return Outcome("passed", "", stdout, seconds)
    detail = _last_line(stderr) or f"exit status {code}"
    return Outcome("failed" if detail.startswith("AssertionError") else "error", detail, stdout, seconds)


def _stop(proc: subprocess.Popen, *, reaper: bool) -> None:
    """End a started process and all it started, and reap it. bwrap: SIGKILL its process group (its PID namespace
    dies with it). The reaper: SIGTERM, on which it kills every process below it, then the group as a fallback."""
    if reaper and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
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
