"""The sandbox (tasks/rewards/sandbox.py) against hostile programs, and the code_tests reward built on it."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import duckdb
import polars as pl
import pytest

from schemas.config import ConfigError, RewardConfig, SandboxConfig, build_config
from schemas.errors import UserError
from tasks.rewards.loader import preflight
from tasks.rewards.program_tests import extract_program, outputs_match, parse_tests
from tasks.rewards.sandbox import SandboxError, check_sandbox, run_python
from tasks.rewards.scoring import score_frame

# CI installs bubblewrap (the Makefile's setup); elsewhere a machine without it skips the isolation tests.
needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and not os.environ.get("CI"), reason="bubblewrap is not installed"
)
FAST = SandboxConfig(timeout_s=1.0)


def _processes_with(marker: str) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(entry.name)
        except OSError:
            pass
    return found


@needs_bwrap
def test_a_program_passes_fails_and_cannot_skip_its_tests():
    assert run_python("def f(x): return x + 1", test="assert f(1) == 2", settings=FAST).status == "passed"
    failed = run_python("def f(x): return x", test="assert f(1) == 2", settings=FAST)
    assert (failed.status, failed.detail) == ("failed", "AssertionError")
    missing = run_python("def g(x): return x", test="assert f(1) == 2", settings=FAST)
    assert (missing.status, missing.detail) == ("error", "NameError: name 'f' is not defined")
    for early in ("import sys; sys.exit(0)", "import os; os._exit(0)", "raise SystemExit"):
        out = run_python(early, test="assert False", settings=FAST)  # exit status 0, but the tests never ran
        assert (out.status, out.detail) == ("error", "exited before the tests ran"), early
    echo = run_python("print(int(input()) * 2)", stdin="21\n", settings=FAST)
    assert (echo.status, echo.stdout) == ("passed", "42\n")


@needs_bwrap
def test_hostile_programs_are_contained_and_recorded(tmp_path):
    secret = tmp_path / "ssh" / "id_rsa"
    secret.parent.mkdir()
    secret.write_text("PRIVATE KEY")
    keep = tmp_path / "keep.txt"
    keep.write_text("still here")
    written = tmp_path / "written.txt"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    hostile = {
        "infinite loop": ("while True:\n    pass", "timeout"),
        "sleep past the timeout": ("import time\ntime.sleep(30)", "timeout"),
        "fork bomb": ("import os\nwhile True:\n    os.fork()", "error"),
        "memory hog": ("x = bytearray(8 * 2**30)", "error"),
        "gigabytes of output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "output_limit"),
        "/etc/passwd": ("print(open('/etc/passwd').read())", "error"),
        "~/.ssh": (f"print(open({str(secret)!r}).read())", "error"),
        "home folder": ("import os\nprint(os.listdir(os.path.expanduser('~root')))", "error"),
        "write outside": (f"open({str(written)!r}, 'w').write('x')", "error"),
        "delete a file": (f"import os\nos.remove({str(keep)!r})", "error"),
        "delete a tree": (f"import shutil\nshutil.rmtree({str(tmp_path)!r})", "error"),
        "socket to 127.0.0.1": (f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)", "error"),
    }
    for name, (program, status) in hostile.items():
        start = time.perf_counter()
        out = run_python(program, settings=FAST)
        assert out.status == status, (name, out)
        assert time.perf_counter() - start < FAST.timeout_s + 2, name
        assert "PRIVATE KEY" not in out.stdout and "root:" not in out.stdout, name
    bomb = run_python("import os\nwhile True:\n    os.fork()", settings=FAST)
    assert bomb.detail.startswith("BlockingIOError"), bomb  # the process limit stopped it, not the clock
    assert run_python("x = bytearray(8 * 2**30)", settings=FAST).detail == "MemoryError"
    assert len(run_python("print('x' * 10**7)", settings=FAST).stdout) == 1000  # what comes back is capped too
    assert keep.read_text() == "still here" and secret.read_text() == "PRIVATE KEY" and not written.exists()
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing reached the host's loopback
    listener.close()


@needs_bwrap
@pytest.mark.parametrize("how", ["child", "daemon"])
def test_no_process_outlives_its_run(how):
    marker = f"rlpipe-orphan-{uuid.uuid4().hex}"
    spawn = (
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}], start_new_session=True)"
    )
    program = {
        "child": f"import subprocess, sys\n{spawn}",
        # double fork: the grandchild is re-parented, out of the program's process group and session
        "daemon": "import os, subprocess, sys, time\n"
        f"if os.fork() == 0:\n    os.setsid()\n    {spawn}\n    os._exit(0)\ntime.sleep(0.3)",
    }[how]
    out = run_python(program, settings=FAST)
    assert out.status == "passed", out
    time.sleep(0.2)
    assert _processes_with(marker) == []


def test_rlimits_mode_keeps_the_limits_without_the_isolation():
    weak = SandboxConfig(mode="rlimits", timeout_s=1.0)
    assert run_python("def f(): return 1", test="assert f() == 1", settings=weak).status == "passed"
    assert run_python("x = bytearray(8 * 2**30)", settings=weak).detail == "MemoryError"
    assert run_python("while True:\n    pass", settings=weak).status == "timeout"
    out = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", settings=weak)
    assert out.status == "output_limit"


def test_without_bubblewrap_the_sandbox_refuses_with_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match=r"bubblewrap is not installed \(apt install bubblewrap\); or set"):
        check_sandbox(SandboxConfig())
    check_sandbox(SandboxConfig(mode="rlimits"))  # the weaker mode only where the config names it


@pytest.mark.parametrize(
    ("response", "program"),
    [
        ("```python\ndef f():\n    return 1\n```", "def f():\n    return 1\n"),
        ("a\n```\nx = 1\n```\nthen\n```py\nx = 2\n```\n```text\nout\n```", "x = 2\n"),
        ("```bash\nls\n```", "ls\n"),
        ("def f(): return 1", "def f(): return 1"),
        ("```python\ndef f():\n    return 1", "def f():\n    return 1"),  # cut at max_tokens: to the end
    ],
)
def test_extract_program(response, program):
    assert extract_program(response) == program


def test_parse_tests_takes_the_forms_code_datasets_use():
    asserts = [{"code": "assert f(1) == 2"}]
    assert parse_tests(["assert f(1) == 2"]) == asserts
    assert parse_tests(json.dumps(["assert f(1) == 2"])) == asserts
    assert parse_tests("def check(f):\n    assert f(1) == 2\ncheck(f)") == [
        {"code": "def check(f):\n    assert f(1) == 2\ncheck(f)"}
    ]
    pairs = [{"input": "1 2\n", "output": "3\n"}, {"input": "a\nb", "output": "ab"}]
    assert parse_tests({"inputs": ["1 2\n", ["a", "b"]], "outputs": ["3\n", "ab"]}) == pairs
    assert parse_tests(json.dumps({"inputs": ["1 2\n", ["a", "b"]], "outputs": ["3\n", "ab"]})) == pairs
    assert parse_tests([{"input": "1 2\n", "output": 3}]) == [{"input": "1 2\n", "output": "3"}]
    for bad, needle in [
        ([], "non-empty list"),
        ({"inputs": [1], "outputs": []}, "equal-length"),
        ({"fn_name": "f", "inputs": [], "outputs": []}, "call-based"),
        ([{"input": "1"}], "a test is a str"),
    ]:
        with pytest.raises(ValueError, match=needle):
            parse_tests(bad)
    assert outputs_match("3  \n\n", "3") and outputs_match("a\nb\n", "a\nb") and not outputs_match("3\n4", "3")


def _frame(responses: list[str], tests: list) -> tuple[pl.DataFrame, pl.DataFrame]:
    n = len(responses)
    rollouts = pl.DataFrame(
        {
            "iteration": [1] * n,
            "round": [0] * n,
            "prompt_id": [f"p{i}" for i in range(n)],
            "sample_idx": [0] * n,
            "text": responses,
            "finish_reason": ["stop"] * n,
            "length": [10] * n,
        }
    )
    prompts = pl.DataFrame(
        {
            "prompt_id": [f"p{i}" for i in range(n)],
            "text": ["write it"] * n,
            "answer": [None] * n,
            "extra": [{"tests": json.dumps(t)} for t in tests],
        }
    )
    return rollouts, prompts


@needs_bwrap
def test_code_tests_scores_the_fraction_passed_and_keeps_each_result_for_sql():
    add = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return a * b\n```"
    io = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    stuck = "```python\nwhile True:\n    pass\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5"]
    pairs = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7"]}
    rollouts, prompts = _frame([add, half, io, stuck, "no code here"], [asserts, asserts, pairs, pairs, asserts])
    reward = RewardConfig(functions={"code_tests": {}}, workers=2, sandbox={"timeout_s": 1.0})
    scores = score_frame(rollouts, prompts, reward, max_tokens=64)
    assert scores["score_code_tests"].to_list() == [1.0, 1 / 3, 1.0, 0.0, 0.0]
    assert scores["error_code_tests"].null_count() == 5  # a failing program is a score, not an error
    info = [json.loads(x) for x in scores["info_code_tests"]]
    assert [t["status"] for t in info[1]["tests"]] == ["failed", "passed", "failed"]
    assert [t["stdout"] for t in info[2]["tests"]] == ["3\n", "7\n"]
    assert [t["status"] for t in info[3]["tests"]] == ["timeout", "skipped"]  # stuck once: the rest are skipped
    assert info[4]["program"] == "no code here" and info[4]["tests"][0]["detail"].startswith("SyntaxError")
    got = duckdb.sql(
        "SELECT prompt_id, json_extract_string(info_code_tests, '$.tests[0].status') AS first FROM scores "
        "ORDER BY prompt_id"
    ).fetchall()
    assert [first for _, first in got] == ["passed", "failed", "passed", "timeout", "error"]
    bad = _frame([add], [[]])
    assert score_frame(*bad, reward, max_tokens=64)["error_code_tests"][0] == (
        "ValueError: column 'tests': tests must be a non-empty list, not list '[]'"
    )


def test_code_tests_config_and_preflight_errors_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"reward.timeout_s \(2\) must exceed reward.sandbox.timeout_s \(2\)"):
        build_config({"reward": {"functions": {"code_tests": {}}, "timeout_s": 2}, "eval": {"judge": "reward"}})
    with pytest.raises(ConfigError, match="reward.sandbox.mode"):
        build_config({"reward": {"sandbox": {"mode": "docker"}}})
    reward = RewardConfig(functions={"code_tests": {"kwargs": {"column": "test_list"}}})
    with pytest.raises(UserError, match="the dataset has no column 'test_list'"):
        preflight(reward, {"tests"})
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="bubblewrap is not installed"):
        preflight(reward, {"test_list"})


@needs_bwrap
def test_the_documented_example_scores_its_tasks_through_its_config(tmp_path):
    """examples/code_tests as the docs show it: its data builder's three tasks, its config's reward section through
    the run's preflight (the dataset's columns, the sandbox) and the scoring path, with a right and a wrong program
    for each task's first held-out prompt."""
    from examples.code_tests.make_data import build
    from schemas.config import load_config
    from tests.conftest import ROOT

    build(tmp_path, n_train=4, n_eval=4)
    cfg = load_config(ROOT / "examples" / "code_tests" / "config.yaml")
    reward = cfg.reward.model_copy(update={"workers": 0})
    right = {
        "functions": "```python\ndef {name}(x):\n    return {expr}\n```",
        "programs": "```python\nx = int(input())\nprint({expr})\n```",
    }
    for task in ("functions", "programs"):
        row = pl.read_parquet(tmp_path / task / "eval.parquet").row(0, named=True)
        preflight(reward, set(row))
        statement = row["prompt"][-1]["content"]
        name = statement.split("`")[1].split("(")[0] if task == "functions" else None
        expr = _expression(statement)
        program = right[task].format(name=name, expr=expr)
        rollouts, prompts = _frame([program, program.replace(expr, "0")], [json.loads(row["tests"])] * 2)
        scores = score_frame(rollouts, prompts, reward, max_tokens=96)["score_code_tests"].to_list()
        assert scores[0] == 1.0 and scores[1] < 1.0, (task, statement, scores)


def _expression(statement: str) -> str:
    """The Python for an INT_OPS statement ("returns x times 7." / "prints n plus 3."), with the variable as x."""
    from examples.code_tests.make_data import INT_OPS

    body = statement.rsplit("returns ", 1)[-1].rsplit("prints ", 1)[-1].rstrip(".")
    variable = statement.split("reads an integer ")[1].split()[0] if "reads an integer" in statement else "x"
    python = {
        "{x} plus {k}": "x + {k}",
        "{x} minus {k}": "x - {k}",
        "{x} times {k}": "x * {k}",
        "the remainder of {x} divided by {k}": "x % {k}",
        "{x} integer-divided by {k}": "x // {k}",
        "the larger of {x} and {k}": "max(x, {k})",
        "the smaller of {x} and {k}": "min(x, {k})",
        "{x} squared plus {k}": "x * x + {k}",
    }
    for template, _ in INT_OPS:
        pattern = re.escape(template).replace(r"\{x\}", re.escape(variable)).replace(r"\{k\}", r"(\d+)")
        match = re.fullmatch(pattern, body)
        if match:
            return python[template].format(k=match[1])
    raise AssertionError(f"no INT_OPS statement matches {body!r}")


# Programs that try to pass a test without passing it (issue 57 item 1). Each defines nothing the test needs, then
# attacks whatever could carry the verdict, then exits 0.
FORGERS = {
    # Walk up the stack to the launcher's globals and write any secret found there, as a passing launcher would.
    "stack frames": """
import os, sys
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_globals.values()):
        if isinstance(value, str) and len(value) == 32:
            sys.stderr.write("\\n" + value + "\\n"); sys.stderr.flush()
    frame = frame.f_back
os._exit(0)
""",
    "environment and command lines": """
import os, sys
for pid in os.listdir('/proc'):
    for name in ('environ', 'cmdline'):
        try:
            for word in open(f'/proc/{pid}/{name}', 'rb').read().replace(b'=', b'\\0').split(b'\\0'):
                if len(word) == 32:
                    sys.stderr.write("\\n" + word.decode() + "\\n")
        except OSError:
            pass
sys.stderr.flush()
os._exit(0)
""",
    "the launcher's memory, descriptors and ptrace": """
import ctypes, os
parent = os.getppid()
for path in [f'/proc/{parent}/mem'] + [f'/proc/{parent}/fd/{n}' for n in range(3, 16)]:
    try:
        with open(path, 'wb') as f:
            f.write(b'passed')
    except OSError:
        pass
ctypes.CDLL(None).ptrace(16, parent, 0, 0)  # PTRACE_ATTACH
os._exit(0)
""",
    "killing the launcher": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos._exit(0)",
    # An object whose == is always True: the test never sees the program's ==.
    "always equal": "class Anything:\n    def __eq__(self, other):\n        return True\n\n"
    "def f(x):\n    return Anything()",
}


@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_a_program_cannot_forge_a_pass(mode):
    if mode == "bwrap" and shutil.which("bwrap") is None and not os.environ.get("CI"):
        pytest.skip("bubblewrap is not installed")
    settings = SandboxConfig(mode=mode, timeout_s=2.0)
    for name, program in FORGERS.items():
        out = run_python(program, test="assert f(1) == 2", settings=settings)
        assert out.status != "passed", (mode, name, out)
    always = run_python(FORGERS["always equal"], test="assert f(1) == 2", settings=settings)
    assert always.detail == "TypeError: a Anything object of the program's cannot be compared: return plain data"


def test_tests_see_the_programs_values_objects_and_exceptions():
    """The test runs apart from the program: plain values come back exactly (a tuple stays a tuple), objects can be
    called, iterated and indexed, and the program's exceptions reach the test by type."""
    program = """
import math
class Counter:
    def __init__(self, start):
        self.n = start
    def bump(self, by=1):
        self.n += by
        return self.n
def pair(x):
    return (x, [x, {x: {x}}])
def gen(n):
    yield from range(n)
def fail(x):
    raise ValueError(f"bad {x}")
def weird():
    return float('nan')
LIMIT = 10
"""
    test = """
assert pair(2) == (2, [2, {2: {2}}]) and type(pair(2)) is tuple
c = Counter(5)
assert c.bump() == 6 and c.bump(by=4) == 10 and c.n == 10
assert list(gen(3)) == [0, 1, 2] and sum(x for x in gen(4)) == 6
assert LIMIT == 10 and math.isnan(weird())
try:
    fail(3)
    raise AssertionError("no exception")
except ValueError as exc:
    assert str(exc) == "bad 3"
"""
    weak = SandboxConfig(mode="rlimits", timeout_s=5.0)
    out = run_python(program, test=test, settings=weak)
    assert out.status == "passed", out
    wrong = run_python(program, test="assert pair(2) == [2, [2, {2: {2}}]]", settings=weak)  # a list is not a tuple
    assert (wrong.status, wrong.detail) == ("failed", "AssertionError")


def test_a_programs_stand_in_for_a_module_cannot_judge_its_results():
    fake = "class M:\n    @staticmethod\n    def isclose(*a, **k):\n        return True\n"
    fake += "math = M()\ndef f(x):\n    return 0.0"
    out = run_python(fake, test="assert math.isclose(f(1), 2.0)", settings=SandboxConfig(mode="rlimits"))
    assert (out.status, out.detail) == ("failed", "AssertionError")
    real = "import math\ndef f(x):\n    return 2.0"
    out = run_python(real, test="assert math.isclose(f(1), 2.0)", settings=SandboxConfig(mode="rlimits"))
    assert out.status == "passed", out
