"""The rlimits mode's supervisor: `python -I -S sandbox_reaper.py UID COMMAND...`. Standard library only; runs as
rlpipe's user, outside the sandbox.

rlimits mode has no PID namespace, so the kernel does not end a program's processes with it: a daemon (fork,
setsid, fork) leaves the process group the old design killed and outlived the sample. This process makes itself the
child subreaper of everything it starts (PR_SET_CHILD_SUBREAPER: an orphan below it is re-parented to it, not to
init), runs COMMAND as the user UID (dropping root when rlpipe is root), and when COMMAND ends, or when rlpipe sends
SIGTERM, SIGKILLs its children until none is left: every process the program started, daemons included, is its
descendant. It exits with COMMAND's status (128 + the signal, for a signal).

Run as root, it is out of the program's reach (another user's, and non-dumpable). Run as the program's own user
(`allow_unisolated`), the program can kill it first, and what it started then outlives it: that is part of what
the mode does not protect (docs/operations.md, "Security").
"""

import ctypes
import os
import signal
import sys

PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 4, 36


def children() -> list[int]:
    me, found = str(os.getpid()), []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:  # not a process, or one that ended meanwhile
            continue
        if stat.rsplit(")", 1)[-1].split()[1] == me:  # the field after the state: the parent's PID
            found.append(int(entry))
    return found


def kill_all() -> None:
    """SIGKILL every child and reap it, and again: a killed process's own children are re-parented here, so the
    loop ends when the tree is empty (the process limit bounds how many a fork loop adds meanwhile)."""
    for _ in range(10_000):
        pids = children()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def status(code: int) -> int:
    return 128 + os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def main() -> None:
    uid, command = int(sys.argv[1]), sys.argv[2:]
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0 or libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl failed")
    signal.signal(signal.SIGTERM, lambda *_: (kill_all(), os._exit(128 + signal.SIGTERM)))
    pid = os.fork()
    if pid == 0:
        if uid != os.geteuid():
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        os.execv(command[0], command)
    while True:  # reap orphans as they end, until COMMAND does
        ended, code = os.waitpid(-1, 0)
        if ended == pid:
            break
    kill_all()
    os._exit(status(code))


if __name__ == "__main__":
    main()
