"""Prompt rows from reasoning-gym's procedural tasks (106 of them: leg_counting, chain_sum, countdown, gsm_symbolic,
...), generated here from a seed, offline, for a `data.sources` generator (tasks/data/data_sources.py).

Each row is one of reasoning-gym's entries: the question as a user message after a system prompt (by default
reasoning-gym's own, which asks for the final answer in <answer> tags), the oracle answer, the task's name (`source`)
and the whole entry as JSON (`entry`), which the `reasoning_gym` reward hands back to the task's own `score_answer`.
Train rows come from `seed`, held-out rows from `eval_seed`; a held-out question also asked in training is dropped, so
the splits share no question. `balance_eval_labels` draws the held-out rows with an equal share of each answer.
Imports: reasoning-gym (2 s: it registers every task) when the rows are generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import chain, islice

import polars as pl

from schemas.errors import UserError
from tasks.data.datasets import MESSAGES


class SourceError(UserError, ValueError):
    pass


def entries(task: str, config: dict, size: int, seed: int) -> list[dict]:
    """`size` entries of reasoning-gym's task `task` with its settings `config`; one line naming the task for an unknown
    name or a setting it rejects."""
    return list(drawn(task, config, size, seed))


def drawn(task: str, config: dict, size: int, seed: int) -> Iterator[dict]:
    """The same entries, each made when it is read (entry i from seed + i: a balanced held-out set reads on only as
    far as it needs)."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise SourceError(
            f"reasoning-gym has no task {task!r} (it has {len(DATASETS)}: reasoning_gym.factory.DATASETS)"
        )

    def rejected(exc: Exception) -> SourceError:
        return SourceError(f"reasoning-gym task {task!r} rejects its settings {config}: {type(exc).__name__}: {exc}")

    try:
        dataset = reasoning_gym.create_dataset(task, **{**config, "size": size, "seed": seed})
    except Exception as exc:  # noqa: BLE001  (its config dataclass raises TypeError, its validate AssertionError)
        raise rejected(exc) from None

    def each() -> Iterator[dict]:
        for i in range(size):
            try:
                entry = dataset[i]
            except Exception as exc:  # noqa: BLE001  (an entry its settings cannot make)
                raise rejected(exc) from None
            yield entry

    return each()


def level_config(task: str, config: dict, level: int) -> dict:
    """The task's settings at a level of reasoning-gym's own curriculum for it (every attribute at that level, or at
    its last where it has fewer), over `config`."""
    import dataclasses

    from reasoning_gym.factory import create_curriculum, has_curriculum

    if not has_curriculum(task):
        raise SourceError(f"reasoning-gym task {task!r} has no curriculum of difficulty levels")
    curriculum = create_curriculum(task)
    curriculum.set_global_level(level)
    try:
        made = curriculum.generate_configuration(defaults=config)
    except Exception as exc:  # noqa: BLE001  (the config dataclass raises TypeError for an unknown setting)
        raise SourceError(f"reasoning-gym task {task!r} rejects its settings {config}: {type(exc).__name__}: {exc}")
    return {k: v for k, v in dataclasses.asdict(made).items() if k not in ("size", "seed")}


def held_out(
    task: str, config: dict, n_eval: int, eval_seed: int, asked: set[str], what: str, balanced_draws: int = 0
) -> list[dict]:
    """n_eval entries from eval_seed whose questions training does not ask (drawn twice over, so that dropping those
    still leaves n_eval); with `balanced_draws`, an equal share of each answer from up to that many (`balanced`)."""
    if balanced_draws:
        fresh = (e for e in drawn(task, config, balanced_draws, eval_seed) if e["question"] not in asked)
        return balanced(fresh, n_eval, f"{what}.reasoning_gym.balance_eval_labels", balanced_draws)
    fresh = [e for e in entries(task, config, 2 * n_eval, eval_seed) if e["question"] not in asked]
    if len(fresh) < n_eval:
        raise SourceError(
            f"{what}: only {len(fresh)} of {2 * n_eval} held-out questions are not asked in training; its settings "
            f"allow too few distinct questions for n_eval={n_eval}"
        )
    return fresh[:n_eval]


def balanced(candidates: Iterable[dict], n_eval: int, what: str, draws: int) -> list[dict]:
    """n_eval of the candidates, in their order, with an equal share of each answer (the labels: the distinct answers
    among the first 2 × n_eval; where n_eval does not divide, the first labels in sorted order get one more), so
    that always giving one answer scores 1 / labels. A task with more than n_eval / 2 labels is not categorical, and
    a label too rare to fill its share within `draws` is one line naming it."""
    candidates = iter(candidates)
    first = list(islice(candidates, 2 * n_eval))
    labels = sorted({str(e["answer"]) for e in first})
    if len(labels) > n_eval // 2:
        raise SourceError(
            f"{what}: {len(labels)} distinct answers among the first {len(first)} held-out entries: balancing is for "
            f"a task with few answers (at most n_eval / 2 = {n_eval // 2})"
        )
    share = {label: n_eval // len(labels) + (i < n_eval % len(labels)) for i, label in enumerate(labels)}
    picked = []
    for entry in chain(first, candidates):
        label = str(entry["answer"])
        if share.get(label, 0) > 0:
            picked.append(entry)
            share[label] -= 1
            if len(picked) == n_eval:
                return picked
    short = {label: left for label, left in share.items() if left}
    raise SourceError(
        f"{what}: {len(picked)} of n_eval={n_eval} in {draws} draws; short of "
        + ", ".join(f"{left} answering {label!r}" for label, left in short.items())
        + " (lower n_eval or leave the labels unbalanced)"
    )


def entry_frame(rows: list[tuple[str, dict]], ids: list[str], system: str | None) -> pl.DataFrame:
    """Prompt rows of (source, entry) pairs: prompt_id, prompt (a system and a user message), answer, source, entry."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    system = SYSTEM_PROMPTS["default"] if system is None else system
    return pl.DataFrame(
        {
            "prompt_id": ids,
            "prompt": [
                [{"role": "system", "content": system}, {"role": "user", "content": e["question"]}] for _, e in rows
            ],
            "answer": [str(e["answer"]) for _, e in rows],
            "source": [name for name, _ in rows],
            "entry": [json.dumps(e, sort_keys=True, default=str) for _, e in rows],
        },
        schema={"prompt_id": pl.Utf8, "prompt": MESSAGES, "answer": pl.Utf8, "source": pl.Utf8, "entry": pl.Utf8},
    )
