"""The built-in `code_tests` reward: the program in a response, run against its row's tests in the sandbox
(tasks/rewards/sandbox.py); the score is the fraction of tests passed.

A row's tests (the `tests` column, or the column its `column` kwarg names) take the forms code datasets use:

    ["assert f(1) == 2", ...]                      Python run after the program, in its namespace (MBPP's test_list)
    [{"input": "1 2\\n", "output": "3\\n"}, ...]     the program's stdin, and its expected stdout
    {"inputs": [...], "outputs": [...]}            the same, as APPS and CodeContests store them
    a str holding one of these as JSON, or a single test script (HumanEval's `check`, with its call appended)

Expected output matches when it equals the program's stdout line by line, trailing spaces and blank lines aside.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from schemas.config import SandboxConfig
from tasks.rewards.sandbox import run_python

FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|$)", re.S)
PYTHON_TAGS = ("", "python", "python3", "py")
KEEP_PROGRAM = 4000  # characters of the program kept in info_<name>
KEEP_STDOUT = 1000  # and of each test's stdout


def extract_program(response: str) -> str:
    """The last fenced code block tagged python (or untagged); else the last fenced block of any language; else the
    whole response. An unclosed last fence (a response cut at max_tokens) runs to the end."""
    blocks = FENCE.findall(response)
    python = [code for tag, code in blocks if tag.lower() in PYTHON_TAGS]
    if python or blocks:
        return (python or [code for _, code in blocks])[-1]
    return response


class TestsFormatError(ValueError):
    pass


def parse_tests(value) -> list[dict]:
    """A row's tests as a list of {"code": ...} or {"input": ..., "output": ...}."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return [{"code": value}]
    if isinstance(value, Mapping):
        if "fn_name" in value:
            raise TestsFormatError("call-based tests (fn_name) are not supported: give assert statements")
        inputs, outputs = value.get("inputs"), value.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise TestsFormatError("a tests mapping needs equal-length lists 'inputs' and 'outputs'")
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs)]
    if not isinstance(value, (list, tuple)) or not value:
        raise TestsFormatError(f"tests must be a non-empty list, not {type(value).__name__} {str(value)[:40]!r}")
    cases = []
    for case in value:
        if isinstance(case, str):
            cases.append({"code": case})
        elif isinstance(case, Mapping) and "input" in case and "output" in case:
            cases.append({"input": _text(case["input"]), "output": _text(case["output"])})
        else:
            raise TestsFormatError(f"a test is a str of Python or an {{input, output}} mapping, not {str(case)[:40]!r}")
    return cases


def _text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def outputs_match(got: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(got) == lines(expected)


def score_program(response: str, tests, settings: SandboxConfig) -> dict:
    """{"score": passed / tests, "program": the program run, "tests": each test's status, detail, stdout and
    seconds}. After a test times out, the rest are skipped: the program is stuck, and each would wait as long."""
    program = extract_program(response)
    cases = parse_tests(tests)
    results, passed = [], 0
    for case in cases:
        if results and results[-1]["status"] in ("timeout", "skipped"):
            results.append({"status": "skipped", "detail": "a test before it timed out", "stdout": "", "seconds": 0.0})
            continue
        if "code" in case:
            outcome = run_python(program, test=case["code"], settings=settings)
        else:
            # stdout is read in full up to the expected length (and then some): a longer one does not match anyway
            outcome = run_python(program, stdin=case["input"], settings=settings, keep_chars=len(case["output"]) + 100)
        status, detail = outcome.status, outcome.detail
        if "output" in case and status == "passed" and not outputs_match(outcome.stdout, case["output"]):
            status, detail = "failed", f"expected {case['output'][:100]!r}"
        passed += status == "passed"
        stdout = outcome.stdout[:KEEP_STDOUT]
        results.append({"status": status, "detail": detail, "stdout": stdout, "seconds": round(outcome.seconds, 3)})
    return {"score": passed / len(cases), "program": program[:KEEP_PROGRAM], "tests": results}
