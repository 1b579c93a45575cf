"""The example's own reward functions, referenced from config.yaml (reward.functions.<name>.path / function).

rlpipe calls each with keyword arguments and passes the ones a function names (docs/train-your-own-model.md, "Reward
functions"): prompt, messages, response, ground_truth, finish_reason, length, max_tokens, prompt_id, every other column
of the dataset row (here data_source, reward_model and extra_info), and the entry's kwargs from the config.
"""

import re

ANSWER = re.compile(r"####\s*(-?\d+)\s*$")


def correct(response: str, ground_truth: str, **_) -> float:
    """1 when the number after the final `####` is the ground truth, else 0."""
    match = ANSWER.search(response.strip())
    return float(match is not None and int(match.group(1)) == int(ground_truth))


def shows_work(response: str, finish_reason: str, extra_info: dict, **_) -> float:
    """A small bonus for writing the calculation with the right operation (`a + b = c` for an addition) before the
    answer, and for ending by itself. `extra_info` is the dataset's own column, passed untouched."""
    sign = "+" if extra_info["operation"] == "add" else "-"
    return float(finish_reason == "stop" and re.search(rf"\d+ \{sign} \d+ = -?\d+", response) is not None)


def not_repetitive(response: list[str], length: list[int]) -> list[float]:
    """Batched (`batched: true`): every argument is a list over the chunk's samples. 0 for a response that repeats one
    token-ish word more than 4 times (a degenerate sample), else 1."""
    out = []
    for text in response:
        words = text.split()
        out.append(0.0 if words and max(words.count(w) for w in set(words)) > 4 else 1.0)
    return out
