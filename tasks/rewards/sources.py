"""Reward sources, one family: rule functions (built-ins such as `code_tests` among them), a trained reward model,
a process reward model and LLM judges. Which sources a run's reward uses, in which order, and the score columns each
writes with their weights are facts of its config (`RewardConfig.source_columns`, schemas/config.py: the config's
own checks need them, and must not import this family, whose code imports the config). Each source here says what
identifies it for a stage's fingerprint (`identities`: a model's files), what can be checked before any engine starts
(`check`), and how it scores (`add`: its columns added to the scores table, weighted into `reward`, its errors into
`error`). Every question of the kind "which parts are weighted" or "what does the reward read" asks the config
(`weighted_parts`) or the family (`identities`, `check_all`, `add_all`), never a source by name.

Scoring needs engines only the stage has (a torch worker for the reward models, rlpipe's vLLM engine for a local
judge, the policy's tokenizer for step ends): the stage hands them in as `Calls`. A new source is one class here,
registered, and its config section with its columns (schemas/config.py); docs/architecture.md, "How to extend",
has the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import polars as pl

from tasks.registry import Registry


@dataclass(frozen=True)
class Calls:
    """What scoring asks of the stage, and the rows it scores. `reward_model(data)` and `process_model(data)` score
    prompt_token_ids + response_token_ids (+ step_ends) rows in a torch worker; `local_judge(name, judge, prompts)`
    answers a judge's prompts with rlpipe's own vLLM engine; `step_ends()` finds each response's step ends with the
    policy's tokenizer."""

    rollouts: pl.DataFrame
    prompts: pl.DataFrame
    turns: pl.DataFrame | None
    max_tokens: int
    answer_key: str | None
    step_ends: Callable[[], pl.Series]
    reward_model: Callable[[pl.DataFrame], pl.Series]
    process_model: Callable[[pl.DataFrame], pl.Series]
    local_judge: Callable


class RewardSource:
    """The interface; each method's default is "nothing". The columns it writes: RewardConfig.source_columns."""

    def identities(self, reward, fingerprint: Callable[[str], str], tokenizer: Callable[[str], str]) -> dict:
        """What identifies the models it reads, for a stage's fingerprint."""
        return {}

    def check(self, cfg, columns: set[str], trains_the_prm: bool) -> None:
        """Before any engine starts: one line naming what is wrong (a UserError), else nothing."""

    def add(self, reward, scores: pl.DataFrame | None, calls: Calls, name: str) -> pl.DataFrame:
        raise NotImplementedError


REWARD_SOURCES: Registry = Registry("reward source")


def _weighted(scores: pl.DataFrame, column: str, weight: float) -> pl.DataFrame:
    return scores.with_columns((pl.col("reward") + weight * pl.col(column)).alias("reward"))


class Functions(RewardSource):
    """reward.functions: your functions and the built-ins, in the reward pool (tasks/rewards/scoring.py)."""

    def check(self, cfg, columns, trains_the_prm):
        from tasks.rewards.loader import preflight

        preflight(cfg.reward, columns)

    def add(self, reward, scores, calls, name):
        from tasks.rewards.scoring import score_frame

        scores = score_frame(calls.rollouts, calls.prompts, reward, calls.max_tokens, calls.answer_key, calls.turns)
        if reward.source_columns()["functions"].step_parts:
            scores = scores.with_columns(calls.step_ends())
        return scores


class RewardModel(RewardSource):
    """reward.kind=model: a reward model trained by `rlpipe rm-train`, scored into score_model."""

    def identities(self, reward, fingerprint, tokenizer):
        return {"reward_model": fingerprint(reward.model_path)}

    def check(self, cfg, columns, trains_the_prm):
        from storage.model_ids import model_fingerprint

        model_fingerprint(cfg.reward.model_path)

    def add(self, reward, scores, calls, name):
        from tasks.rewards.scoring import RewardError

        data = calls.rollouts.select("prompt_token_ids", pl.col("token_ids").alias("response_token_ids"))
        model_scores = calls.reward_model(data)
        if not model_scores.is_finite().all():
            raise RewardError("the reward model returned a non-finite score")
        return _weighted(scores.with_columns(model_scores.alias("score_model")), "score_model", reward.model_weight)


class ProcessModel(RewardSource):
    """reward.process_model: its probability that each step is right (steps_prm), aggregated into score_prm."""

    def identities(self, reward, fingerprint, tokenizer):
        return {"process_model": fingerprint(reward.process_model.path)}

    def check(self, cfg, columns, trains_the_prm):

        if not trains_the_prm:  # (a run that trains it does not read it)
            check_process_model(cfg.reward.process_model.path, cfg.model.path)

    def add(self, reward, scores, calls, name):
        from tasks.rewards.scoring import RewardError
        from tasks.rewards.steps import aggregate_steps

        pm = reward.process_model
        ends = scores["step_ends"] if "step_ends" in scores.columns else calls.step_ends()
        data = calls.rollouts.select("prompt_token_ids", pl.col("token_ids").alias("response_token_ids"))
        steps = calls.process_model(data.with_columns(ends.alias("step_ends")))
        if not steps.explode().drop_nulls().is_finite().all():
            raise RewardError("the process reward model returned a non-finite step score")
        score = pl.Series("score_prm", [aggregate_steps(v, pm.step_aggregate) for v in steps.to_list()], pl.Float64)
        scores = scores.with_columns(ends.alias("step_ends"), steps.alias("steps_prm"), score)
        return _weighted(scores, "score_prm", pm.weight)


class Judges(RewardSource):
    """reward.judges: LLM judges, on an OpenAI-compatible endpoint or rlpipe's own engine (tasks/rewards/judge.py)."""

    def identities(self, reward, fingerprint, tokenizer):
        # A local judge's tokenizer writes its prompts (its chat template): part of its identity.
        local = {n: j.model_path for n, j in reward.judges.items() if j.model_path}
        return {f"judge_{n}": fingerprint(path) + tokenizer(path) for n, path in local.items()}

    def check(self, cfg, columns, trains_the_prm):
        from tasks.rewards.judge import check_judges

        check_judges(cfg.reward, columns)

    def add(self, reward, scores, calls, name):
        from tasks.rewards.judge import ask_endpoint, judge_columns
        from tasks.rewards.scoring import joined_errors, prompt_arguments

        shared = prompt_arguments(calls.prompts, calls.answer_key)
        for fields in shared.values():  # a judge reads the question, not the policy's chat markup around it
            users = [m["content"] for m in fields["messages"] if m["role"] == "user"]
            fields["prompt"] = users[-1] if fields["chat"] and users else fields["prompt"]
        samples = [
            {**shared[pid], "prompt_id": pid, "sample_idx": k, "response": text}
            for pid, k, text in calls.rollouts.select("prompt_id", "sample_idx", "text").iter_rows()
        ]
        for judge_name, judge in reward.judges.items():
            if judge.model_path:
                ask = partial(calls.local_judge, judge_name, judge, f"judge-{judge_name}-{name}")
            else:
                ask = partial(ask_endpoint, judge, name=judge_name)
            cols = judge_columns(judge, judge_name, samples, ask)
            scores = scores.with_columns(pl.Series(k, v, dtype=_judge_dtype(k)) for k, v in cols.items())
            scores = _weighted(scores, f"score_{judge_name}", judge.weight).with_columns(
                joined_errors(["error", f"error_{judge_name}"]).alias("error")
            )
        return scores


def _judge_dtype(column: str):
    """A judge's column's type (tasks/rewards/judge.py, `columns`)."""
    if column.startswith("judge_truncated_"):
        return pl.Boolean
    return pl.Float64 if column.startswith("score_") else pl.Utf8


for _name, _source in (
    ("functions", Functions()),
    ("model", RewardModel()),
    ("process_model", ProcessModel()),
    ("judges", Judges()),
):
    REWARD_SOURCES.register(_name)(_source)


def sources(reward) -> list[RewardSource]:
    """The run's sources, in scoring order (the config's: RewardConfig.source_columns)."""
    return [REWARD_SOURCES.get(name) for name in reward.source_columns()]


def outcome_parts(reward) -> tuple[tuple[str, float], ...]:
    """The weighted parts that score a whole response: not the aggregates of per-step lists (score_<x> of steps_<x>)."""
    steps = [c for s in reward.source_columns().values() for c, _ in s.step_parts]
    per_step = {"score_" + c.removeprefix("steps_") for c in steps}
    return tuple((c, w) for c, w in reward.weighted_parts() if c not in per_step)


def identities(reward, fingerprint: Callable[[str], str], tokenizer: Callable[[str], str]) -> dict[str, str]:
    """The identities of the models the reward reads, for a stage's fingerprint (the functions' source code enters
    through the stage's salt: tasks/rewards/loader.py, source_hash)."""
    out: dict[str, str] = {}
    for source in sources(reward):
        out.update(source.identities(reward, fingerprint, tokenizer))
    return out


def unscored(reward, scores: pl.DataFrame) -> list[tuple[str, str]]:
    """(its config key, its first error) for each weighted part of which no row of `scores` got a score: every one
    holds an error (a function that always raises, a judge whose replies never hold a score), so its column is all
    zeros that an update would take for scores. A part without an error column (a reward model's: its failure fails
    the stage) never is; nor is any part of no rows."""
    out = []
    for kind, columns in reward.source_columns().items():  # scoring order
        for column, weight in columns.parts:
            name = column.removeprefix("score_")
            errors = scores.get_column(f"error_{name}", default=None)
            if weight and scores.height and errors is not None and errors.null_count() == 0:
                out.append((f"reward.{kind}.{name}", errors[0]))
    return out


def check_all(cfg, columns: set[str], trains_the_prm: bool = False) -> None:
    for source in sources(cfg.reward):
        source.check(cfg, columns, trains_the_prm)


def add_all(reward, calls: Calls, name: str) -> pl.DataFrame:
    """The scores table: each source's columns, in order, weighted into `reward`, errors into `error`."""
    scores = None
    for source in sources(reward):
        scores = source.add(reward, scores, calls, name)
    return scores


def check_process_model(path: str, model_path: str) -> None:
    """reward.process_model reads the policy's token ids with a token-classification head: a folder `rlpipe rm-train`
    wrote under reward_model.objective process, with the policy's vocabulary."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer

    from schemas.errors import TeacherError
    from storage.model_ids import model_fingerprint

    model_fingerprint(path)
    kinds = json.loads(Path(path, "config.json").read_text()).get("architectures") or []
    if not any(k.endswith("ForTokenClassification") for k in kinds):
        raise TeacherError(
            f"reward.process_model.path {path} is a {', '.join(kinds) or 'model'} folder, not a process reward model "
            "(a token-classification head: rlpipe rm-train with reward_model.objective process)"
        )
    if AutoTokenizer.from_pretrained(path).get_vocab() != AutoTokenizer.from_pretrained(model_path).get_vocab():
        raise TeacherError(
            f"reward.process_model.path {path}: its tokenizer's vocabulary differs from the policy's: it must read the "
            "policy's own token ids"
        )
