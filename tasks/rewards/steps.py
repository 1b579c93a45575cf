"""Process rewards' steps: a response split into steps (reward.steps), each step's last response token, and a
per-step function's scores aggregated into the sample's score (docs/algorithms.md, "Process rewards"). Pure: the
tokenizer comes in as a `decode` callable.
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence


def split_steps(text: str, delimiter: str = "\n", regex: str | None = None) -> list[tuple[str, int]]:
    """The response's steps as (text, end): a step ends after each occurrence of `delimiter` (or each non-empty match
    of `regex`), and the text after the last one is the last step. A piece that is only whitespace (a blank line
    between steps) joins the step before it, or the one after it at the start. The steps' texts join back to `text`
    exactly; `end` is the character offset just past the step. An empty response is one empty step."""
    pattern = re.compile(regex) if regex is not None else re.compile(re.escape(delimiter))
    cuts = sorted({m.end() for m in pattern.finditer(text) if m.end() > m.start() and m.end() < len(text)})
    steps: list[tuple[str, int]] = []
    pending = ""
    for start, cut in zip([0, *cuts], [*cuts, len(text)]):
        piece = pending + text[start:cut]
        if not piece.strip() and steps:  # blank between or after steps: it joins the step before
            steps[-1] = (steps[-1][0] + piece, cut)
        elif not piece.strip() and cut < len(text):  # blank before the first step: it joins the step after
            pending = piece
        else:
            steps.append((piece, cut))
            pending = ""
    return steps


def step_token_ends(char_ends: Sequence[int], n_tokens: int, decoded_length: Callable[[int], int]) -> list[int]:
    """The index of the response token on which each step ends: the first k whose decoded prefix of k tokens reaches
    the step's end (`decoded_length(k)` is len(decode(token_ids[:k]))), minus one; the last step ends on the last
    token, so an EOS token is credited to it. Found by bisection (a few decodes per step); non-decreasing.
    With no tokens every end is −1."""
    if n_tokens == 0:
        return [-1] * len(char_ends)
    out, low = [], 1
    for end in char_ends[:-1]:
        lo, hi = low, n_tokens
        while lo < hi:
            mid = (lo + hi) // 2
            if decoded_length(mid) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo - 1)
        low = lo
    return [*out, n_tokens - 1]


AGGREGATES: dict[str, Callable[[list[float]], float]] = {
    "mean": lambda v: sum(v) / len(v) if v else 0.0,
    "min": lambda v: min(v) if v else 0.0,
    "product": lambda v: math.prod(v),
}


def aggregate_steps(values: Sequence[float], how: str) -> float:
    """One score from a response's step scores: their mean, min or product (an empty list: 0, and 1 for product)."""
    return float(AGGREGATES[how](list(values)))


def step_ends_column(
    texts: Sequence[str], token_ids: Sequence[Sequence[int]], decode: Callable[[list[int]], str], split
) -> list[list[int]]:
    """Each response's step ends (step_token_ends) under `split` (reward.steps), with `decode` the tokenizer's
    decoding of a response's first tokens as the sampler wrote its text (special tokens left out). A group's repeated
    responses are worked out once."""
    done: dict[tuple, list[int]] = {}
    out = []
    for text, ids in zip(texts, token_ids):
        ids = list(ids)
        key = (text, tuple(ids))
        if key not in done:
            ends = [end for _, end in split_steps(text, split.delimiter, split.regex)]
            done[key] = step_token_ends(ends, len(ids), lambda k: len(decode(ids[:k])))
        out.append(done[key])
    return out
