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
import yaml

from schemas.config import ConfigError, RewardConfig, SandboxConfig, build_config
from schemas.errors import UserError
from tasks.rewards.loader import preflight
from tasks.rewards.program_tests import extract_program, outputs_match, parse_tests, score_program
from tasks.rewards.sandbox import LAUNCHER, VERDICT, SandboxError, check_isolation, check_sandbox, run_python
from tasks.rewards.scoring import score_frame
from tests.hostile_programs import FORGERS, GOOD, TESTS, programs

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
@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
@pytest.mark.parametrize("how", ["child", "daemon"])
def test_no_process_outlives_its_run(how, mode):
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
    out = run_python(program, settings=SandboxConfig(mode=mode, timeout_s=1.0))
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


def _inprocess_score(program: str, settings: SandboxConfig) -> float:
    """The control: each test run in the program's own process (the program, then the test, one file), its verdict
    the exit status, as the MBPP and HumanEval harnesses and SandboxFusion run them."""
    passed = [run_python(program + "\n" + test + "\n", settings=settings).status == "passed" for test in TESTS]
    return sum(passed) / len(TESTS)


@needs_bwrap
def test_each_forgery_wins_in_the_programs_process_and_scores_0_here():
    """Every forgery in FORGERS scores in a harness that runs the tests in the program's process (so each is a real
    attack), and 0 here, in both modes; the good program 1.0. Some act as the names are sent, some in their calls
    (after the names are sent), some before."""
    bwrap, weak = SandboxConfig(timeout_s=2.0), SandboxConfig(mode="rlimits", timeout_s=2.0)
    hostile = programs()
    for name in FORGERS:
        assert _inprocess_score(hostile[name], bwrap) > 0, name
        for settings in (bwrap, weak):
            result = score_program(f"```python\n{hostile[name]}```", TESTS, settings)
            assert result["score"] == 0, (settings.mode, name, result["tests"])
            assert all(t["detail"] for t in result["tests"]), (name, result["tests"])
    assert score_program(GOOD, TESTS, bwrap)["score"] == score_program(GOOD, TESTS, weak)["score"] == 1.0


def test_rlimits_mode_without_root_refuses_unless_told(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match=r"^reward.sandbox.mode=rlimits without root runs model-written code as"):
        check_sandbox(SandboxConfig(mode="rlimits"))
    check_isolation(SandboxConfig(mode="rlimits", allow_unisolated=True))
    check_isolation(SandboxConfig(mode="bwrap"))


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


@pytest.fixture(scope="module")
def code_run(tiny_sft):
    """A finished one-iteration run of the tiny model with the code_tests reward: 6 prompts of the hostile suite's
    task, 8 samples each, scored in bwrap. Its rollouts are then replaced by the hostile programs (a test's doing:
    the model cannot write them), so that a rerun of its scores scores them as a user's rerun would."""
    from storage import RunLayout
    from storage.stage_io import read_manifest, read_stage
    from tests.conftest import rlpipe

    workspace, cfg_path = tiny_sft
    data = workspace / "code-data"
    data.mkdir()
    rows = {"prompt_id": [f"c{i}" for i in range(7)], "prompt": ["def f(xs): return "] * 7}
    for split in ("train", "eval"):
        pl.DataFrame({**rows, "tests": [json.dumps(TESTS)] * 7}).write_parquet(data / f"{split}.parquet")
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["data"].update(train_files=str(data / "train.parquet"), eval_files=str(data / "eval.parquet"), answer_key=None)
    cfg["reward"] = {"functions": {"code_tests": {"weight": 1.0}}, "timeout_s": 30, "sandbox": {"timeout_s": 2}}
    cfg["rollout"].update(group_size=8, prompts_per_round=7)
    cfg["batch"] = {"target_groups": 7, "max_rounds": 1, "drop_zero_variance": False}
    cfg["rl"] = {"iterations": 1, "eval_every": 1}
    cfg["eval"] = {"samples": 2, "pass_k": 1, "judge": "code_tests"}
    (workspace / "code.yaml").write_text(yaml.safe_dump(cfg))
    rlpipe("run", str(workspace / "code.yaml"), "--run-id", "code-base", cwd=workspace)
    layout = RunLayout(workspace / "runs", "code-base")
    manifest = read_manifest(layout, "rollouts", 1)
    rollouts = read_stage(layout, "rollouts", 1).sort("prompt_id", "sample_idx")
    assert len(manifest["parts"]) == 1 and rollouts.height == 56
    return workspace, layout, rollouts, manifest


@needs_bwrap
@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_hostile_programs_score_0_through_a_rerun_of_the_scores(code_run, tmp_path, mode):
    """Issue 75's suite: every hostile program of tests/hostile_programs.py, as a run's responses, re-scored by
    `rlpipe rerun --stage scores` in a fork: each scores 0 with a reason for every test, the good program 1.0. Under
    bwrap the host is unchanged (files, processes, its loopback); in rlimits mode (as root: the user nobody) no file
    of the host's private folders is read or changed and no process is left, but the loopback is reachable."""
    from storage import RunLayout
    from storage.stage_io import write_stage
    from tests.conftest import read_table, rlpipe

    workspace, layout, rollouts, manifest = code_run
    secret, keep, written = tmp_path / "id_rsa", tmp_path / "keep.txt", tmp_path / "written.txt"
    secret.write_text("PRIVATE KEY")
    keep.write_text("still here")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    marker = f"rlpipe-orphan-{uuid.uuid4().hex}"
    values = {"secret": str(secret), "keep": str(keep), "written": str(written), "marker": marker}
    values.update(verdict=str(VERDICT), launcher=str(LAUNCHER))
    hostile = programs(**values, port=str(listener.getsockname()[1]))
    names = [*hostile, *["good"] * (rollouts.height - len(hostile))]
    assert len(hostile) >= 40 and names.count("good") >= 1
    sources = (VERDICT.read_bytes(), LAUNCHER.read_bytes())
    texts = [f"```python\n{hostile.get(name, GOOD)}```" for name in names]
    part = manifest["parts"][0]
    write_stage(
        layout, "rollouts", 1, rollouts.with_columns(text=pl.Series(texts)), fp=part["fingerprint"],
        inputs=manifest["inputs"], config_hash=manifest["config_hash"], started=time.time(),
    )  # fmt: skip
    fork = f"hostile-{mode}"
    rlpipe(
        "rerun", "code-base", "--iteration", "1", "--stage", "scores", "--fork", fork, "--root", "runs",
        "--set", f"reward.sandbox.mode={mode}", cwd=workspace,
    )  # fmt: skip
    scores = read_table(RunLayout(workspace / "runs", fork), "scores", 1).sort("prompt_id", "sample_idx")
    for name, score, info in zip(names, scores["score_code_tests"], scores["info_code_tests"]):
        tests = json.loads(info)["tests"]
        if name == "good":
            assert score == 1.0, tests
        else:
            assert score == 0 and all(t["status"] != "passed" and t["detail"] for t in tests), (name, tests)
            assert "PRIVATE KEY" not in info, name
    assert keep.read_text() == "still here" and secret.read_text() == "PRIVATE KEY" and not written.exists()
    assert (VERDICT.read_bytes(), LAUNCHER.read_bytes()) == sources
    assert _processes_with(marker) == []
    if mode == "bwrap":
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the host's loopback
    listener.close()
