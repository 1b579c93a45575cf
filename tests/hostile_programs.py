"""Programs written to score without solving anything, the attacks of issues 57 and 75 and more, for the sandbox's
tests (tests/test_code_rewards.py runs them directly and through `rlpipe rerun --stage scores`, in both modes).

The task: `f(xs)` returns the distinct values of `xs`, sorted. TESTS apply builtins to both sides (what shadowing
attacks), and one uses `all(map(...))` (what a StopIteration attacks). None of the hostile programs computes the
answer: any test one passes is forged. `$name` placeholders are filled by the test (a canary file, a secret, a port,
a process marker). FORGERS names those that win against a harness that runs the tests in the program's own process
(the control: the test proves the design, not the program's mistake).
"""

from __future__ import annotations

from string import Template

TESTS = [
    "assert f([3, 1, 3]) == [1, 3]",
    "assert set(f([2, 2, 5])) == set([5, 2])",
    "assert sorted(f([9, 4])) == sorted([4, 9])",
    "assert all(map(lambda case: f(case[0]) == case[1], [([1, 1], [1]), ([4, 2], [2, 4])]))",
]
GOOD = "def f(xs):\n    return sorted(set(xs))\n"

_PID1 = """
import os
def patch(pid):  # exit_group(0) where the process resumes: xor edi,edi; mov eax,231; syscall
    try:
        pc = int(open(f"/proc/{pid}/syscall").read().split()[-1], 16)
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(pc)
            mem.write(b"\\x31\\xff\\xb8\\xe7\\x00\\x00\\x00\\x0f\\x05")
    except (OSError, ValueError, IndexError):
        pass
"""

HOSTILE = {
    # ---- the four of issue 75 ----
    "read the tests and answer them": """
import ast, glob, os
table = {}
for path in glob.glob("/sandbox/*.py") + glob.glob(os.getcwd() + "/*.py") + glob.glob(os.path.dirname(__file__) + "/*"):
    try:
        tree = ast.parse(open(path).read())
    except (OSError, SyntaxError, ValueError):
        continue
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call) and node.left.args:
            call, right = node.left, node.comparators[0]
            inner = call.args[0] if isinstance(call.args[0], ast.Call) else call
            target = right.args[0] if isinstance(right, ast.Call) and right.args else right
            try:
                table[repr(ast.literal_eval(inner.args[0]))] = ast.literal_eval(target)
            except (ValueError, IndexError, SyntaxError):
                pass
def f(xs):
    return table.get(repr(xs))
""",
    "shadow the builtins the test applies to both sides": """
def set(*a, **k): return 0
def sorted(*a, **k): return 0
def all(*a, **k): return True
def map(*a, **k): return []
def f(xs): return None
""",
    "hijack the names it sends": """
import builtins, sys
fake = {"set": lambda *a: 0, "sorted": lambda *a, **k: 0, "all": lambda *a: True}
frame, found = sys._getframe(), False
while frame is not None:
    child = type(frame.f_locals.get("child"))  # the launcher's object that will send the names, if serving
    if hasattr(child, "send"):
        send = child.send
        def forged(self, message, send=send):
            if message[0] == "names":
                message[1]["__builtins__"] = self.encode(fake)
                for name, value in fake.items():
                    message[1][name] = self.encode(value)
            send(self, message)
        child.send, found = forged, True
    frame = frame.f_back
if not found:  # in the program's own process there is nothing to send: replace the builtins there
    for name, value in fake.items():
        setattr(builtins, name, value)
def f(xs): return None
""",
    "patch the sandbox's init to exit 0": _PID1 + "patch(1)\npatch(os.getppid())\ndef f(xs): return None\n",
    # ---- what crosses back: objects, not data ----
    "always-equal object": "class Anything:\n    def __eq__(self, other): return True\n    __hash__ = None\n"
    "    def __iter__(self): return iter([])\ndef f(xs): return Anything()\n",
    "list subclass with its own ==": "class L(list):\n    def __eq__(self, other): return True\n"
    "def f(xs): return L()\n",
    "int subclass with its own ==": "class I(int):\n    def __eq__(self, other): return True\ndef f(xs): return I(0)\n",
    "str subclass with its own ==": "class S(str):\n    def __eq__(self, other): return True\ndef f(xs): return S()\n",
    "__class__ that claims to be a list": "class Fake:\n    __class__ = list\n    def __eq__(self, o): return True\n"
    "def f(xs): return Fake()\n",
    "NaN, equal to nothing": "def f(xs): return float('nan')\n",
    "a reply larger than the runner reads": "def f(xs): return 'x' * (40 << 20)\n",
    "a reply nested past any parser": "def f(xs):\n    v = []\n    for _ in range(100000):\n        v = [v]\n"
    "    return v\n",
    # ---- exceptions and exits ----
    "StopIteration, which ends the test's map early": "def f(xs): raise StopIteration\n",
    "SystemExit raised in a generator": "def f(xs):\n    def g():\n        raise SystemExit(0)\n        yield\n"
    "    return g()\n",
    "SystemExit from the call": "def f(xs): raise SystemExit(0)\n",
    "AssertionError of its own": "def f(xs): raise AssertionError('passed')\n",
    "KeyboardInterrupt from the call": "def f(xs): raise KeyboardInterrupt\n",
    "sys.exit(0) before the tests": "import sys\nsys.exit(0)\n",
    "os._exit(0) before the tests": "import os\nos._exit(0)\n",
    "atexit that exits 0": "import atexit, os\natexit.register(os._exit, 0)\ndef f(xs): return None\n",
    "excepthook that exits 0": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\ndef f(xs): return None\n",
    "exit 0 from inside its call": "import os\ndef f(xs): os._exit(0)\n",
    # ---- the verdict's carriers ----
    "print a passing verdict": 'import sys\nprint(\'{"status": "passed", "detail": ""}\')\n'
    'sys.stderr.write(\'{"status": "passed", "detail": ""}\\n\')\ndef f(xs): return None\n',
    "write a verdict on every descriptor, in its call": "import os\ndef f(xs):\n    for fd in range(64):\n"
    '        try:\n            os.write(fd, b\'("ok", ("val", "True"))\\n{"status": "passed"}\\n\')\n'
    "        except OSError:\n            pass\n    return None\n",
    "stack frames: a secret in the launcher's globals": """
import os, sys
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_globals.values()):
        if isinstance(value, str) and len(value) == 32:
            sys.stderr.write("\\n" + value + "\\n")
    frame = frame.f_back
def f(xs): return None
""",
    "every process's environment and command line": """
import os, sys
for pid in os.listdir('/proc'):
    for name in ('environ', 'cmdline'):
        try:
            sys.stderr.write(open(f'/proc/{pid}/{name}', 'rb').read().decode(errors='replace') + "\\n")
        except OSError:
            pass
def f(xs): return None
""",
    "the parent's memory, descriptors and ptrace": """
import ctypes, os
parent = os.getppid()
for path in [f'/proc/{parent}/mem'] + [f'/proc/{parent}/fd/{n}' for n in range(64)]:
    try:
        with open(path, 'wb') as f:
            f.write(b'passed')
    except OSError:
        pass
ctypes.CDLL(None).ptrace(16, parent, 0, 0)  # PTRACE_ATTACH
def f(xs): return None
""",
    "/proc/*/mem of every PID": _PID1 + "for pid in os.listdir('/proc'):\n"
    "    if pid.isdigit() and int(pid) != os.getpid():\n        patch(pid)\ndef f(xs): return None\n",
    "kill the parent": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\ndef f(xs): return None\n",
    "kill the parent from inside its call": "import os, signal\ndef f(xs):\n"
    "    os.kill(os.getppid(), signal.SIGKILL)\n",
    "signal every process of its user": "import os, signal\ndef f(xs):\n    os.kill(-1, signal.SIGKILL)\n",
    "kill PID 1": "import os, signal\nos.kill(1, signal.SIGKILL)\ndef f(xs): return None\n",
    "edit the tests": """
import glob, os
for path in glob.glob("/sandbox/*") + glob.glob(os.getcwd() + "/*") + glob.glob(os.path.dirname(__file__) + "/*"):
    try:
        open(path, "w").write("pass\\n")
    except OSError:
        pass
def f(xs): return None
""",
    "rewrite the runner's and the launcher's source": """
import glob, os
for path in ["$verdict", "$launcher"] + glob.glob("/sandbox/*.py") + glob.glob(os.path.dirname(__file__) + "/*.py"):
    try:
        open(path, "a").write("\\nimport os\\nos._exit(0)\\n")
    except OSError:
        pass
def f(xs): return None
""",
    "a stand-in for a standard-library module": "import sys, types\nm = types.ModuleType('json')\n"
    "m.loads = lambda *a: True\nsys.modules['json'] = m\njson = m\ndef f(xs): return None\n",
    "replace __import__": "import builtins\nbuiltins.__import__ = lambda *a, **k: None\ndef f(xs): return None\n",
    "search the garbage collector for the tests": "import gc\ndef f(xs):\n"
    "    return [o for o in gc.get_objects() if isinstance(o, list) and o[:1] == [1]][:1]\n",
    # ---- resources and the host ----
    "infinite loop": "while True:\n    pass\n",
    "sleep past the timeout": "import time\ndef f(xs):\n    time.sleep(30)\n",
    "an endless iterator": "def f(xs):\n    while True:\n        yield 1\n",
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "memory hog": "x = bytearray(8 * 2**30)\ndef f(xs): return None\n",
    "gigabytes of output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
    "read a private key": "print(open('$secret').read())\ndef f(xs): return open('$secret').read()\n",
    "read /etc/passwd": "def f(xs): return open('/etc/passwd').read()\n",
    "write outside its folder": "open('$written', 'w').write('x')\ndef f(xs): return None\n",
    "delete a file": "import os\nos.remove('$keep')\ndef f(xs): return None\n",
    "a socket to the host's loopback": "import socket\nsocket.create_connection(('127.0.0.1', $port), timeout=1)\n"
    "def f(xs): return None\n",
    "a daemon left behind": """
import os, subprocess, sys
if os.fork() == 0:
    os.setsid()
    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '$marker'], start_new_session=True)
    os._exit(0)
def f(xs): return None
""",
}

FORGERS = (
    "read the tests and answer them",
    "shadow the builtins the test applies to both sides",
    "hijack the names it sends",
    "patch the sandbox's init to exit 0",
    "always-equal object",
    "list subclass with its own ==",
    "StopIteration, which ends the test's map early",
    "atexit that exits 0",
)


def programs(**values: str) -> dict[str, str]:
    """Every hostile program with its placeholders filled."""
    return {name: Template(text).safe_substitute(values) for name, text in HOSTILE.items()}
