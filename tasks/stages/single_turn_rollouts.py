"""The rollouts stage's single-turn mode (tasks/stages/rollout_modes.py): rollout.group_size samples of each prompt, one
generation each, with the round's seed."""

from __future__ import annotations

import dataclasses

import polars as pl

from tasks.stages.common import RunContext
from tasks.stages.rollout_modes import SampledRound, Sampler, register
from tasks.stages.weights import Weights


@register("single_turn")
def sample(
    *,
    ctx: RunContext,
    prompts: pl.DataFrame,
    policy: Weights,
    iteration: int,
    round_: int,
    seed: int,
    name: str,
    sampler: Sampler,
) -> SampledRound:
    rows, reply = sampler.generate(prompts, sampler.job(ctx.cfg.rollout.group_size, seed), name)
    return SampledRound(rows, reply, dataclasses.asdict(reply.jobs[0]))
