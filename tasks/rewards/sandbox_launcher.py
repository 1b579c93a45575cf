"""The launcher that runs inside the sandbox (tasks/rewards/sandbox.py): `python -I -S launcher.py SRC`. Standard
library only: it runs on the sandbox's Python, without rlpipe's packages.

It sets the resource limits, then:
- without a test (stdin/stdout cases): runs the program as `__main__`; its exit status is the verdict's;
- with a test (assert statements): the verdict must not be the program's to give. A program runs arbitrary code in
  its process before any test could, so nothing in that process can be trusted to say the test ran: an earlier
  version wrote a secret token after the test, and a six-line program walked its stack to the launcher's globals and
  wrote the token itself. So the launcher forks: the child runs the program and answers requests; the launcher runs
  the test, with each of the program's names standing for the child's object. A call sends its arguments and gets
  back plain data (numbers, strings, bytes, None and lists, tuples, sets and dicts of them), read with
  `ast.literal_eval`, never executed; anything else comes back as a reference to the child's object, which can be
  called, indexed, iterated and asked for attributes, but not compared (its `==` would be the program's own). The
  launcher made itself non-dumpable before the fork, so the child cannot read or write its memory or its file
  descriptors (/proc/PID/mem, /proc/PID/fd, ptrace), and the verdict is the launcher's exit status, which the child
  cannot set: 0 passed, 1 an AssertionError, 2 any other error. The child can only kill it, which fails the test.
"""

import ast
import builtins
import importlib
import os
import resource
import runpy
import signal
import sys
import types

PASSED, FAILED, ERROR = 0, 1, 2
PLAIN = (type(None), bool, int, float, complex, str, bytes)
MAX_MESSAGE = 16 << 20  # a reply larger than this is an error, not a read that fills the memory limit


def set_limits() -> None:
    limits = [int(x) for x in os.environ.pop("RLPIPE_LIMITS").split(",")]
    names = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_NPROC")
    for name, value in zip(names, limits):
        resource.setrlimit(getattr(resource, name), (value, value))


def not_dumpable() -> None:
    """PR_SET_DUMPABLE 0: the process's /proc files become root's and ptrace needs CAP_SYS_PTRACE, which nothing in
    the sandbox has. Without it the test's verdict would be reachable: refuse to run the test at all."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


# ---- the program's side (the child) ----


def is_plain(value, depth: int = 0) -> bool:
    if depth > 50:
        return False
    kind = type(value)
    if kind in PLAIN:
        return kind is not float or value == value and value not in (float("inf"), float("-inf"))
    if kind in (list, tuple, set, frozenset):
        return all(is_plain(v, depth + 1) for v in value)
    if kind is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return False


class Child:
    def __init__(self, rfd: int, wfd: int):
        self.rfile, self.wfile = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")
        self.objects: list = []

    def encode(self, value):
        if is_plain(value):
            return ("val", repr(value))
        if type(value) is float:  # nan and the infinities, which repr cannot give literal_eval
            return ("float", repr(value))
        if type(value) is types.ModuleType:  # the test imports its own copy (a module's functions judge results)
            return ("module", value.__name__)
        self.objects.append(value)
        return ("ref", len(self.objects) - 1, type(value).__name__)

    def decode(self, arg):
        kind, payload = arg
        if kind == "float":
            return float(payload)
        return self.objects[payload] if kind == "ref" else ast.literal_eval(payload)

    def answer(self, op: str, ref: int, args: tuple):
        obj = self.objects[ref] if ref >= 0 else None
        if op == "call":
            positional, named = args
            return obj(*[self.decode(a) for a in positional], **{k: self.decode(v) for k, v in named.items()})
        if op == "getattr":
            return getattr(obj, args[0])
        if op == "iter":
            return iter(obj)
        if op == "next":
            return next(obj)
        if op == "getitem":
            return obj[self.decode(args[0])]
        if op == "len":
            return len(obj)
        if op == "contains":
            return self.decode(args[0]) in obj
        if op == "bool":
            return bool(obj)
        if op == "str":
            return str(obj)
        if op == "repr":
            return repr(obj)
        raise ValueError(f"unknown request {op!r}")

    def serve(self, namespace: dict) -> None:
        names = {k: self.encode(v) for k, v in namespace.items() if not (k.startswith("__") and k.endswith("__"))}
        self.send(("names", names))
        for line in self.rfile:
            op, ref, args = ast.literal_eval(line.decode())
            try:
                self.send(("ok", self.encode(self.answer(op, ref, args))))
            except StopIteration:
                self.send(("stop",))
            except BaseException as exc:  # noqa: BLE001  (the program's exception: the test may expect it)
                self.send(("exc", type(exc).__name__, str(exc)[:500]))

    def send(self, message) -> None:
        self.wfile.write(repr(message).encode() + b"\n")
        self.wfile.flush()


def run_child(src: str, rfd: int, wfd: int) -> None:
    child = Child(rfd, wfd)
    sys.argv = ["solution.py"]
    try:
        namespace = runpy.run_path(f"{src}/solution.py", run_name="__main__")
    except SystemExit:
        os._exit(0)  # the program ended itself before the tests: the launcher sees its replies end
    except BaseException as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        child.send(("failed", f"{type(exc).__name__}: {exc}".strip().rstrip(":")))
        os._exit(1)
    sys.stdout.flush()
    child.serve(namespace)
    os._exit(0)


# ---- the test's side (the launcher) ----


class Exited(Exception):
    pass


class Link:
    def __init__(self, rfd: int, wfd: int):
        self.rfile, self.wfile = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")

    def receive(self):
        line = self.rfile.readline(MAX_MESSAGE + 1)
        if not line:
            raise Exited("exited before the tests ran")
        if len(line) > MAX_MESSAGE:
            raise ValueError("the program's reply is larger than the sandbox reads")
        return ast.literal_eval(line.decode())

    def ask(self, op: str, ref: int, *args):
        self.wfile.write(repr((op, ref, args)).encode() + b"\n")
        self.wfile.flush()
        reply = self.receive()
        if reply[0] == "stop":
            raise StopIteration
        if reply[0] == "exc":
            raise program_exception(reply[1], reply[2])
        return self.value(reply[1])

    def value(self, encoded):
        kind = encoded[0]
        if kind == "val":
            return ast.literal_eval(encoded[1])
        if kind == "float":
            return float(encoded[1])  # float('nan'), 'inf', '-inf': a string, never evaluated
        if kind == "module":
            return importlib.import_module(str(encoded[1]))
        return Remote(self, int(encoded[1]), str(encoded[2]))


def program_exception(name: str, message: str) -> BaseException:
    """The program's exception as the test sees it: a built-in exception type by its name (a test may expect a
    ValueError), any other as a RuntimeError naming it."""
    kind = getattr(builtins, str(name), None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not AssertionError:
        return kind(message)
    return RuntimeError(f"{name}: {message}")


class Remote:
    """An object of the program's, in the child: calls, attributes, items and iteration go there; equality is refused,
    because the program's own `==` could say anything."""

    def __init__(self, link: Link, ref: int, kind: str):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_kind", kind)

    def _arg(self, value):
        if isinstance(value, Remote):
            return ("ref", value._ref)
        if type(value) is float and value != value or value in (float("inf"), float("-inf")):
            return ("float", repr(value))
        return ("val", repr(value))

    def __call__(self, *args, **kwargs):
        named = {k: self._arg(v) for k, v in kwargs.items()}
        return self._link.ask("call", self._ref, tuple(self._arg(a) for a in args), named)

    def __getattr__(self, name):
        return self._link.ask("getattr", self._ref, name)

    def __iter__(self):
        iterator = self._link.ask("iter", self._ref)
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


def run_test(src: str) -> int:
    not_dumpable()
    to_child, from_test = os.pipe()
    to_test, from_child = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(from_test)
        os.close(to_test)
        run_child(src, to_child, from_child)
    os.close(to_child)
    os.close(from_child)
    link = Link(to_test, from_test)
    try:
        first = link.receive()
        if first[0] == "failed":
            raise Exited(str(first[1]))
        namespace = {"__builtins__": builtins, "__name__": "__test__"}
        namespace.update({str(k): link.value(v) for k, v in first[1].items()})
        for name, value in list(namespace.items()):
            # A test may use a module the program imported (MBPP's math.isclose): a name of the standard library's
            # is always the real module, so that a program's stand-in cannot judge its own results.
            if isinstance(value, Remote) and name in sys.stdlib_module_names:
                namespace[name] = importlib.import_module(name)
        with open(f"{src}/test.py") as f:
            exec(compile(f.read(), "test.py", "exec"), namespace)
        verdict, line = PASSED, ""
    except AssertionError as exc:
        verdict, line = FAILED, f"AssertionError: {exc}".rstrip(": ")
    except Exited as exc:
        verdict, line = ERROR, str(exc)
    except BaseException as exc:  # noqa: BLE001  (the test's error, or the program's exception the test did not expect)
        verdict, line = ERROR, f"{type(exc).__name__}: {exc}".rstrip(": ")
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    sys.stdout.flush()
    if line:
        sys.stderr.write("\n" + line + "\n")
    sys.stderr.flush()
    return verdict


def main() -> None:
    src = sys.argv[1]
    set_limits()
    if not os.path.exists(f"{src}/test.py"):
        sys.argv = ["solution.py"]
        runpy.run_path(f"{src}/solution.py", run_name="__main__")
        return
    os._exit(run_test(src))


if __name__ == "__main__":
    main()
