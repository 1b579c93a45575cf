"""The launcher that runs inside the sandbox (tasks/rewards/sandbox.py): `python -I -S launcher.py SRC [RFD WFD]`.
Standard library only: it runs on the sandbox's Python, without rlpipe's packages.

It sets the resource limits, then runs the program as `__main__`. With RFD and WFD (assert-style tests) it then
answers the test runner's requests on those two pipes: the runner (tasks/rewards/sandbox_verdict.py) runs outside
the sandbox and holds the tests, which never enter it.

Nothing in this file is trusted. The program runs in this process before a single request is answered, and can
replace any of it (an attacker found the object below on its stack and rewrote what it sends). What leaves this
process is data: lines the runner parses with `ast.literal_eval`, never runs, and checks as it reads them. The worst
a program can do here is answer a request wrongly, which is the same as failing its test.
"""

import ast
import os
import resource
import runpy
import sys
import types

PLAIN = (type(None), bool, int, float, complex, str, bytes)


def set_limits() -> None:
    limits = [int(x) for x in os.environ.pop("RLPIPE_LIMITS").split(",")]
    names = ("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_NPROC")
    for name, value in zip(names, limits):
        resource.setrlimit(getattr(resource, name), (value, value))


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
    """The program's side of the link: its names, then one answer per request, each a line of Python literals."""

    def __init__(self, rfd: int, wfd: int):
        self.rfile, self.wfile = os.fdopen(rfd, "rb"), os.fdopen(wfd, "wb")
        self.objects: list = []

    def encode(self, value):
        if is_plain(value):
            return ("val", repr(value))
        if type(value) is float:  # nan and the infinities, which repr cannot give literal_eval
            return ("float", repr(value))
        if type(value) is types.ModuleType:  # the runner uses its own copy of a standard-library module
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
        simple = {"iter": iter, "next": next, "len": len, "bool": bool, "str": str, "repr": repr}
        if op in simple:
            return simple[op](obj)
        if op == "getattr":
            return getattr(obj, args[0])
        if op == "getitem":
            return obj[self.decode(args[0])]
        if op == "contains":
            return self.decode(args[0]) in obj
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


def serve(src: str, rfd: int, wfd: int) -> None:
    child = Child(rfd, wfd)
    try:
        namespace = runpy.run_path(f"{src}/solution.py", run_name="__main__")
    except SystemExit:
        os._exit(0)  # the program ended itself before the tests: the runner sees the link close
    except BaseException as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        child.send(("failed", f"{type(exc).__name__}: {exc}".strip().rstrip(":")))
        os._exit(1)
    sys.stdout.flush()
    child.serve(namespace)
    os._exit(0)


def main() -> None:
    src, link = sys.argv[1], [int(fd) for fd in sys.argv[2:4]]
    set_limits()
    sys.argv = ["solution.py"]
    if link:
        serve(src, *link)
    runpy.run_path(f"{src}/solution.py", run_name="__main__")


if __name__ == "__main__":
    main()
