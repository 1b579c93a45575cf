"""Rollout modes, one family: how the rollouts stage samples a round. Each mode is a module with one entry, registered
here under its name:

    sample(*, ctx, prompts, policy, iteration, round_, seed, name, sampler) -> SampledRound

- `single_turn` (tasks/stages/single_turn_rollouts.py): G samples per prompt, one generation;
- `partial` (tasks/stages/partial_rollouts.py, rollout.partial_tokens): a chunk per round of every sequence in flight,
  the rest carried to the next round in the `carry` table;
- `multi_turn` (tasks/stages/agent_rollouts.py, the agent section; ARPO's tree with agent.branching): trajectories of
  the model's turns and the tools' or environment's messages, with their `turns` table.

The stage (tasks/stages/rollouts.py) picks the mode from the config (`mode_of`), hands it the engines as a `Sampler`,
and writes what it returns: the rollouts rows and its second table stamped with the iteration and round, the engines'
reply and the round's figures in the manifest. A mode whose round reads more than the stage's own inputs (partial
rollouts: the carry table it continues) names them, for the stage's fingerprint, in its `inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import polars as pl

from schemas.requests import GenerationReply
from tasks.registry import Registry


@dataclass(frozen=True)
class Sampler:
    """The stage's vLLM replicas, with the round's weights, as a mode calls them: `job(n, seed)` is a sampling job with
    the run's temperature, top_p and limits (a mode may change its keys); `generate(frame, job, log_name)` samples it
    for a frame of prompts (prompt_id, prompt_token_ids, ...) and returns one row per sample, with the engines'
    reply (tasks/stages/rollouts.py, `generate`)."""

    job: Callable[[int, int], dict]
    generate: Callable[[pl.DataFrame, dict, str], tuple[pl.DataFrame, GenerationReply]]


@dataclass(frozen=True)
class SampledRound:
    """A mode's round: the rollouts rows and its second table (name → frame), both without the round's stamps; the
    engines' reply (a multi-turn round: its first turn's); the round's figures for the manifest (generate_seconds,
    tokens, and the mode's own)."""

    rows: pl.DataFrame
    reply: GenerationReply
    figures: dict
    tables: dict[str, pl.DataFrame] = field(default_factory=dict)


def no_inputs(ctx, iteration: int, round_: int) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class ModeNeeds:
    # (ctx, iteration, round_) → the fingerprints of what the round reads beyond the stage's inputs (partial: the carry
    # table it continues), asked before the stage decides whether to compute
    inputs: Callable[..., dict[str, str]] = no_inputs


ROLLOUT_MODES: Registry = Registry("rollout mode", ModeNeeds)
register = ROLLOUT_MODES.register
