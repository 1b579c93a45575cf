"""The test runner: `python -I -S sandbox_verdict.py RFD WFD`, the test on stdin, the verdict one JSON line on stdout.
Standard library only. It runs outside the sandbox, as rlpipe's user (tasks/rewards/sandbox.py starts it beside
the sandbox and joins the two with a pair of pipes), and it alone holds the tests: they never enter the sandbox.

The program's names stand for its objects in the sandbox (tasks/rewards/sandbox_launcher.py). A call sends its
arguments and gets back plain data (numbers, strings, bytes, None and lists, tuples, sets and dicts of them), read
with `ast.literal_eval`, never executed; anything else comes back as a reference to the program's object, which can
be called, indexed, iterated and asked for attributes, but not compared (its `==` would be the program's own).

What the program cannot do, and why (docs/operations.md, "Security", has the threat model):
- read the tests: they reach this process on a pipe from rlpipe; the sandbox has no copy and no view of this process;
- reach this process: it is outside the sandbox's PID namespace (bwrap), or another user's (rlimits as root), and
  non-dumpable (its memory, descriptors and ptrace need CAP_SYS_PTRACE);
- shadow what the test uses: a name of the program's enters the test only if it is an identifier that is neither a
  builtin nor a dunder; a standard-library module name is always this process's own import;
- raise what the test would misread: its StopIteration (which ends a `map` early, `all([])` being True) and its
  AssertionError reach the test as RuntimeError;
- set the verdict: it is this process's line on a pipe only rlpipe holds, not any process's exit status.
"""

import ast
import builtins
import importlib
import json
import keyword
import os
import sys

MAX_MESSAGE = 16 << 20  # a reply larger than this is an error, not a read that fills the memory
# The program's exceptions the test must not see as themselves (see the docstring).
MISREAD = {"StopIteration", "StopAsyncIteration", "AssertionError"}


class Exited(Exception):
    pass


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: this process's /proc files become root's and ptrace needs CAP_SYS_PTRACE. Without it the
    verdict would be in reach of a program of the same user: refuse to run the test at all."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


class Link:
    def __init__(self, rfd: int, wfd: int):
        self.rfile, self.wfile = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")

    def receive(self):
        line = self.rfile.readline(MAX_MESSAGE + 1)
        if not line:
            raise Exited("exited before the tests ran")
        if len(line) > MAX_MESSAGE:
            raise ValueError("the program's reply is larger than the sandbox reads")
        message = ast.literal_eval(line.decode())
        if not isinstance(message, tuple) or not message:
            raise ValueError("the program's reply is not a request's answer")
        return message

    def ask(self, op: str, ref: int, *args):
        self.wfile.write(repr((op, ref, args)).encode() + b"\n")
        self.wfile.flush()
        reply = self.receive()
        if reply[0] == "stop":
            if op != "next":
                raise RuntimeError("the program raised StopIteration")
            raise StopIteration
        if reply[0] == "exc":
            raise program_exception(str(reply[1]), str(reply[2]))
        if reply[0] != "ok":
            raise ValueError("the program's reply is not a request's answer")
        return self.value(reply[1])

    def value(self, encoded):
        kind = encoded[0]
        if kind == "val":
            return ast.literal_eval(str(encoded[1]))
        if kind == "float":
            return float(str(encoded[1]))  # float('nan'), 'inf', '-inf': a string, never evaluated
        if kind == "ref":
            return Remote(self, int(encoded[1]), str(encoded[2]))
        raise ValueError(f"the program sent a value of kind {str(kind)[:20]!r}")


def program_exception(name: str, message: str) -> BaseException:
    """The program's exception as the test sees it: a built-in exception type by its name (a test may expect a
    ValueError), any other, and those in MISREAD, as a RuntimeError naming it."""
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and name not in MISREAD:
        return kind(message)
    return RuntimeError(f"{name}: {message}")


class Remote:
    """An object of the program's, in the sandbox: calls, attributes, items and iteration go there; equality is
    refused, because the program's own `==` could say anything."""

    def __init__(self, link: Link, ref: int, kind: str):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_kind", kind)

    def _arg(self, value):
        if isinstance(value, Remote):
            return ("ref", value._ref)
        if type(value) is float and (value != value or value in (float("inf"), float("-inf"))):
            return ("float", repr(value))
        return ("val", repr(value))

    def __call__(self, *args, **kwargs):
        named = {k: self._arg(v) for k, v in kwargs.items()}
        return self._link.ask("call", self._ref, tuple(self._arg(a) for a in args), named)

    def __getattr__(self, name):
        return self._link.ask("getattr", self._ref, name)

    def __iter__(self):
        iterator = self._link.ask("iter", self._ref)
        if not isinstance(iterator, Remote):
            raise TypeError("the program's iterator is not an object")
        while True:
            try:
                yield iterator._link.ask("next", iterator._ref)
            except StopIteration:
                return

    def __getitem__(self, key):
        return self._link.ask("getitem", self._ref, self._arg(key))

    def __len__(self):
        return int(self._link.ask("len", self._ref))

    def __contains__(self, item):
        return bool(self._link.ask("contains", self._ref, self._arg(item)))

    def __bool__(self):
        return bool(self._link.ask("bool", self._ref))

    def __str__(self):
        return str(self._link.ask("str", self._ref))

    def __repr__(self):
        return str(self._link.ask("repr", self._ref))

    def __eq__(self, other):
        raise TypeError(f"a {self._kind} object of the program's cannot be compared: return plain data")

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__

    def __hash__(self):
        return hash((self._kind, self._ref))


def admitted(name: str) -> bool:
    """A program's name the test may see: an identifier that shadows no builtin (`set`, `sorted`, `AssertionError`)
    and no dunder (`__builtins__`, `__import__`)."""
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("__")
        and not hasattr(builtins, name)
    )


def names_for_test(link: Link) -> dict:
    first = link.receive()
    if first[0] == "failed":
        raise Exited(str(first[1]))
    if first[0] != "names" or not isinstance(first[1], dict):
        raise ValueError("the program's first message is not its names")
    namespace = {"__builtins__": builtins, "__name__": "__test__"}
    for name, encoded in first[1].items():
        if not admitted(name):
            continue
        if name in sys.stdlib_module_names:  # a test may use a module the program imported (MBPP's math.isclose)
            namespace[name] = importlib.import_module(name)
        elif encoded[0] != "module":  # any other module of the program's is not the test's to use
            namespace[name] = link.value(encoded)
    return namespace


def run_test(test: str, link: Link) -> tuple[str, str]:
    try:
        namespace = names_for_test(link)
        exec(compile(test, "test.py", "exec"), namespace)
        return "passed", ""
    except AssertionError as exc:
        return "failed", f"AssertionError: {exc}".rstrip(": ")
    except Exited as exc:
        return "error", str(exc)
    except BaseException as exc:  # noqa: BLE001  (the test's error, or the program's exception the test did not expect)
        return "error", f"{type(exc).__name__}: {exc}".rstrip(": ")[:300]


def main() -> None:
    not_dumpable()
    verdict = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the test prints goes to stderr: stdout carries the verdict alone
    test = sys.stdin.read()
    status, detail = run_test(test, Link(int(sys.argv[1]), int(sys.argv[2])))
    verdict.write(json.dumps({"status": status, "detail": detail}) + "\n")
    verdict.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
