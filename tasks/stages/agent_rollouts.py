"""The rollouts stage's multi-turn mode (the agent section; tasks/stages/rollout_modes.py), and the eval's episodes:
each prompt's G trajectories played by tasks/agents/rollout_loop.py on the resident vLLM engines, the tools and
environment in their worker processes. Writes the `rollouts` rows (one per trajectory, with the multi-turn columns) and
the `turns` rows."""

from __future__ import annotations

import random
from functools import partial

import polars as pl

from schemas.errors import UserError
from schemas.tables import LIST_I32, ROLLOUTS, TURNS
from tasks.agents.environments import environment_spec
from tasks.agents.rollout_loop import Branching, LoopSettings, Sampled, Trajectory, run_episodes
from tasks.agents.tools import load_tools, tool_specs
from tasks.agents.workers import AgentWorkers
from tasks.data.formatting import load_tokenizer
from tasks.stages.common import RunContext
from tasks.stages.rollout_modes import SampledRound, Sampler, register
from tasks.stages.weights import Weights


@register("multi_turn")
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
    """The round's trajectories (`play`), one sample per turn's job; the figures count the turns too."""
    group_size, branching = ctx.cfg.rollout.group_size, ctx.cfg.agent.branching
    rows, turns, reply, totals = play(
        ctx,
        policy.path,
        prompts,
        group_size,
        seed,
        name,
        sampler.generate,
        partial(sampler.job, 1),
        branching=branching,
    )
    present = [c for c in TURNS.optional if c in turns.columns]
    turns = turns.select(*(c for c in TURNS.columns if c not in ("iteration", "round")), *present)  # stamped after
    return SampledRound(rows, reply, totals, tables={"turns": turns})


def play(
    ctx,
    model_path: str,
    prompts: pl.DataFrame,
    group_size: int,
    seed: int,
    log_name: str,
    generate_frames,
    job_for,
    branching=None,
):
    """(rollouts frame, turns frame, engine response of the first turn, generation totals): `group_size` trajectories
    of each prompt. `generate_frames(frame, job, name)` runs the vLLM engines (rollouts.generate); `job_for(seed)` is a
    turn's sampling job (one sample per trajectory). `branching` (agent.branching, training rollouts only): ARPO's
    tree, each prompt starting `branching.initial` trajectories."""
    agent = ctx.cfg.agent
    tokenizer = load_tokenizer(model_path)
    specs = tool_specs(agent)
    schemas = [t.schema for t in load_tools(specs).values()] or None
    settings = loop_settings(agent, ctx.cfg.rollout, tokenizer, schemas, bool(specs))
    starts = branching.initial if branching else group_size
    rows = [episode_row(row, ctx.cfg.data) for row in prompts.iter_rows(named=True) for _ in range(starts)]
    trajectories = [
        Trajectory(
            i,
            row["prompt_id"],
            i % starts,
            [dict(m) for m in row["messages"]],
            prompt_ids=[] if schemas else list(row["prompt_token_ids"]),  # tools: rendered again, with their schemas
        )
        for i, row in enumerate(rows)
    ]
    turns = Turns(generate_frames, job_for, seed, log_name, branching)
    workers = AgentWorkers(
        specs, environment_spec(agent), agent.environment.kwargs if agent.environment else {},
        ctx.cfg.engines.agent_workers, agent.tool_timeout_s, agent.step_timeout_s,
    )  # fmt: skip
    tree = branching_tree(branching, group_size, len(tokenizer), seed) if branching else None
    try:
        played = run_episodes(trajectories, rows, tokenizer, settings, turns.generate, workers, tree)
    finally:
        workers.close()
    order = {pid: k for k, pid in enumerate(prompts["prompt_id"].to_list())}
    played = sorted(played, key=lambda t: (order[t.prompt_id], t.sample_idx))  # a prompt's group together
    if turns.first is None:
        raise NoTurnError(no_turn_line(played))
    return (*tables(played, tree=branching is not None), turns.first, turns.totals)


def loop_settings(agent, rollout, tokenizer, schemas, with_tools: bool) -> LoopSettings:
    return LoopSettings(
        max_turns=agent.max_turns,
        max_total_tokens=agent.max_total_tokens,
        max_tokens_per_turn=rollout.max_tokens,
        tool_call_format=agent.tool_call_format if with_tools else None,
        environment=agent.environment is not None,
        tools=schemas,
        chat=bool(getattr(tokenizer, "chat_template", None)),
        max_tool_output_tokens=agent.max_tool_output_tokens,
    )


class Turns:
    """One generation per turn for every live trajectory, through the stage's engines: each turn's job seeded from
    the run's seed and the turn's number; the first turn's engine response and the totals kept."""

    def __init__(self, generate_frames, job_for, seed: int, log_name: str, branching):
        self.generate_frames, self.job_for, self.seed, self.log_name = generate_frames, job_for, seed, log_name
        self.branching = branching
        self.first = None
        self.totals = {"generate_seconds": 0.0, "tokens": 0, "turns": 0}

    def generate(self, items: list[tuple[int, list[int]]], max_tokens: int) -> list[Sampled]:
        frame = pl.DataFrame(
            {
                "prompt_id": [str(i) for i, _ in items],
                "prompt_token_ids": pl.Series([ids for _, ids in items], dtype=LIST_I32),
            }
        )
        totals = self.totals
        job = {**self.job_for(self.seed + 7919 * totals["turns"]), "max_tokens": max_tokens}
        if self.branching:  # the entropy of each turn's start
            job.update(top_logprobs=self.branching.top_logprobs, entropy_tokens=self.branching.entropy_tokens)
        df, resp = self.generate_frames(frame, job, f"{self.log_name}-turn{totals['turns']}")
        self.first = resp if self.first is None else self.first
        totals["turns"] += 1
        totals["generate_seconds"] += resp.jobs[0].generate_seconds
        totals["tokens"] += resp.jobs[0].tokens
        by_id = {row["prompt_id"]: row for row in df.iter_rows(named=True)}
        return [
            Sampled(list(o["token_ids"]), list(o["sampler_logprobs"]), o["finish_reason"], o.get("head_entropy"))
            for o in (by_id[str(i)] for i, _ in items)
        ]


def branching_tree(b, group_size: int, vocab_size: int, seed: int) -> Branching:
    return Branching(
        group_size=group_size, initial=b.initial, alpha=b.alpha, beta=b.beta, copies=b.copies,
        vocab_size=vocab_size, draw=random.Random(seed).random,
    )  # fmt: skip


def tables(played: list[Trajectory], tree: bool) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rollouts rows (one per trajectory) and the turns rows of the played trajectories."""
    rollouts = [rollout_row(t, tree=tree) for t in played]
    schema = {**ROLLOUTS.columns, **ROLLOUTS.optional}
    frame = pl.DataFrame(rollouts, schema_overrides={k: v for k, v in schema.items() if k in rollouts[0]}, strict=False)
    turns = pl.DataFrame(
        [turn for t in played for turn in turn_rows(t, tree=tree)],
        schema_overrides={k: v for k, v in TURNS.columns.items() if k not in ("iteration", "round")},
        strict=False,
    )
    return frame, turns


class NoTurnError(UserError, RuntimeError):
    """Every episode of a batch ended before the model's first turn: there is nothing to train or evaluate."""


def no_turn_line(played: list[Trajectory]) -> str:
    failed = [t for t in played if t.error]
    example = f"; e.g. prompt {failed[0].prompt_id!r}: {failed[0].error}" if failed else ""
    return (
        f"agent: all {len(played)} episodes ended before the model's first turn ({len(failed)} with an environment "
        f"error{example})"
    )


def episode_row(prompt: dict, data) -> dict:
    """The row an environment's `reset` gets: the dataset's own columns at the top level, as the docs promise
    (`row["question"]`), the prompt's and the id's columns (data.prompt_key, data.id_key) included, then rlpipe's
    (prompt_id, prompt, messages, answer, text, ...), which win on a clash; the dataset's other columns also stay
    nested under `extra`. The prompt's column holds the question as the dataset gave it (the last user message: the
    prompts table keeps the formatted text and the messages, not the raw column); the id comes as text (rlpipe's ids
    are strings); a dotted prompt_key's value comes under its own dotted name."""
    users = [m["content"] for m in prompt.get("messages") or [] if m["role"] == "user"]
    own = {data.prompt_key: users[-1] if users else prompt["text"]}  # the question as the dataset gave it
    if data.id_key:
        own[data.id_key] = prompt["prompt_id"]
    return {**own, **(prompt.get("extra") or {}), **prompt, "prompt": prompt["text"]}


def rollout_row(t: Trajectory, tree: bool = False) -> dict:
    return {
        "prompt_id": t.prompt_id,
        "sample_idx": t.sample_idx,
        "prompt_token_ids": t.prompt_ids,
        "token_ids": t.ids,
        "text": t.last_text,
        "sampler_logprobs": t.logprobs,
        "finish_reason": t.finish_reason,
        "truncated": t.truncated,
        "length": len(t.ids),
        "action_mask": t.actions,
        "conversation": t.messages,
        "turns": t.model_turns,
        "tool_calls": t.tool_calls,
        "tool_errors": t.tool_errors,
        "env_reward": t.env_reward,
        "agent_error": t.error,
        **({"parent_sample_idx": t.parent, "branch_point": t.branch_point} if tree else {}),
    }


def turn_rows(t: Trajectory, tree: bool = False) -> list[dict]:
    """Its `turns` rows; in a branching tree each row also says whether it was copied from the parent (`inherited`)."""
    marks = [{"inherited": k < t.inherited_turns} for k in range(len(t.turns))] if tree else [{}] * len(t.turns)
    return [{"prompt_id": t.prompt_id, "sample_idx": t.sample_idx, **turn, **m} for turn, m in zip(t.turns, marks)]
