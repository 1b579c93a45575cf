"""Built-in task `reasoning_gym`: prompt files from reasoning-gym's procedural tasks (106 of them: leg_counting,
chain_sum, countdown, gsm_symbolic, ...), generated here from a seed, offline, several tasks mixed by weight.

Each row is one of reasoning-gym's entries: the question as a user message after a system prompt (by default
reasoning-gym's own, which asks for the final answer in <answer> tags), the oracle answer, the task's name (`source`)
and the whole entry as JSON (`entry`), which the `reasoning_gym` reward hands back to the task's own `score_answer`.
Train rows come from `seed`, held-out rows from `eval_seed`; a held-out question also asked in training is dropped, so
the splits share no question. The optional demonstrations (`sft.parquet`) answer in the format alone
(`<answer>292</answer>`), without reasoning.
Imports: reasoning-gym (2 s: it registers every task) when the files are written.
"""

from __future__ import annotations

import json

import polars as pl

from schemas.errors import UserError
from tasks.data.datasets import MESSAGES


class SourceError(UserError, ValueError):
    pass


def shares(total: int, weights: dict[str, float]) -> dict[str, int]:
    """`total` rows dealt by weight, exactly: floors first, then one more to the largest remainders (ties to the
    earlier name in the config's order)."""
    norm = sum(weights.values())
    exact = {name: total * w / norm for name, w in weights.items()}
    counts = {name: int(x) for name, x in exact.items()}
    order = sorted(weights, key=lambda name: (-(exact[name] - counts[name]), list(weights).index(name)))
    for name in order[: total - sum(counts.values())]:
        counts[name] += 1
    return counts


def entries(task: str, config: dict, size: int, seed: int) -> list[dict]:
    """`size` entries of reasoning-gym's task `task` with its settings `config`; one line naming the task for an unknown
    name or a setting it rejects."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        raise SourceError(
            f"reasoning-gym has no task {task!r} (it has {len(DATASETS)}: reasoning_gym.factory.DATASETS)"
        )
    try:
        dataset = reasoning_gym.create_dataset(task, **{**config, "size": size, "seed": seed})
        return [dataset[i] for i in range(size)]
    except Exception as exc:  # noqa: BLE001  (its config dataclass raises TypeError, its validate AssertionError)
        raise SourceError(f"reasoning-gym task {task!r} rejects its settings {config}: {type(exc).__name__}: {exc}")


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


def held_out(task: str, config: dict, n_eval: int, eval_seed: int, asked: set[str], what: str) -> list[dict]:
    """n_eval entries from eval_seed whose questions training does not ask (drawn twice over, so that dropping those
    still leaves n_eval)."""
    fresh = [e for e in entries(task, config, 2 * n_eval, eval_seed) if e["question"] not in asked]
    if len(fresh) < n_eval:
        raise SourceError(
            f"{what}: only {len(fresh)} of {2 * n_eval} held-out questions are not asked in training; its settings "
            f"allow too few distinct questions for n_eval={n_eval}"
        )
    return fresh[:n_eval]


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


def make_files(
    tasks: dict[str, tuple[float, dict]],
    n_train: int,
    n_eval: int,
    seed: int,
    eval_seed: int,
    system_prompt: str | None,
) -> dict[str, pl.DataFrame]:
    """train (n_train rows dealt by weight), eval (n_eval rows per task) and sft files."""
    counts = shares(n_train, {name: weight for name, (weight, _) in tasks.items()})
    train, evals = [], []
    for name, (_, config) in tasks.items():
        mine = entries(name, config, counts[name], seed)
        asked = {e["question"] for e in mine}
        train += [(name, e) for e in mine]
        evals += [(name, e) for e in held_out(name, config, n_eval, eval_seed, asked, f"reasoning-gym task {name!r}")]

    def frame(rows, prefix):
        return entry_frame(rows, [f"{prefix}-{name}-{i:06d}" for i, (name, _) in enumerate(rows)], system_prompt)

    train_frame = frame(train, "train")
    sft = train_frame.select(
        "prompt_id", "prompt", pl.format("<answer>{}</answer>", pl.col("answer")).alias("response")
    )
    return {"train": train_frame, "eval": frame(evals, "eval"), "sft": sft}
