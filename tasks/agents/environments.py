"""Environments: multi-turn tasks without tools (games, feedback loops), as a class in the user's file or module.

    class GuessTheNumber:
        def __init__(self, **kwargs): ...                 # the config's kwargs; one instance per sample
        def reset(self, row: dict) -> list[dict]: ...      # the dataset row -> the opening chat messages
        def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]: ...
            # the conversation so far, the model's last turn included -> (the messages to append, a reward or None,
            # whether the episode is over)

A step that raises, hangs past its timeout or returns something else ends that sample's episode with an error (the
sample is marked; the rest of the batch goes on). Appended messages take the roles `user`, `tool` or `system`: the
model's own turns are only ever what it sampled.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

from tasks.agents.contained import contained
from tasks.rewards.loader import FunctionSpec, load_function

OBSERVATION_ROLES = ("user", "tool", "system")


@dataclass(frozen=True)
class Step:
    messages: list[dict]  # to append to the conversation
    reward: float | None
    done: bool
    error: str | None
    seconds: float


def environment_spec(agent) -> FunctionSpec | None:
    """The agent section's environment class (`AgentConfig.environment`), as `load_environment` takes it."""
    e = agent.environment
    return FunctionSpec("environment", e.path, e.module, e.function, kind="environment") if e else None


def load_environment(spec: FunctionSpec):
    """The environment class a spec names (`path` or `module`, and `function`: the class's name)."""
    return load_function(dataclasses.replace(spec, kind="environment"))


def _checked_messages(messages, what: str) -> list[dict]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise TypeError(f"{what} returned {type(messages).__name__}, not a list of message dicts")
    for m in messages:
        if m.get("role") not in OBSERVATION_ROLES or not isinstance(m.get("content"), str):
            raise TypeError(
                f"{what} returned a message {str(m)[:60]}: needs a role of {OBSERVATION_ROLES}, text content"
            )
    return messages


def reset(env, row: dict, timeout_s: float) -> tuple[list[dict], str | None]:
    """The opening messages (any role but the model's own may open), or an error."""

    def call():
        messages = env.reset(row)
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"reset returned {str(messages)[:60]}, not a non-empty list of message dicts")
        return messages

    messages, error = contained(call, timeout_s, "reset")
    return (messages or [], error)


def step(env, messages: list[dict], timeout_s: float) -> Step:
    """One step after the model's turn; a failure ends the episode with its error and no reward."""
    started = time.perf_counter()

    def call():
        out = env.step(messages)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(f"step returned {str(out)[:60]}, not (messages, reward, done)")
        new, reward, done = out
        if reward is not None:
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise TypeError(f"step returned reward {reward!r}: a finite number or None")
            reward = float(reward)
        if not isinstance(done, bool):
            raise TypeError(f"step returned done={done!r}, not a bool")
        return Step(_checked_messages(new, "step"), reward, done, None, 0.0)

    result, error = contained(call, timeout_s, "step")
    seconds = time.perf_counter() - started
    if error:
        return Step([], None, True, error, seconds)
    return Step(result.messages, result.reward, result.done, None, seconds)
