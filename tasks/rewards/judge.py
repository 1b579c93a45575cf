"""LLM judges (RLAIF): the judge's prompts from its template, its replies parsed into scores, and the calls to an
OpenAI-compatible endpoint. The local judge's calls (rlpipe's own vLLM engine) are in tasks/stages/scores.py.

A judge (reward.judges.<name>, schemas/config.py JudgeConfig) is asked either once per distinct response (pointwise) or
once per prompt with its whole group of responses (group, as ART's RULER: the scores are relative within the group,
which is what a group-normalised advantage uses anyway). Its reply becomes a score in [0, 1] by `scale`:
- text: the first match of score_pattern (pointwise: group 1; group mode: group 1 the response's number, group 2 its
  score);
- logprobs: the expected value over the scale's integer tokens among the first reply token's top candidates,
  renormalised over them (G-Eval's weighting), so a judge unsure between 6 and 8 gives 7, not a coin flip.
A reply that cannot be read is that sample's error, never the run's.
"""

from __future__ import annotations

import math
import os
import re
import string
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from schemas.config import JUDGE_FIELDS, JUDGE_GROUP_TEMPLATE, JUDGE_POINTWISE_TEMPLATE, JudgeConfig
from schemas.errors import UserError

POINTWISE_PATTERN = r"(-?\d+(?:\.\d+)?)"
GROUP_PATTERN = r"(?i)response[ \t]*#?[ \t]*(\d+)[ \t]*[:=\-][ \t]*(-?\d+(?:\.\d+)?)"  # one line: not the echoed text


class JudgeError(UserError, ValueError):
    """A judge that cannot be used at all (its template names a missing field, its endpoint is unreachable)."""


@dataclass(frozen=True)
class Reply:
    """One judge call's answer: its text and first-token candidates (token, logprob), or the error it ended in."""

    text: str | None = None
    top: tuple[tuple[str, float], ...] = ()
    error: str | None = None


def template_of(judge: JudgeConfig) -> str:
    if judge.template is not None:
        return judge.template
    return JUDGE_POINTWISE_TEMPLATE if judge.mode == "pointwise" else JUDGE_GROUP_TEMPLATE


def check_template(judge: JudgeConfig, name: str, columns: set[str]) -> None:
    """Every field the template names is one rlpipe fills or a dataset column: one line naming it, else."""
    fields = {f for _, f, _, _ in string.Formatter().parse(template_of(judge)) if f is not None}
    unknown = sorted(fields - JUDGE_FIELDS[judge.mode] - columns)
    if unknown:
        raise JudgeError(
            f"reward.judges.{name}.template names {{{unknown[0]}}}, which is neither one of "
            f"{sorted(JUDGE_FIELDS[judge.mode])} nor a column of the dataset"
        )
    try:  # a format spec or conversion the values cannot take ({response:d}) fails here, not mid-run
        render(template_of(judge), dict.fromkeys(fields, ""))
    except JudgeError as exc:
        raise JudgeError(f"reward.judges.{name}.template: {exc}") from None


def render(template: str, fields: dict) -> str:
    """The template filled in; a null value is an empty string."""
    try:
        return string.Formatter().vformat(template, (), {k: "" if v is None else v for k, v in fields.items()})
    except (KeyError, AttributeError, IndexError) as exc:
        raise JudgeError(f"a judge's template names {exc}, which this row does not have") from None
    except (ValueError, TypeError) as exc:
        raise JudgeError(f"a judge's template cannot be filled in: {exc}") from None


def numbered(responses: list[str]) -> str:
    """A group's responses as the group template's {responses}: 'Response 1:' blocks, 1-based."""
    return "\n\n".join(f"Response {i}:\n{text or ''}" for i, text in enumerate(responses, 1))


def normalised(value: float, scale: tuple[float, float]) -> float:
    lo, hi = scale
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"score {value:g} is outside the scale [{lo:g}, {hi:g}]")
    return (value - lo) / (hi - lo)


def parse_pointwise(text: str, pattern: str | None, scale: tuple[float, float]) -> float:
    """The normalised score of a pointwise reply: the first match's group 1. ValueError (the sample's error) when none
    or out of scale."""
    match = re.search(pattern or POINTWISE_PATTERN, text)
    if match is None or match.group(1) is None:
        raise ValueError(f"no score in the judge's reply {text[:120]!r}")
    return normalised(number(match.group(1)), scale)


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text[:40]!r} is not a number") from None


def expected_score(top: tuple[tuple[str, float], ...], scale: tuple[float, float]) -> float:
    """E[score] over the scale's integer tokens among the first reply token's candidates (token text stripped),
    probabilities renormalised over them; normalised to [0, 1]. ValueError when no candidate is a score."""
    lo, hi = int(scale[0]), int(scale[1])
    probs: dict[int, float] = {}
    for token, logprob in top:
        word = token.strip()
        if re.fullmatch(r"-?\d+", word) and lo <= int(word) <= hi:
            probs[int(word)] = probs.get(int(word), 0.0) + math.exp(logprob)  # " 7" and "7" are one score
    total = sum(probs.values())
    if not total > 0:
        shown = ", ".join(repr(t) for t, _ in top[:5])
        raise ValueError(f"no score token among the judge's first-token candidates ({shown})")
    return normalised(sum(v * p for v, p in probs.items()) / total, scale)


def parse_group(text: str, pattern: str | None, n: int, scale: tuple[float, float]) -> list[float | str]:
    """Per response of a group of n (in order), its normalised score or the error that stands for it: the first
    'Response i: score' match for each i; one missing, out of range or out of scale is that response's error."""
    found: dict[int, float | str] = {}
    for match in re.finditer(pattern or GROUP_PATTERN, text):
        index, value = match.group(1), match.group(2)
        if index is None or not index.strip().isdigit():
            continue  # a custom pattern's match that names no response
        i = int(index)
        if 1 <= i <= n and i not in found:
            try:
                found[i] = normalised(number(value or ""), scale)
            except ValueError as exc:
                found[i] = f"response {i}: {exc}"
    return [found.get(i, f"no score for response {i} in the judge's reply {text[:120]!r}") for i in range(1, n + 1)]


def ask_endpoint(judge: JudgeConfig, prompts: list[str]) -> list[Reply]:
    """Each prompt sent to the OpenAI-compatible endpoint (judge.concurrency calls in flight, each within
    judge.timeout_s, no retry): a failed call is its Reply's error."""
    try:
        client = _client(judge, judge.timeout_s)
    except Exception as exc:  # noqa: BLE001  (a URL the client refuses: every call's error)
        return [Reply(error=f"judge client failed: {type(exc).__name__}: {str(exc)[:200]}")] * len(prompts)
    want_top = judge.score == "logprobs"

    def one(prompt: str) -> Reply:
        common = {"model": judge.model, "max_tokens": judge.max_tokens, "temperature": judge.temperature}
        try:
            if judge.chat:
                messages = ([{"role": "system", "content": judge.system}] if judge.system else []) + [
                    {"role": "user", "content": prompt}
                ]
                extra = {"logprobs": True, "top_logprobs": judge.top_logprobs} if want_top else {}
                choice = client.chat.completions.create(messages=messages, **common, **extra).choices[0]
                top = choice.logprobs.content[0].top_logprobs if want_top and choice.logprobs.content else []
                return Reply(choice.message.content or "", tuple((t.token, t.logprob) for t in top))
            extra = {"logprobs": judge.top_logprobs} if want_top else {}
            choice = client.completions.create(prompt=prompt, **common, **extra).choices[0]
            first = choice.logprobs.top_logprobs[0] if want_top and choice.logprobs.top_logprobs else {}
            return Reply(choice.text or "", tuple(first.items()))
        except Exception as exc:  # noqa: BLE001  (any failed call, the openai client's or the transport's)
            detail = str(exc).splitlines()[0][:200] if str(exc) else ""
            return Reply(error=f"judge call failed: {type(exc).__name__}: {detail}")

    if not prompts:
        return []
    with ThreadPoolExecutor(min(judge.concurrency, len(prompts))) as pool:
        return list(pool.map(one, prompts))


def check_endpoint(judge: JudgeConfig, name: str) -> None:
    """Before a run: the endpoint answers and serves judge.model (one line naming what is wrong, else)."""
    if judge.api_key_env and not os.environ.get(judge.api_key_env):
        raise JudgeError(f"reward.judges.{name}.api_key_env: ${judge.api_key_env} is not set")
    try:
        served = [m.id for m in _client(judge, min(judge.timeout_s, 10.0)).models.list()]
    except Exception as exc:  # noqa: BLE001
        raise JudgeError(
            f"reward.judges.{name}: the endpoint {judge.base_url} did not answer ({type(exc).__name__})"
        ) from None
    if served and judge.model not in served:
        raise JudgeError(f"reward.judges.{name}: {judge.base_url} serves {served}, not {judge.model!r}")


def _client(judge: JudgeConfig, timeout_s: float):
    from openai import OpenAI

    key = os.environ.get(judge.api_key_env or "", "") or "none"  # the client wants a key; a keyless server ignores it
    return OpenAI(base_url=judge.base_url, api_key=key, timeout=timeout_s, max_retries=0)


def scored(judge: JudgeConfig, replies: list[Reply]) -> list[tuple[float, str | None]]:
    """Pointwise: each reply's (normalised score, None), or (0.0, error)."""
    out = []
    for reply in replies:
        if reply.error is not None:
            out.append((0.0, reply.error))
            continue
        try:
            value = (
                expected_score(reply.top, judge.scale)
                if judge.score == "logprobs"
                else parse_pointwise(reply.text, judge.score_pattern, judge.scale)
            )
            out.append((value, None))
        except ValueError as exc:
            out.append((0.0, str(exc)))
    return out


def judge_columns(judge: JudgeConfig, name: str, samples: list[dict], ask) -> dict[str, list]:
    """The judge's columns for `samples` (in the rollouts' order; each the prompt's fields with prompt_id, sample_idx
    and response): score_<name>, error_<name>, judge_prompt_<name>, judge_text_<name>. `ask` sends judge prompts
    (a list of str) and returns one Reply each, in order. Pointwise, a distinct (prompt, response) is asked once."""
    template = template_of(judge)
    if judge.mode == "pointwise":
        keys = [(s["prompt_id"], s["response"]) for s in samples]
        first = {}
        for key, sample in zip(keys, samples):
            first.setdefault(key, sample)
        distinct = list(first)
        prompts = [render(template, first[k]) for k in distinct]
        replies = ask(prompts)
        results = dict(zip(distinct, zip(prompts, replies, scored(judge, replies))))
        rows = [results[k] for k in keys]
        return columns(name, [(p, r.text, s, e) for p, r, (s, e) in rows])
    groups: dict = {}
    for i, sample in enumerate(samples):
        groups.setdefault(sample["prompt_id"], []).append(i)
    order = list(groups)
    for pid in order:
        groups[pid].sort(key=lambda i: samples[i]["sample_idx"])
    prompts = []
    for pid in order:
        members = [samples[i] for i in groups[pid]]
        fields = {**members[0], "responses": numbered([m["response"] for m in members]), "n": len(members)}
        prompts.append(render(template, fields))
    replies = ask(prompts)
    rows: list = [None] * len(samples)
    for pid, prompt, reply in zip(order, prompts, replies):
        members = groups[pid]
        if reply.error is not None:
            parsed = [reply.error] * len(members)
        else:
            parsed = parse_group(reply.text, judge.score_pattern, len(members), judge.scale)
        for i, value in zip(members, parsed):
            rows[i] = (prompt, reply.text, *((0.0, value) if isinstance(value, str) else (value, None)))
    return columns(name, rows)


def columns(name: str, rows: list[tuple]) -> dict[str, list]:
    """(judge prompt, judge text, score, error) per sample → the scores table's columns for judge `name`."""
    return {
        f"score_{name}": [r[2] for r in rows],
        f"error_{name}": [r[3] for r in rows],
        f"judge_prompt_{name}": [r[0] for r in rows],
        f"judge_text_{name}": [r[1] for r in rows],
    }
