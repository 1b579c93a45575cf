"""Built-in reward functions, registered by name like any other (tasks/rewards/loader.py loads yours).

Every reward function is called with keyword arguments (the contract is in tasks/rewards/loader.py and
docs/train-your-own-model.md): the response, the ground truth, the prompt as text and as messages, the finish reason and
length, the generation limit, every other column of the dataset, and the entry's `kwargs` from the config. A function
takes the ones it names (or all, with **kwargs) and returns a number, so it can be debugged on one sample:
`accuracy(response="95.0", ground_truth="95")`.
Imports: math-verify inside `accuracy` (it loads sympy): only runs that score with it pay for it.
A built-in may carry a `preflight(reward, kwargs, columns)` attribute: the run's preflight calls it, once, before any
engine starts (code_tests checks that its sandbox runs on this machine).
Their names and needs are stated in schemas/builtin_rewards.py, below the config that validates against them (this
module's functions import the config); `builtin(name)` registers each under one of them.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from dataclasses import asdict

from schemas.builtin_rewards import BUILTIN_REWARD_NEEDS, BuiltinNeeds
from schemas.errors import RewardLoadError
from tasks.registry import Registry

BUILTIN_REWARDS: Registry = Registry("reward function", BuiltinNeeds)


def builtin(name: str):
    """Register a built-in under its name in schemas/builtin_rewards.py, with the needs stated there: the config
    validates against that list, so a name missing from it could never be chosen."""
    if name not in BUILTIN_REWARD_NEEDS:
        raise ValueError(f"built-in reward function {name!r} is not in schemas/builtin_rewards.py")
    return BUILTIN_REWARDS.register(name, **asdict(BUILTIN_REWARD_NEEDS[name]))


# math-verify warns on every call that its timeouts are off; they are off on purpose (see accuracy()).
logging.getLogger("math_verify").setLevel(logging.ERROR)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def final_answer(text: str) -> str:
    """The final answer of a response or a worked ground truth: what follows the last `####` (GSM8K), else the last
    \\boxed{} (MATH), else the whole text."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()


def _normalise(text: str) -> str:
    """Case, surrounding space and a final period do not change an answer (`Paris.` is `paris`)."""
    return " ".join(text.strip().rstrip(".").split()).casefold()


@builtin("accuracy")
def accuracy(response: str, ground_truth, **_) -> float:
    """1 if the response's final answer equals the ground truth's, else 0: the same text (case and spacing aside),
    or mathematically equal by math-verify (`95.0` = `95`, `\\frac{1}{2}` = `0.5`). Answers after `####` and in
    \\boxed{} are extracted first, on both sides; a non-numeric answer (`Paris`) is compared as text."""
    if ground_truth is None:
        return 0.0
    gold_text, pred_text = final_answer(str(ground_truth)), final_answer(response)
    if _normalise(gold_text) == _normalise(pred_text):
        return 1.0
    from math_verify import parse, verify

    # The timeouts in math-verify use SIGALRM, which only works on the main thread; Prefect runs tasks
    # elsewhere, so they are off here (the reward pool times out a hanging function itself).
    gold = parse(gold_text, parsing_timeout=None)
    pred = parse(pred_text, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


@functools.lru_cache(maxsize=64)
def _pattern(pattern: str) -> re.Pattern:
    return re.compile(pattern)


@builtin("format")
def format_ok(response: str, finish_reason: str, pattern: str = r"-?\d+", **_) -> float:
    """1 if the whole response matches `pattern` (a regular expression; default: a bare integer) and it ended by
    itself (EOS or a stop string, not cut off by max_tokens), else 0. Set the pattern in the config:
    `format: {weight: 0.1, kwargs: {pattern: '(?s).*\\\\boxed\\{.+\\}'}}`."""
    return float(finish_reason == "stop" and _pattern(pattern).fullmatch(response) is not None)


@builtin("overlong")
def soft_overlong(length: int, max_tokens: int, max_len: int | None = None, cache: int | None = None, **_) -> float:
    """DAPO's soft overlong punishment: 0 up to L_max − L_cache tokens, then a linear ramp down to −1 at L_max, and −1
    beyond. L_max = `max_len` (default: the generation limit); L_cache = `cache` (default: the last 20% of L_max,
    DAPO's 4,096 of 20,480)."""
    max_len = max_len or max_tokens
    cache = math.ceil(0.2 * max_len) if cache is None else cache
    free = max_len - cache
    if length <= free:
        return 0.0
    if length <= max_len:
        return (free - length) / cache
    return -1.0


@builtin("code_tests")
def code_tests(response: str, sandbox, column: str = "tests", **row) -> dict:
    """The fraction of the row's tests that the response's program passes, run in reward.sandbox; the program, and
    each test's status, detail, stdout and seconds, come back beside the score (scores.info_<name>). The tests are
    in the dataset column `column` (default `tests`): assert statements, or stdin/stdout pairs
    (tasks/rewards/program_tests.py has the forms). `code_tests(response="```python\\ndef f(): return 1\\n```",
    sandbox=SandboxConfig(), tests=["assert f() == 1"])` scores 1.0."""
    from tasks.rewards.program_tests import TestsFormatError, score_program

    if row.get(column) is None:
        raise ValueError(f"the row has no tests in column {column!r}")
    try:
        return score_program(response, row[column], sandbox)
    except TestsFormatError as exc:
        raise ValueError(f"column {column!r}: {exc}") from None


def _code_tests_preflight(reward, kwargs: dict, columns: set[str]) -> None:
    """Before any engine starts: the tests column exists, and the sandbox runs a program on this machine."""
    from tasks.rewards.sandbox import SandboxError, check_sandbox

    check_sandbox(reward.sandbox)
    column = kwargs.get("column", "tests")
    if column not in columns:
        raise SandboxError(f"reward function code_tests: the dataset has no column {column!r} (its kwargs.column)")


code_tests.preflight = _code_tests_preflight


ANSWER_FORMATS = ("tags", "last_line", "pattern")


def extract_final(response: str, answer_format: str = "tags", pattern: str | None = None) -> str | None:
    """The answer a response gives: `tags`, the content of its last <answer>…</answer> (reasoning-gym's own
    extract_answer; None without one); `last_line`, its last non-empty line; `pattern`, the last match of the regular
    expression `pattern` (its first group if it has one), stripped (None without a match): for a model that states its
    answer in a phrase of its own ("The answer is 12.") rather than in tags."""
    if answer_format == "tags":
        from reasoning_gym.utils import extract_answer

        return extract_answer(response, tag_name="answer")
    if answer_format == "last_line":
        lines = [line.strip() for line in response.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if answer_format == "pattern":
        if not pattern:
            raise ValueError("answer_format 'pattern' needs a pattern (a regular expression)")
        matches = list(re.finditer(pattern, response))
        if not matches:
            return None
        last = matches[-1]
        # a group outside the branch that matched is None: no answer, as an empty one is
        found = last.group(1) if last.re.groups else last.group(0)
        return (found or "").strip() or None
    raise ValueError(f"answer_format {answer_format!r}: choose one of {', '.join(ANSWER_FORMATS)}")


@functools.lru_cache(maxsize=None)
def _task_scorer(task: str):
    """The `score_answer` of reasoning-gym's task `task` (one instance per process: some tasks load word lists)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


@builtin("reasoning_gym")
def reasoning_gym_score(
    response: str, answer_format: str = "tags", column: str = "entry", pattern: str | None = None, **row
) -> float:
    """reasoning-gym's own scorer of the row's task: the answer is extracted from the response (`answer_format`:
    `tags`, `last_line` or `pattern` with `pattern`, extract_final) and scored by the task's `score_answer` against
    the row's entry, unchanged, so partial credit stays as reasoning-gym defines it. The entry is the dataset column
    `column` (default `entry`): the JSON of reasoning-gym's {question, answer, metadata}, whose
    metadata.source_dataset names the task. A row whose entry cannot be read, or names no task reasoning-gym has, is
    that sample's error."""
    import json

    raw = row.get(column)
    if raw is None:
        raise ValueError(f"the row has no reasoning-gym entry in column {column!r}")
    try:
        entry = json.loads(raw) if isinstance(raw, str) else dict(raw)
        task = entry["metadata"]["source_dataset"]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"column {column!r} is not a reasoning-gym entry ({type(exc).__name__}: {exc})") from None
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise ValueError(f"column {column!r}: reasoning-gym has no task {task!r}")
    return float(_task_scorer(task)(extract_final(response, answer_format, pattern), entry))


def _reasoning_gym_preflight(reward, kwargs: dict, columns: set[str]) -> None:
    """Before any engine starts: the entry column exists and the answer format is known."""
    column, answer_format = kwargs.get("column", "entry"), kwargs.get("answer_format", "tags")
    if column not in columns:
        raise RewardLoadError(f"reward function reasoning_gym: the dataset has no column {column!r} (kwargs.column)")
    if answer_format not in ANSWER_FORMATS:
        raise RewardLoadError(
            f"reward function reasoning_gym: answer_format {answer_format!r}: one of {', '.join(ANSWER_FORMATS)}"
        )
    if "pattern" in kwargs and answer_format != "pattern":
        raise RewardLoadError("reward function reasoning_gym: kwargs.pattern is read only with answer_format pattern")
    if answer_format == "pattern":
        pattern = kwargs.get("pattern")
        if not pattern:
            raise RewardLoadError("reward function reasoning_gym: answer_format 'pattern' needs kwargs.pattern")
        if not isinstance(pattern, str):
            raise RewardLoadError(
                "reward function reasoning_gym: kwargs.pattern must be a string (a regular expression)"
            )
        try:
            re.compile(pattern)
        except re.error as exc:
            raise RewardLoadError(
                f"reward function reasoning_gym: kwargs.pattern is not a regular expression ({exc})"
            ) from None


reasoning_gym_score.preflight = _reasoning_gym_preflight

# A name the config accepts with no function behind it would fail only when a run scores with it.
if BUILTIN_REWARDS.names() != sorted(BUILTIN_REWARD_NEEDS):
    raise ValueError(
        "schemas/builtin_rewards.py names built-in reward functions with no function here: "
        f"{', '.join(sorted(set(BUILTIN_REWARD_NEEDS) - set(BUILTIN_REWARDS)))}"
    )
