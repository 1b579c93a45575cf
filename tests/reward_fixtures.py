"""Reward functions for the reward tests, by module reference (`module: tests.reward_fixtures`), so spawned reward
workers import them exactly as they import a user's module."""

import math
import time

CALLS: list[str] = []  # what `counting` saw (in-process scoring only, workers=0)


def hangs(**_):
    while True:
        time.sleep(0.01)


def raises(**_):
    raise KeyError("no such field")


def echo_length(response, **_):
    return float(len(response))


def counting(response, ground_truth):
    CALLS.append(response)
    return float(response == ground_truth)


def nan(**_):
    return math.nan


def returns_text(**_):
    return "high"


def lengths_batched(response, length):
    """Batched: a list per argument in, a list of scores out."""
    assert isinstance(response, list) and isinstance(length, list)
    return [float(n) for n in length]


def wrong_count(response):
    return [1.0] * (len(response) + 1)


def sees_everything(
    prompt, messages, response, ground_truth, finish_reason, length, max_tokens, prompt_id, difficulty, meta, bonus=0.0
):
    """Scores 1 + bonus when every argument arrived with its type from the dataset."""
    ok = (
        isinstance(prompt, str)
        and messages[-1]["role"] == "user"
        and ground_truth == 7
        and finish_reason == "stop"
        and length == 3
        and max_tokens == 8
        and prompt_id == "p0"
        and difficulty == "easy"
        and meta == {"source": "unit", "tags": ["a"]}
    )
    return float(ok) + bonus


def needs_unknown(response, confidence):
    return 1.0


def digit_steps(steps):
    """A process reward: 1 for each step that contains a digit (one score per step)."""
    return [float(any(c.isdigit() for c in step)) for step in steps]


def digit_steps_batched(steps):
    return [[float(any(c.isdigit() for c in step)) for step in sample] for sample in steps]


def one_step_score(steps):
    """A broken process reward: always one score, whatever the number of steps."""
    return [1.0]
