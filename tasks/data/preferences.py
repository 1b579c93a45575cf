"""Preference data, pure: K-wise rankings from scored samples, pairs from rankings, and validated loading
of a user's pairs or rankings (Parquet or JSONL). The stage that writes them is tasks/stages/preference_data.py.

A ranking is one prompt with K ≥ 2 distinct responses and dense ranks (1 = best); equal ranks are ties and
give no pair. A pair is (prompt, chosen, rejected) for every two responses with different ranks.
"""

from __future__ import annotations

import random
from pathlib import Path

import polars as pl

from schemas.errors import UserError
from schemas.tables import LIST_I32, PREFERENCE_PAIRS, PREFERENCE_RANKINGS
from tasks.data.datasets import DatasetError, formatted_prompts, prompt_column, read_files

SPLITS = ("train", "heldout")


class PreferenceDataError(UserError, ValueError):
    pass


def rankings_from_samples(samples: pl.DataFrame) -> pl.DataFrame:
    """samples: prompt_id, prompt, prompt_token_ids, response, reward → one ranking per prompt, ranked by reward
    (higher is better; equal rewards tie). A response sampled twice is kept once. Prompts whose responses all tie say
    nothing about preference and are dropped."""
    ranked = samples.unique(["prompt_id", "response"], keep="first", maintain_order=True).with_columns(
        pl.col("reward").rank("dense", descending=True).over("prompt_id").cast(pl.Int32).alias("rank")
    )
    rankings = ranked.group_by("prompt_id", maintain_order=True).agg(
        pl.col("prompt").first(),
        pl.col("prompt_token_ids").first(),
        pl.col("response").alias("responses"),
        pl.col("rank").alias("ranks"),
    )
    return rankings.filter(pl.col("ranks").list.n_unique() > 1)


def pairs_from_rankings(rankings: pl.DataFrame) -> pl.DataFrame:
    """Every (better, worse) pair of each ranking, numbered per prompt in response order."""
    long = (
        rankings.select("prompt_id", "prompt", "prompt_token_ids", "split", "responses", "ranks")
        .explode("responses", "ranks")
        .with_columns(pl.int_range(pl.len()).over("prompt_id").alias("i"))
    )
    a = long.rename({"responses": "chosen", "ranks": "rank_a", "i": "i_a"})
    b = long.select(
        "prompt_id", pl.col("responses").alias("rejected"), pl.col("ranks").alias("rank_b"), pl.col("i").alias("i_b")
    )
    pairs = (
        a.join(b, on="prompt_id")
        .filter(pl.col("rank_a") < pl.col("rank_b"))
        .sort("prompt_id", "i_a", "i_b", maintain_order=True)
    )
    pairs = pairs.with_columns(pl.int_range(pl.len()).over("prompt_id").cast(pl.Int32).alias("pair_idx"))
    return PREFERENCE_PAIRS.validate(pairs.select(list(PREFERENCE_PAIRS.columns)))


def assign_splits(rankings: pl.DataFrame, heldout_fraction: float, seed: int) -> pl.DataFrame:
    """A seeded random `heldout_fraction` of the prompts is held out (at least one, never all); a prompt's rows (a
    PRM's several responses to it) all go to one side."""
    ids = sorted(set(rankings["prompt_id"].to_list()))
    random.Random(seed).shuffle(ids)
    n = min(max(1, round(heldout_fraction * len(ids))), len(ids) - 1)
    held = set(ids[:n])
    return rankings.with_columns(
        pl.when(pl.col("prompt_id").is_in(list(held))).then(pl.lit("heldout")).otherwise(pl.lit("train")).alias("split")
    )


def _require(df: pl.DataFrame, path: str, columns: dict[str, pl.DataType]) -> None:
    for col, dtype in columns.items():
        if col not in df.columns:
            raise PreferenceDataError(f"preference data {path}: missing column {col!r}")
        if df.schema[col] != dtype:
            raise PreferenceDataError(
                f"preference data {path}: column {col!r} has dtype {df.schema[col]}, expected {dtype}"
            )
        bad = _first_bad_row(df, pl.col(col).is_null())
        if bad is not None:
            raise PreferenceDataError(f"preference data {path}: row {bad}: null {col!r}")


def _first_bad_row(df: pl.DataFrame, condition: pl.Expr) -> int | None:
    rows = df.filter(condition)["_row"]
    return int(rows[0]) if len(rows) else None


def load_preferences(path: str | Path, heldout_fraction: float, seed: int, formatter) -> pl.DataFrame:
    """A user's file as rankings. Pairs (prompt, chosen, rejected) become K=2 rankings; rankings (prompt,
    responses, ranks) are checked. The prompt is a string or chat messages, formatted by `formatter` (a
    tasks.data.formatting.PromptFormatter) into `prompt` (text) and `prompt_token_ids`. `prompt_id` and `split`
    (train/heldout) are optional."""
    try:
        df = read_files([str(path)], "preference.data")
        prompts = prompt_column(df, "prompt", "preference.data")
    except DatasetError as exc:
        raise PreferenceDataError(str(exc)) from None
    path = str(path)
    if "chosen" in df.columns or "rejected" in df.columns:
        _require(df, path, {"chosen": pl.Utf8, "rejected": pl.Utf8})
        row = _first_bad_row(df, pl.col("chosen") == pl.col("rejected"))
        if row is not None:
            raise PreferenceDataError(f"preference data {path}: row {row}: chosen and rejected are the same response")
        df = df.with_columns(
            pl.concat_list("chosen", "rejected").alias("responses"), pl.lit([1, 2], pl.List(pl.Int32)).alias("ranks")
        )
    else:
        _require(df, path, {"responses": pl.List(pl.Utf8)})
        if (
            "ranks" not in df.columns
            or not isinstance(df.schema["ranks"], pl.List)
            or not df.schema["ranks"].inner.is_integer()
        ):
            raise PreferenceDataError(
                f"preference data {path}: needs columns prompt, chosen, rejected (pairs) or prompt, responses, "
                "ranks (a list of integers)"
            )
        df = df.with_columns(pl.col("ranks").cast(pl.List(pl.Int32)))
        for condition, problem in (
            (pl.col("responses").list.len() != pl.col("ranks").list.len(), "responses and ranks differ in length"),
            (pl.col("responses").list.len() < 2, "fewer than 2 responses"),
            (pl.col("ranks").list.n_unique() < 2, "every response has the same rank (no preference)"),
            (pl.col("ranks").list.min() < 1, "ranks start at 1 (best)"),
            (pl.col("responses").list.n_unique() < pl.col("responses").list.len(), "a response appears twice"),
        ):
            row = _first_bad_row(df, condition)
            if row is not None:
                raise PreferenceDataError(f"preference data {path}: row {row}: {problem}")
    formatted = formatted_prompts(formatter, prompts.to_list(), df, "preference.data", PreferenceDataError)
    df = df.with_columns(
        pl.Series("prompt", [f.text for f in formatted]),
        pl.Series("prompt_token_ids", [f.token_ids for f in formatted], dtype=LIST_I32),
    )
    if "prompt_id" not in df.columns:
        df = df.with_columns(pl.format("p{}", pl.int_range(pl.len())).alias("prompt_id"))
    elif df["prompt_id"].cast(pl.Utf8).is_duplicated().any():
        # A pairs file may hold several pairs of one prompt: each pair is its own element.
        df = df.with_columns(
            pl.format("{}#{}", pl.col("prompt_id"), pl.int_range(pl.len()).over("prompt_id")).alias("prompt_id")
        )
    df = df.with_columns(pl.col("prompt_id").cast(pl.Utf8))
    if "split" in df.columns:
        row = _first_bad_row(df, ~pl.col("split").is_in(SPLITS))
        if row is not None:
            raise PreferenceDataError(f"preference data {path}: row {row}: split must be 'train' or 'heldout'")
    else:
        df = assign_splits(df, heldout_fraction, seed)
    return PREFERENCE_RANKINGS.validate(df.select(list(PREFERENCE_RANKINGS.columns)))
