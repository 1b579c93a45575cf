"""The multi-turn rollout: every trajectory of the batch advances one turn at a time, together.

A turn: one generation for every live trajectory (its ids so far as the prompt), then its tool calls run, or else the
environment steps, and what comes back is appended as observation ids (turn_tokens.py). A trajectory ends when the
model answers without a tool call (and there is no environment), when the environment says done, when it hits
`max_turns` or `max_total_tokens`, when its turn is cut off by `rollout.max_tokens`, or when its environment fails.

Token in, token out: a trajectory's ids are its prompt's, then the sampler's ids of each model turn exactly as
sampled, then the observation ids; `action_mask` marks the model's own, the only tokens with loss. Nothing is
re-tokenized from text.

ARPO's branching (agent.branching, `Branching` here): each prompt starts with `initial` trajectories. When a
trajectory's turn follows a tool result, the entropy of that turn's first tokens (the sampler's `head_entropy`) is
compared with the trajectory's first turn's; with probability clip(α + β·ΔH, 0, 1), `copies` times, a branch is made
at the point before that turn: a copy of the trajectory up to the tool result, which samples the turn anew at the next
step. A branch's `parent` and `branch_point` (the response tokens it shares with its parent) are kept. Branches stop
when the prompt holds `group_size` trajectories; a prompt whose trajectories have all ended before that gets one fresh
trajectory a step. A branch's own first turn does not branch again (that would be the same point).

Pure orchestration: `generate` and the workers (workers.py) are handed in, so the loop is tested with scripted ones.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from tasks.agents.tool_calls import parse_tool_calls
from tasks.agents.turn_tokens import observation_ids, prompt_ids


@dataclass(frozen=True)
class Sampled:
    """One generation as the sampler returned it: EOS included in `token_ids` when it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length
    head_entropy: float | None = None  # the entropy of its first tokens (asked for under branching)


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    max_turns: int
    max_total_tokens: int
    max_tokens_per_turn: int
    tool_call_format: str | None  # None: no tools
    environment: bool
    tools: list[dict] | None  # the tools' schemas, for the chat template
    chat: bool = True  # False: a model without a chat template reads plain text (turn_tokens.py)
    max_tool_output_tokens: int | None = None  # a longer tool result is cut to this many tokens, and marked


@dataclass(frozen=True, kw_only=True)
class Branching:
    """ARPO's settings (schemas.config.BranchingConfig) and the branching draws: `draw()` is uniform on [0, 1)."""

    group_size: int  # M: every prompt ends with this many trajectories
    initial: int  # N
    alpha: float
    beta: float
    copies: int  # Z
    vocab_size: int  # ΔH is divided by log(vocab_size)
    draw: Callable[[], float]

    def probability(self, entropy: float, initial_entropy: float) -> float:
        """P(branch) = clip(α + β·ΔH, 0, 1), ΔH = (H − H_initial) / log|V|."""
        delta = (entropy - initial_entropy) / math.log(self.vocab_size)
        return min(1.0, max(0.0, self.alpha + self.beta * delta))


class Workers(Protocol):
    def reset(self, rows: list[tuple[int, dict]]) -> list[tuple[list[dict], str | None]]: ...
    def step(self, conversations: list[tuple[int, list[dict]]]) -> list: ...
    def call_tools(self, calls: list[tuple[int, list]]) -> list[list]: ...


@dataclass
class Trajectory:
    index: int
    prompt_id: str
    sample_idx: int
    messages: list[dict]
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    actions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    model_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_reward: float | None = None
    error: str | None = None
    finish_reason: str = ""
    truncated: bool = False
    done: bool = False
    last_text: str = ""
    # ARPO's tree (None: a root): the parent's sample_idx, and the response tokens shared with it
    parent: int | None = None
    branch_point: int | None = None
    inherited_turns: int = 0  # the rows of `turns` copied from the parent
    initial_entropy: float | None = None  # its first turn's head entropy
    after_tool: bool = False  # its next turn follows a tool result: a branch point
    fresh_branch: bool = False  # a branch that has not yet taken its first turn

    def end(self, reason: str, truncated: bool = False) -> None:
        self.done, self.finish_reason, self.truncated = True, reason, truncated

    def add_turn(self, role: str, text: str, ids: list[int], **extra) -> None:
        self.turns.append(
            {
                "turn": self.model_turns,
                "role": role,
                "text": text,
                "token_ids": ids,
                "sampler_logprobs": extra.pop("logprobs", []),
                "tool_name": extra.pop("tool_name", None),
                "tool_arguments": extra.pop("tool_arguments", None),
                "error": extra.pop("error", None),
                "seconds": extra.pop("seconds", None),
                "cut_tokens": extra.pop("cut_tokens", None),
            }
        )


def run_episodes(
    trajectories: list[Trajectory],
    rows: list[dict],
    tokenizer,
    settings: LoopSettings,
    generate: Callable[[list[tuple[int, list[int]]], int], list[Sampled]],
    workers: Workers,
    branching: Branching | None = None,
) -> list[Trajectory]:
    """Play every trajectory to its end. `rows[i]` is trajectory i's dataset row (what the environment's reset gets);
    each trajectory starts from its `messages` (the prompt) and its `prompt_ids` when given (else they are rendered
    from the messages); an environment's reset replaces both. With `branching`, `trajectories` are each prompt's
    initial ones, and the branches and fresh ones are appended to it (and their rows to `rows`)."""
    if settings.environment:
        for t, (opening, error) in zip(trajectories, workers.reset([(t.index, rows[t.index]) for t in trajectories])):
            if error:
                t.error = error
                t.end("error")
            else:
                t.messages = list(opening)
    for t in trajectories:
        if settings.environment or not t.prompt_ids:  # else: the dataset's formatted prompt, as handed in
            t.prompt_ids = prompt_ids(tokenizer, t.messages, settings.tools, settings.chat)
        for m in t.messages:
            t.add_turn(m["role"], m["content"], [])
    origins = {t.prompt_id: _copy(t) for t in trajectories}  # each prompt's start, for fresh trajectories
    while live := [t for t in trajectories if not t.done]:
        budget = max(settings.max_total_tokens - len(t.ids) for t in live)
        points = {t.index: _copy(t) for t in live if branching and t.after_tool and not t.fresh_branch}
        outs = generate([(t.index, t.prompt_ids + t.ids) for t in live], min(settings.max_tokens_per_turn, budget))
        for t, out in zip(live, outs):
            _take_model_turn(t, out, tokenizer, settings.max_total_tokens)
            t.fresh_branch = False
            if t.initial_entropy is None:
                t.initial_entropy = out.head_entropy
        _observe([t for t in live if not t.done], tokenizer, settings, workers)
        if branching:
            _branch(trajectories, rows, live, outs, points, branching, origins)
    return trajectories


def _copy(t: Trajectory) -> Trajectory:
    return replace(
        t, messages=list(t.messages), ids=list(t.ids), actions=list(t.actions), logprobs=list(t.logprobs),
        turns=[dict(row) for row in t.turns],
    )  # fmt: skip


def _branch(
    trajectories: list[Trajectory],
    rows: list[dict],
    live: list[Trajectory],
    outs: list[Sampled],
    points: dict[int, Trajectory],
    b: Branching,
    origins: dict[str, Trajectory],
) -> None:
    """ARPO's step after a turn: branches at the branch points just passed (trajectories in index order, `copies`
    draws each, while the prompt has room), then one fresh trajectory for each prompt with room and none live."""
    count = Counter(t.prompt_id for t in trajectories)

    def add(start: Trajectory, **tree) -> None:
        new = replace(_copy(start), index=len(trajectories), sample_idx=count[start.prompt_id], **tree)
        rows.append(rows[start.index])
        trajectories.append(new)
        count[start.prompt_id] += 1

    for t, out in zip(live, outs):
        at = points.get(t.index)
        if at is None or out.head_entropy is None or t.initial_entropy is None:
            continue
        p = b.probability(out.head_entropy, t.initial_entropy)
        for _ in range(b.copies):
            if count[t.prompt_id] >= b.group_size:
                break
            if b.draw() < p:
                add(
                    at, parent=t.sample_idx, branch_point=len(at.ids), inherited_turns=len(at.turns),
                    fresh_branch=True,
                )  # fmt: skip
    alive = {t.prompt_id for t in trajectories if not t.done}
    for pid, start in origins.items():
        if pid not in alive and count[pid] < b.group_size:
            add(start)


def _take_model_turn(t: Trajectory, out: Sampled, tokenizer, max_total_tokens: int) -> None:
    room = max_total_tokens - len(t.ids)
    ids, logprobs = out.token_ids[:room], out.logprobs[:room]
    t.ids += ids
    t.actions += [1] * len(ids)
    t.logprobs += logprobs
    t.model_turns += 1
    t.last_text = tokenizer.decode(ids, skip_special_tokens=True)
    t.messages.append({"role": "assistant", "content": t.last_text})
    t.add_turn("assistant", t.last_text, ids, logprobs=logprobs)
    if out.finish_reason == "length" or len(out.token_ids) > room:
        t.end("length", truncated=True)
    elif len(t.ids) >= max_total_tokens:
        t.end("length", truncated=True)


CUT_MARK = "...(truncated)"  # what the model reads after a cut tool result (verl's marker)


def capped(text: str, tokenizer, limit: int | None) -> tuple[str, int | None]:
    """A tool result cut to its first `limit` tokens plus CUT_MARK, and the number of tokens cut (None: uncut), so
    that one long result cannot eat the trajectory's token budget."""
    if limit is None:
        return text, None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return text, None
    return tokenizer.decode(ids[:limit]) + CUT_MARK, len(ids) - limit


def _observe(answered: list[Trajectory], tokenizer, settings: LoopSettings, workers: Workers) -> None:
    """Tool results for the turns that call tools; the environment's step (or the end) for the others. After a
    trajectory's last turn (max_turns) nothing more is appended (no model turn would read it): its tool calls are not
    run, and the environment steps only for its reward."""
    fmt = settings.tool_call_format
    last = {t.index for t in answered if t.model_turns >= settings.max_turns}
    calls = {t.index: found for t in answered if fmt and (found := parse_tool_calls(t.last_text, fmt))}
    for t in answered:
        if t.index in calls and t.index in last:
            t.end("max_turns")
            del calls[t.index]
    with_calls = [t for t in answered if t.index in calls]
    new: dict[int, list[dict]] = {}
    for t, results in zip(with_calls, workers.call_tools([(t.index, calls[t.index]) for t in with_calls])):
        new[t.index] = []
        for call, result in zip(calls[t.index], results):
            t.tool_calls += 1
            t.tool_errors += result.error is not None
            text, cut = capped(result.text, tokenizer, settings.max_tool_output_tokens)
            new[t.index].append({"role": "tool", "content": text})
            arguments = json.dumps(call.arguments, sort_keys=True) if not call.error else call.raw
            t.add_turn(
                "tool", text, [], tool_name=call.name, tool_arguments=arguments, error=result.error,
                seconds=result.seconds, cut_tokens=cut,
            )  # fmt: skip
    rest = [t for t in answered if t.index not in calls and not t.done]
    if settings.environment and rest:
        for t, step in zip(rest, workers.step([(t.index, list(t.messages)) for t in rest])):
            if step.reward is not None:
                t.env_reward = (t.env_reward or 0.0) + step.reward
            if step.error:
                t.error = step.error
                t.end("error")
            elif step.done:
                t.end("stop")
            elif t.index in last:  # its reply was the last turn: no model turn would read the feedback, not kept
                t.end("max_turns")
            else:
                new[t.index] = step.messages
                for m in step.messages:
                    t.add_turn(m["role"], m["content"], [], seconds=step.seconds)
    else:
        for t in rest:
            t.end("stop")
    for t in answered:
        if t.done or t.index not in new:
            continue
        if t.index in last:
            t.end("max_turns")
            continue
        ids = observation_ids(tokenizer, new[t.index], settings.tools, settings.chat)
        if len(t.ids) + len(ids) >= settings.max_total_tokens:  # no room for the observation and a reply
            t.end("length", truncated=True)
            continue
        t.messages += new[t.index]
        t.turns[-1]["token_ids"] = ids  # the observation's ids, on its last message's row
        t.ids += ids
        t.actions += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.after_tool = t.index in calls
