"""Rule reward functions: one registry, one score column each, combined with configured weights.

A reward function takes (response text, gold answer, finish_reason) and returns a float. It never sees the
whole batch, so it can be debugged on one sample: `REWARD_FUNCTIONS["accuracy"]("95", "95", "stop")`.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import re
from typing import Callable

import polars as pl

RewardFn = Callable[[str, str, str], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register(name: str):
    def wrap(fn: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = fn
        return fn

    return wrap


_INTEGER = re.compile(r"-?\d+")


@register("accuracy")
def accuracy(response: str, answer: str, finish_reason: str) -> float:
    """1 if the response is mathematically equal to the answer (math-verify), else 0."""
    from math_verify import parse, verify

    # The timeouts in math-verify use SIGALRM, which only works on the main thread; Prefect runs tasks
    # elsewhere, so they are off here (a hanging function is the scorer's concern, not this function's).
    gold = parse(answer, parsing_timeout=None)
    pred = parse(response.strip(), parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


@register("format")
def format_ok(response: str, answer: str, finish_reason: str) -> float:
    """1 if the response is a bare integer that ended with EOS (not cut off by max_tokens), else 0."""
    return float(finish_reason == "stop" and _INTEGER.fullmatch(response) is not None)


def code_hash(names) -> str:
    """A hash of the reward functions' source: part of the scores fingerprint, so a fixed function re-scores."""
    src = "".join(inspect.getsource(REWARD_FUNCTIONS[n]) for n in sorted(names))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class RewardError(ValueError):
    pass


def score_frame(rollouts: pl.DataFrame, answers: dict[str, str], weights: dict[str, float]) -> pl.DataFrame:
    """One row per rollout: `score_<fn>` and `error_<fn>` per function, the weighted `reward`, and `error`.

    A function that raises scores 0 for that sample and records the exception; a non-finite score is an
    error in the function, reported with its name.
    """
    cols: dict[str, list] = {}
    texts, reasons = rollouts["text"].to_list(), rollouts["finish_reason"].to_list()
    gold = [answers[p] for p in rollouts["prompt_id"].to_list()]
    for name in weights:
        fn = REWARD_FUNCTIONS[name]
        values, errors = [], []
        for text, ans, reason in zip(texts, gold, reasons):
            try:
                v = float(fn(text, ans, reason))
                err = None
            except Exception as exc:  # a broken reward function must not stop the run
                v, err = 0.0, f"{type(exc).__name__}: {exc}"[:200]
            if not math.isfinite(v):
                raise RewardError(f"reward function {name!r} returned {v} for response {text!r}")
            values.append(v)
            errors.append(err)
        cols[f"score_{name}"], cols[f"error_{name}"] = values, errors
    out = rollouts.select("iteration", "round", "prompt_id", "sample_idx").with_columns(
        [pl.Series(k, v, dtype=pl.Float64 if k.startswith("score_") else pl.Utf8) for k, v in cols.items()]
    )
    reward = sum(pl.col(f"score_{n}") * w for n, w in weights.items())
    error = pl.concat_str([pl.col(f"error_{n}") for n in weights], separator="; ", ignore_nulls=True)
    return out.with_columns(reward.cast(pl.Float64).alias("reward"), error.alias("error"))
