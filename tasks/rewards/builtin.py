"""Rule reward functions: one registry, one score column each, combined with configured weights.

A reward function takes one `Sample` (and the reward config, for its settings) and returns a float. It
never sees the whole batch, so it can be debugged on one sample:
`REWARD_FUNCTIONS["accuracy"](Sample("95", "95"))`.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
import re
from dataclasses import dataclass
from typing import Callable

import polars as pl

from schemas.config import RewardConfig


@dataclass(frozen=True)
class Sample:
    response: str
    answer: str
    finish_reason: str = "stop"  # "stop" (EOS) or "length" (cut off by max_tokens)
    length: int = 0  # response tokens
    max_tokens: int = 0  # the generation limit it was sampled under


RewardFn = Callable[[Sample, RewardConfig], float]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register(name: str):
    def wrap(fn: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = fn
        return fn

    return wrap


# math-verify warns on every call that its timeouts are off; they are off on purpose (see accuracy()).
logging.getLogger("math_verify").setLevel(logging.ERROR)

_INTEGER = re.compile(r"-?\d+")


@register("accuracy")
def accuracy(sample: Sample, cfg: RewardConfig = RewardConfig()) -> float:
    """1 if the response is mathematically equal to the answer (math-verify), else 0."""
    from math_verify import parse, verify

    # The timeouts in math-verify use SIGALRM, which only works on the main thread; Prefect runs tasks
    # elsewhere, so they are off here (a hanging function is the scorer's concern, not this function's).
    gold = parse(sample.answer, parsing_timeout=None)
    pred = parse(sample.response.strip(), parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


@register("format")
def format_ok(sample: Sample, cfg: RewardConfig = RewardConfig()) -> float:
    """1 if the response is a bare integer that ended with EOS (not cut off by max_tokens), else 0."""
    return float(sample.finish_reason == "stop" and _INTEGER.fullmatch(sample.response) is not None)


@register("overlong")
def soft_overlong(sample: Sample, cfg: RewardConfig = RewardConfig()) -> float:
    """DAPO's soft overlong punishment: 0 up to L_max − L_cache tokens, then a linear ramp down to −1 at
    L_max, and −1 beyond (L_max = reward.overlong_max_len, or the sample's max_tokens)."""
    max_len = cfg.overlong_max_len or sample.max_tokens
    free = max_len - cfg.overlong_cache
    if sample.length <= free:
        return 0.0
    if sample.length <= max_len:
        return (free - sample.length) / cfg.overlong_cache
    return -1.0


def code_hash(names) -> str:
    """A hash of the reward functions' source: part of the scores fingerprint, so a fixed function re-scores."""
    src = "".join(inspect.getsource(REWARD_FUNCTIONS[n]) for n in sorted(names))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


class RewardError(ValueError):
    pass


def score_frame(rollouts: pl.DataFrame, answers: dict[str, str], cfg: RewardConfig, max_tokens: int = 0) -> pl.DataFrame:
    """One row per rollout: `score_<fn>` and `error_<fn>` per function, the weighted `reward`, and `error`.

    Functions run in the reward pool (tasks/rewards/pool.py): one that raises or exceeds reward.timeout_s
    scores 0 for that sample with the error recorded. A non-finite score is a bug in the function: refused
    with its name.
    """
    from tasks.rewards.pool import score_samples

    weights = dict(cfg.weights)
    lengths = rollouts["length"].to_list() if "length" in rollouts.columns else [0] * rollouts.height
    samples = [
        Sample(text, answers[p], reason, n, max_tokens)
        for text, p, reason, n in zip(rollouts["text"], rollouts["prompt_id"], rollouts["finish_reason"], lengths)
    ]
    # Each distinct sample is scored once: a group's G responses to one prompt are often the same text, and a
    # reward function is a function of its Sample (math-verify on 1,024 demo responses: about 1 s, most of it repeats).
    distinct = list(dict.fromkeys(samples))
    scored = score_samples({name: REWARD_FUNCTIONS[name] for name in weights}, distinct, cfg, cfg.workers)
    position = {s: i for i, s in enumerate(distinct)}
    results = {name: [pairs[position[s]] for s in samples] for name, pairs in scored.items()}
    cols: dict[str, list] = {}
    for name, pairs in results.items():
        for sample, (v, _) in zip(samples, pairs):
            if not math.isfinite(v):
                raise RewardError(f"reward function {name!r} returned {v} for response {sample.response!r}")
        cols[f"score_{name}"] = [v for v, _ in pairs]
        cols[f"error_{name}"] = [e for _, e in pairs]
    out = rollouts.select("iteration", "round", "prompt_id", "sample_idx").with_columns(
        [pl.Series(k, v, dtype=pl.Float64 if k.startswith("score_") else pl.Utf8) for k, v in cols.items()]
    )
    # No rule weights at all is allowed: with reward.kind=model the reward model is the whole reward.
    reward = sum((pl.col(f"score_{n}") * w for n, w in weights.items()), pl.lit(0.0))
    if weights:
        joined = pl.concat_str([pl.col(f"error_{n}") for n in weights], separator="; ", ignore_nulls=True)
        error = pl.when(joined == "").then(None).otherwise(joined)  # all-null joins to "", which is no error
    else:
        error = pl.lit(None, pl.Utf8)
    return out.with_columns(reward.cast(pl.Float64).alias("reward"), error.alias("error"))
