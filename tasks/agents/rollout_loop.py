"""The multi-turn rollout: every trajectory of the batch advances one turn at a time, together.

A turn: one generation for every live trajectory (its ids so far as the prompt), then its tool calls run, or else the
environment steps, and what comes back is appended as observation ids (turn_tokens.py). A trajectory ends when the
model answers without a tool call (and there is no environment), when the environment says done, when it hits
`max_turns` or `max_total_tokens`, when its turn is cut off by `rollout.max_tokens`, or when its environment fails.

Token in, token out: a trajectory's ids are its prompt's, then the sampler's ids of each model turn exactly as
sampled, then the observation ids; `action_mask` marks the model's own, the only tokens with loss. Nothing is
re-tokenized from text.

Pure orchestration: `generate` and the workers (workers.py) are handed in, so the loop is tested with scripted ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Protocol

from tasks.agents.tool_calls import parse_tool_calls
from tasks.agents.turn_tokens import observation_ids, prompt_ids


@dataclass(frozen=True)
class Sampled:
    """One generation as the sampler returned it: EOS included in `token_ids` when it stopped."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length


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
) -> list[Trajectory]:
    """Play every trajectory to its end. `rows[i]` is trajectory i's dataset row (what the environment's reset gets);
    each trajectory starts from its `messages` (the prompt) and its `prompt_ids` when given (else they are rendered
    from the messages); an environment's reset replaces both."""
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
    for turn in range(settings.max_turns):
        live = [t for t in trajectories if not t.done]
        if not live:
            break
        budget = max(settings.max_total_tokens - len(t.ids) for t in live)
        outs = generate([(t.index, t.prompt_ids + t.ids) for t in live], min(settings.max_tokens_per_turn, budget))
        for t, out in zip(live, outs):
            _take_model_turn(t, out, tokenizer, settings.max_total_tokens)
        _observe([t for t in live if not t.done], tokenizer, settings, workers, last=turn == settings.max_turns - 1)
    return trajectories


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


def _observe(answered: list[Trajectory], tokenizer, settings: LoopSettings, workers: Workers, last: bool) -> None:
    """Tool results for the turns that call tools; the environment's step (or the end) for the others. After the
    `last` turn nothing more is appended (no model turn would read it): its tool calls are not run, and the
    environment steps only for its reward."""
    fmt = settings.tool_call_format
    calls = {t.index: found for t in answered if fmt and (found := parse_tool_calls(t.last_text, fmt))}
    if last:
        for t in answered:
            if t.index in calls:
                t.end("max_turns")
        calls = {}
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
        if last:
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
