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


# The circuit breaker looks at a judge's failure rate only once this many calls of a stage have ended: one early
# failure among the first few is not a dead judge.
BREAKER_CALLS = 8


def ask_endpoint(judge: JudgeConfig, prompts: list[str], name: str = "judge") -> list[Reply]:
    """Each prompt sent to the OpenAI-compatible endpoint (judge.concurrency calls in flight, no retry), each within a
    wall-clock deadline of judge.timeout_s: a failed or late call is its Reply's error. httpx bounds each read, not a
    call (a server that drips a byte every few seconds holds a call for as long as it likes), so the calls are async
    and each is cancelled at its deadline, as httpx's documentation recommends. Once BREAKER_CALLS calls have ended
    and more than judge.max_failure_rate of them failed, the judge stops calling (one line says so); with
    judge.on_failure=stop that line stops the run (JudgeError)."""
    if not prompts:
        return []
    breaker = _Breaker(judge, name)
    replies = _run_async(_ask_all(judge, prompts, breaker))
    if breaker.tripped and judge.on_failure == "stop":
        raise JudgeError(breaker.tripped)
    return replies


class _Breaker:
    """A judge's calls in one stage: counted as they end; tripped (a line naming the judge) past its failure rate."""

    def __init__(self, judge: JudgeConfig, name: str):
        self.judge, self.name = judge, name
        self.ended = self.failed = 0
        self.tripped: str | None = None

    def record(self, reply: Reply) -> None:
        self.ended += 1
        self.failed += reply.error is not None
        if (
            self.tripped is None
            and self.ended >= BREAKER_CALLS
            and self.failed > self.judge.max_failure_rate * self.ended
        ):
            self.tripped = (
                f"judge {self.name} stopped calling {self.judge.base_url}: {self.failed} of its first {self.ended} "
                f"calls failed (reward.judges.{self.name}.max_failure_rate {self.judge.max_failure_rate:g}); "
                f"last: {reply.error}"
            )
            print(self.tripped, flush=True)


async def _ask_all(judge: JudgeConfig, prompts: list[str], breaker: _Breaker) -> list[Reply]:
    import asyncio

    from openai import AsyncOpenAI

    try:
        client = AsyncOpenAI(base_url=judge.base_url, api_key=_api_key(judge), timeout=judge.timeout_s, max_retries=0)
    except Exception as exc:  # noqa: BLE001  (a URL the client refuses: every call's error)
        return [Reply(error=f"judge client failed: {type(exc).__name__}: {str(exc)[:200]}")] * len(prompts)
    gate = asyncio.Semaphore(judge.concurrency)

    async def one(prompt: str) -> Reply:
        async with gate:
            if breaker.tripped:
                return Reply(error=breaker.tripped)
            try:
                reply = await asyncio.wait_for(_call(client, judge, prompt), judge.timeout_s)
            except TimeoutError:
                reply = Reply(error=f"judge call exceeded its deadline of {judge.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001  (any failed call, the openai client's or the transport's)
                detail = str(exc).splitlines()[0][:200] if str(exc) else ""
                reply = Reply(error=f"judge call failed: {type(exc).__name__}: {detail}")
            breaker.record(reply)
            return reply

    async with client:
        return list(await asyncio.gather(*(one(p) for p in prompts)))


async def _call(client, judge: JudgeConfig, prompt: str) -> Reply:
    common = {"model": judge.model, "max_tokens": judge.max_tokens, "temperature": judge.temperature}
    want_top = judge.score == "logprobs"
    if judge.chat:
        messages = ([{"role": "system", "content": judge.system}] if judge.system else []) + [
            {"role": "user", "content": prompt}
        ]
        extra = {"logprobs": True, "top_logprobs": judge.top_logprobs} if want_top else {}
        choice = (await client.chat.completions.create(messages=messages, **common, **extra)).choices[0]
        top = choice.logprobs.content[0].top_logprobs if want_top and choice.logprobs.content else []
        return Reply(choice.message.content or "", tuple((t.token, t.logprob) for t in top))
    extra = {"logprobs": judge.top_logprobs} if want_top else {}
    choice = (await client.completions.create(prompt=prompt, **common, **extra)).choices[0]
    first = choice.logprobs.top_logprobs[0] if want_top and choice.logprobs.top_logprobs else {}
    return Reply(choice.text or "", tuple(first.items()))


def _run_async(coro):
    """The coroutine's result, from a thread with no event loop running (a new thread where one runs)."""
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def cut(reply: Reply, limit: int) -> tuple[Reply, bool]:
    """The reply with its text cut to `limit` characters, and whether it was (before anything parses or stores it)."""
    if reply.text is None or len(reply.text) <= limit:
        return reply, False
    return Reply(reply.text[:limit], reply.top, reply.error), True


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

    return OpenAI(base_url=judge.base_url, api_key=_api_key(judge), timeout=timeout_s, max_retries=0)


def _api_key(judge: JudgeConfig) -> str:
    """The client wants a key; a keyless server ignores it."""
    return os.environ.get(judge.api_key_env or "", "") or "none"


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
    limit = judge.max_reply_chars

    def ask_cut(prompts: list[str]) -> tuple[list[Reply], list[bool]]:
        pairs = [cut(reply, limit) for reply in ask(prompts)]
        return [r for r, _ in pairs], [c for _, c in pairs]

    if judge.mode == "pointwise":
        keys = [(s["prompt_id"], s["response"]) for s in samples]
        first = {}
        for key, sample in zip(keys, samples):
            first.setdefault(key, sample)
        distinct = list(first)
        prompts = [render(template, first[k]) for k in distinct]
        replies, cuts = ask_cut(prompts)
        results = dict(zip(distinct, zip(prompts, replies, scored(judge, replies), cuts)))
        rows = [results[k] for k in keys]
        return columns(name, [(p, r.text, s, e, c) for p, r, (s, e), c in rows], judge)
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
    replies, cuts = ask_cut(prompts)
    rows: list = [None] * len(samples)
    for pid, prompt, reply, was_cut in zip(order, prompts, replies, cuts):
        members = groups[pid]
        if reply.error is not None:
            parsed = [reply.error] * len(members)
        else:
            parsed = parse_group(reply.text, judge.score_pattern, len(members), judge.scale)
        for i, value in zip(members, parsed):
            rows[i] = (prompt, reply.text, *((0.0, value) if isinstance(value, str) else (value, None)), was_cut)
    return columns(name, rows, judge)


def columns(name: str, rows: list[tuple], judge: JudgeConfig) -> dict[str, list]:
    """(judge prompt, judge text, score, error, reply cut) per sample → the scores table's columns for judge `name`.
    Where more of the samples than judge.max_failure_rate got an error (the calls', or replies that could not be read),
    one line says so; with judge.on_failure=stop it stops the run."""
    errors = [r[3] for r in rows if r[3] is not None]
    if rows and len(errors) > judge.max_failure_rate * len(rows):
        line = (
            f"judge {name}: {len(errors)} of {len(rows)} samples got no score "
            f"(reward.judges.{name}.max_failure_rate {judge.max_failure_rate:g}); first: {errors[0]}"
        )
        if judge.on_failure == "stop":
            raise JudgeError(line)
        print(line, flush=True)
    return {
        f"score_{name}": [r[2] for r in rows],
        f"error_{name}": [r[3] for r in rows],
        f"judge_prompt_{name}": [r[0] for r in rows],
        f"judge_text_{name}": [r[1] for r in rows],
        f"judge_truncated_{name}": [r[4] for r in rows],
    }


def judge_tokenizer(judge: JudgeConfig, name: str):
    """A local judge's tokenizer, with the chat template judge.chat needs (one line naming the judge, else)."""
    from tasks.data.formatting import load_tokenizer

    tokenizer = load_tokenizer(judge.model_path)
    if judge.chat and not getattr(tokenizer, "chat_template", None):
        raise JudgeError(f"reward.judges.{name}: {judge.model_path} has no chat template (set chat: false)")
    return tokenizer


def check_judges(reward, columns: set[str]) -> None:
    """Each LLM judge before any engine starts: its template's fields exist, a local judge's folder holds a model (with
    a chat template when judge.chat), an endpoint answers and serves the model named."""
    from storage.model_ids import model_fingerprint

    for name, judge in reward.judges.items():
        check_template(judge, name, columns)
        if judge.model_path:
            model_fingerprint(judge.model_path)
            judge_tokenizer(judge, name)
        else:
            check_endpoint(judge, name)
