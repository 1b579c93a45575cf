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


def answer_digits(response: str, steps: list[str], ground_truth: str) -> list[float]:
    """A process reward: with reward.steps.regex '\\d(?=\\d*\\.?\\s*$)' each digit of the final number ends a step
    (`47 + 38 = 85` → `47 + 38 = 8`, `5`), and each step scores 1 when its digit is the answer's digit in that place.
    A carry dropped into the tens costs the tens step, not the units. An answer of the wrong length, or a response
    whose steps are not its answer's digits, scores every step as the whole answer (1 when right)."""
    found = INTEGER.findall(response)
    written = found[-1].replace(",", "").lstrip("-") if found else ""
    truth = str(abs(int(ground_truth)))
    whole = float(last_integer(response) == int(ground_truth))
    if len(written) != len(truth) or len(steps) != len(truth):
        return [whole] * len(steps)
    return [float(w == t) for w, t in zip(written, truth)]
