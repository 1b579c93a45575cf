"""Reward functions for arithmetic questions asked of a chat model, written as a user writes them for rlpipe.

rlpipe calls each function with the keyword arguments it names (docs/train-your-own-model.md, "Reward functions"): here
the sampled `response` and the dataset's `ground_truth` (the answer column).
"""

import re

INTEGER = re.compile(r"-?\d[\d,]*")


def last_integer(text: str) -> int | None:
    """The last integer written in the text (`1,024` counts as 1024), or None."""
    found = INTEGER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def correct(response: str, ground_truth: str) -> float:
    """1 when the last integer of the response is the answer: a chat model may explain first, but it must end on it."""
    return float(last_integer(response) == int(ground_truth))


def concise(response: str, max_chars: int = 40) -> float:
    """1 for an answer of at most `max_chars` characters: a small weight on it rewards saying the result plainly."""
    return float(len(response.strip()) <= max_chars)
