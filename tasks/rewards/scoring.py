"""Score rollouts with the configured reward functions: one `score_<name>`, `error_<name>` and `info_<name>` column
each, the weighted `reward`, and a combined `error` (tasks/rewards/loader.py has the calling contract)."""

from __future__ import annotations

import math

import polars as pl

from schemas.config import RewardConfig
from schemas.errors import UserError
from tasks.rewards.loader import specs_from_config
from tasks.rewards.pool import score_samples
from tasks.rewards.steps import aggregate_steps, split_steps


class RewardError(UserError, ValueError):
    pass


def nested_value(row: dict | None, dotted: str):
    """row["a"]["b"] for "a.b" (None where a level is missing)."""
    value = row
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def prompt_arguments(prompts: pl.DataFrame, answer_key: str | None) -> dict[str, dict]:
    """prompt_id → the arguments every response to that prompt shares: the prompt (text and messages), the ground
    truth (its type from the dataset, read from the row's columns), the id and every other dataset column."""
    n = prompts.height
    extras = prompts["extra"].to_list() if "extra" in prompts.columns else [None] * n
    messages = prompts["messages"].to_list() if "messages" in prompts.columns else [None] * n
    answers = prompts["answer"].to_list() if "answer" in prompts.columns else [None] * n
    out = {}
    for pid, text, msgs, answer, extra in zip(
        prompts["prompt_id"].to_list(), prompts["text"].to_list(), messages, answers, extras
    ):
        truth = nested_value(extra, answer_key) if extra is not None and answer_key else answer
        out[pid] = {
            "data_source": None,
            "extra_info": None,
            **(extra or {}),
            "prompt": text,
            "messages": msgs if msgs is not None else [{"role": "user", "content": text}],
            "ground_truth": truth,
            "prompt_id": pid,
            "chat": msgs is not None,
        }
    return out


SINGLE_TURN = {"turns": None, "env_reward": None, "tool_calls": 0, "tool_errors": 0}


def sample_arguments(
    shared: dict,
    text: str,
    reason: str,
    length: int,
    token_ids: list | None,
    max_tokens: int,
    agent: dict | None = None,
    *,
    reward: RewardConfig,
) -> dict:
    """The keyword arguments of one response's call: rlpipe's names, and verl's and TRL's for the same values. A
    multi-turn trajectory (`agent`) brings `messages` (the whole conversation, the prompt's included), `turns` (its
    rows of the turns table, as dicts), `env_reward`, `tool_calls` and `tool_errors`; `response` is its last turn.
    `steps` is the response split by reward.steps; `sandbox` is reward.sandbox, for functions that run code."""
    split = reward.steps
    args = {k: v for k, v in shared.items() if k != "chat"}
    completion = [{"role": "assistant", "content": text}] if shared["chat"] else text
    return {
        **args,
        "response": text,
        "steps": [step for step, _ in split_steps(text, split.delimiter, split.regex)],
        "finish_reason": reason,
        "length": length,
        "max_tokens": max_tokens,
        "solution_str": text,
        "completion": completion,
        "completion_ids": token_ids,
        "sandbox": reward.sandbox,
        **(agent or SINGLE_TURN),
    }


def agent_arguments(rollouts: pl.DataFrame, turns: pl.DataFrame | None) -> list[dict] | None:
    """Per rollout row, the multi-turn arguments (sample_arguments), or None for single-turn rollouts."""
    if "conversation" not in rollouts.columns:
        return None
    by_sample: dict = {}
    if turns is not None:
        for row in turns.drop("iteration", "round").iter_rows(named=True):
            by_sample.setdefault((row.pop("prompt_id"), row.pop("sample_idx")), []).append(row)
    return [
        {
            "messages": row["conversation"],
            "turns": by_sample.get((row["prompt_id"], row["sample_idx"]), []),
            "env_reward": row["env_reward"],
            "tool_calls": row["tool_calls"],
            "tool_errors": row["tool_errors"],
        }
        for row in rollouts.select(
            "prompt_id", "sample_idx", "conversation", "env_reward", "tool_calls", "tool_errors"
        ).iter_rows(named=True)
    ]


def score_frame(
    rollouts: pl.DataFrame,
    prompts: pl.DataFrame,
    reward: RewardConfig,
    max_tokens: int,
    answer_key: str | None = "answer",
    turns: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """One row per rollout: `score_<fn>`, `error_<fn>` and `info_<fn>` (what a function returned beside its score,
    as JSON) per function, the weighted `reward`, and `error`.

    Functions run in the reward pool (tasks/rewards/pool.py): one that raises or exceeds reward.timeout_s scores 0
    for that sample with the error recorded. A non-finite score is a bug in the function: refused with its name.
    """
    specs = specs_from_config(reward)
    shared = prompt_arguments(prompts, answer_key)
    lengths = rollouts["length"].to_list() if "length" in rollouts.columns else [0] * rollouts.height
    keys = list(
        zip(rollouts["prompt_id"].to_list(), rollouts["text"].to_list(), rollouts["finish_reason"].to_list(), lengths)
    )
    ids = rollouts["token_ids"].to_list() if "token_ids" in rollouts.columns else [None] * rollouts.height
    agent = agent_arguments(rollouts, turns)
    if agent is not None:  # a trajectory's reward depends on all of it: every sample is its own key
        keys = [(*key, k) for k, key in enumerate(keys)]
    # Each distinct sample is scored once: a group's G responses to one prompt are often the same text, and a reward
    # depends only on its arguments (math-verify on 1,024 demo responses: about 1 s, most of it repeats).
    first = {}
    for key, token_ids in zip(keys, ids):
        first.setdefault(key, token_ids)
    distinct = list(first)
    samples = [
        sample_arguments(
            shared[key[0]],
            *key[1:4],
            first[key],
            max_tokens,
            agent[key[4]] if agent is not None else None,
            reward=reward,
        )
        for key in distinct
    ]
    scored = score_samples(list(specs.values()), samples, reward.timeout_s, reward.workers)
    position = {k: i for i, k in enumerate(distinct)}
    cols: dict[str, pl.Series] = {}
    for name, results in scored.items():
        for (value, *_), (_, text, *_) in zip(results, distinct):
            if not all(math.isfinite(v) for v in (value if isinstance(value, list) else [value])):
                raise RewardError(f"reward function {name!r} returned {value} for response {text[:80]!r}")
        rows = [results[position[k]] for k in keys]
        if specs[name].per_step:  # the step scores kept as they came (null on an error), aggregated into the score
            how = reward.functions[name].step_aggregate
            steps = [v if e is None else None for v, e, _ in rows]
            cols[f"steps_{name}"] = pl.Series(f"steps_{name}", steps, dtype=pl.List(pl.Float64))
            rows = [(0.0, e, i) if e else (aggregate_steps(v, how), None, i) for v, e, i in rows]
        cols[f"score_{name}"] = pl.Series(f"score_{name}", [v for v, _, _ in rows], dtype=pl.Float64)
        cols[f"error_{name}"] = pl.Series(f"error_{name}", [e for _, e, _ in rows], dtype=pl.Utf8)
        cols[f"info_{name}"] = pl.Series(f"info_{name}", [i for _, _, i in rows], dtype=pl.Utf8)
    out = rollouts.select("iteration", "round", "prompt_id", "sample_idx").with_columns(list(cols.values()))
    weights = {name: spec.weight for name, spec in reward.functions.items()}
    # No functions at all is allowed: with reward.kind=model the reward model is the whole reward.
    total = sum((pl.col(f"score_{n}") * w for n, w in weights.items()), pl.lit(0.0))
    error = joined_errors([f"error_{n}" for n in weights]) if weights else pl.lit(None, pl.Utf8)
    return out.with_columns(total.cast(pl.Float64).alias("reward"), error.alias("error"))


def joined_errors(columns: list[str]) -> pl.Expr:
    """The columns' errors joined with "; ", null when none has one (an all-null join is "", which is no error)."""
    joined = pl.concat_str([pl.col(c) for c in columns], separator="; ", ignore_nulls=True)
    return pl.when(joined == "").then(None).otherwise(joined)
