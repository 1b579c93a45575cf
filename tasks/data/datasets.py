"""Users' data files: Parquet or JSONL, by path or glob, read and checked with one-line errors that name the file,
the row and the column, before any engine starts.

`prompt_rows` maps a prompt dataset onto rlpipe's columns (data section): `prompt_id`, `prompt` (a string or chat
messages), `answer` (the ground truth as text, for display and the built-in rewards) and `extra`, a struct of every
other column, untouched, which the reward functions receive as keyword arguments.
"""

from __future__ import annotations

import glob
import hashlib
import json
import random
from pathlib import Path

import polars as pl

from schemas.config import RESERVED_ARGUMENTS, DataConfig
from schemas.errors import UserError
from storage.stage_io import sha256_file
from tasks.data.formatting import FormattedPrompt, FormattingError

MESSAGES = pl.List(pl.Struct({"role": pl.Utf8, "content": pl.Utf8}))
ROLES = ("system", "user", "assistant", "tool")


class DatasetError(UserError, ValueError):
    pass


def resolve_files(patterns: list[str], what: str) -> list[Path]:
    """Every file the paths and globs name, in order (a glob's matches sorted); none is an error."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        found = [Path(m) for m in matches if Path(m).is_file()]
        if not found:
            raise DatasetError(
                f"{what}: "
                + (f"no file matches {pattern!r}" if glob.has_magic(pattern) else f"file not found: {pattern}")
            )
        files += [f for f in found if f not in files]
    return files


def read_file(path: Path) -> pl.DataFrame:
    try:
        if path.suffix in (".jsonl", ".json", ".ndjson"):
            return pl.read_ndjson(path, infer_schema_length=None)
        return pl.read_parquet(path)
    except Exception as exc:  # polars raises several types for an unreadable file
        raise DatasetError(
            f"cannot read {path} (Parquet or JSONL expected): {str(exc).splitlines()[0][:200]}"
        ) from None


def read_files(patterns: list[str], what: str) -> pl.DataFrame:
    """The files' rows in order, with `_file` and `_row` (for error messages). Files must share their columns."""
    frames = []
    for path in resolve_files(patterns, what):
        df = read_file(path)
        if df.height == 0:
            raise DatasetError(f"{what}: {path} is empty")
        if frames and set(df.columns) != set(frames[0].columns):
            raise DatasetError(
                f"{what}: {path} has columns {sorted(df.columns)}, unlike {frames[0]['_file'][0]} "
                f"({sorted(c for c in frames[0].columns if not c.startswith('_'))})"
            )
        frames.append(
            df.with_columns(pl.lit(str(path)).alias("_file"), pl.int_range(pl.len(), dtype=pl.Int64).alias("_row"))
        )
    try:
        return pl.concat(frames, how="vertical_relaxed")
    except pl.exceptions.PolarsError as exc:
        raise DatasetError(f"{what}: the files' column types differ: {str(exc).splitlines()[0][:200]}") from None


def _where(df: pl.DataFrame, condition: pl.Expr) -> str | None:
    """`file row N` of the first row where `condition` holds, or None."""
    bad = df.filter(condition).head(1)
    return f"{bad['_file'][0]} row {bad['_row'][0]}" if bad.height else None


def column(df: pl.DataFrame, key: str, what: str) -> pl.Expr:
    """The expression for a column or a dotted path into struct columns (`reward_model.ground_truth`)."""
    head, *rest = key.split(".")
    if head not in df.columns:
        raise DatasetError(
            f"{what}: no column {head!r} in {df['_file'][0]} "
            f"(columns: {', '.join(c for c in df.columns if not c.startswith('_'))})"
        )
    expr, dtype = pl.col(head), df.schema[head]
    for i, field in enumerate(rest):
        names = [f.name for f in dtype.fields] if isinstance(dtype, pl.Struct) else []
        if field not in names:
            raise DatasetError(
                f"{what}: {'.'.join([head, *rest[:i]])} in {df['_file'][0]} has no field {field!r}"
                + (f" (fields: {', '.join(names)})" if names else " (not a struct)")
            )
        expr, dtype = expr.struct.field(field), dict(zip(names, [f.dtype for f in dtype.fields]))[field]
    return expr


def prompt_column(df: pl.DataFrame, key: str, what: str) -> pl.Series:
    """The prompts, checked: no nulls, strings or lists of {role, content} messages with known roles."""
    values = df.select(column(df, key, what).alias("p"))["p"]
    dtype = values.dtype
    if dtype == pl.Utf8:
        where = _where(df.with_columns(values), values.is_null() | (values.str.strip_chars() == ""))
        if where:
            raise DatasetError(f"{what}: {where}: empty or null {key!r}")
        return values
    inner = dtype.inner if isinstance(dtype, pl.List) else None
    if not (isinstance(inner, pl.Struct) and {"role", "content"} <= {f.name for f in inner.fields}):
        raise DatasetError(
            f"{what}: column {key!r} has type {dtype}; expected a string or a list of chat messages {{role, content}}"
        )
    values = values.list.eval(
        pl.struct(pl.element().struct.field("role").cast(pl.Utf8), pl.element().struct.field("content").cast(pl.Utf8))
    )
    checks = [
        (values.is_null() | (values.list.len() == 0), "no messages"),
        (values.list.eval(pl.element().struct.field("content").is_null()).list.any(), "a message without content"),
        (
            values.list.eval(~pl.element().struct.field("role").is_in(ROLES)).list.any(),
            f"a role other than {', '.join(ROLES)}",
        ),
    ]
    for condition, problem in checks:
        where = _where(df, condition.fill_null(True))
        if where:
            raise DatasetError(f"{what}: {where}: {key!r} has {problem}")
    return values.cast(MESSAGES)


def as_text(values: pl.Series) -> pl.Series:
    """Ground truths as text: strings as they are, numbers printed, lists and structs as JSON."""
    if values.dtype == pl.Utf8:
        return values
    if values.dtype.is_numeric() or values.dtype == pl.Boolean:
        return values.cast(pl.Utf8)
    return pl.Series(
        values.name, [None if v is None else json.dumps(v, default=str) for v in values.to_list()], dtype=pl.Utf8
    )


def prompt_rows(patterns: list[str], data: DataConfig, what: str, id_prefix: str) -> pl.DataFrame:
    """prompt_id, prompt, answer, extra (when the data has other columns), _file, _row."""
    return frame_rows(read_files(patterns, what), data, what, id_prefix)


def split_rows(data: DataConfig, seed: int, prefix: str = "") -> dict[str, pl.DataFrame]:
    """{"train": rows, "eval": rows}: the eval files, or a seeded `eval_fraction` of the train rows (order kept).
    `prefix` starts the numbered ids of files without data.id_key (a source's name in a mix)."""
    train = prompt_rows(data.train_files, data, "data.train_files", f"{prefix}train")
    if data.eval_files:
        return {"train": train, "eval": prompt_rows(data.eval_files, data, "data.eval_files", f"{prefix}eval")}
    held = set(random.Random(seed).sample(range(train.height), round(data.eval_fraction * train.height)))
    is_held = pl.Series([i in held for i in range(train.height)])
    return {"train": train.filter(~is_held), "eval": train.filter(is_held)}


def frame_rows(df: pl.DataFrame, data: DataConfig, what: str, id_prefix: str) -> pl.DataFrame:
    """prompt_rows of rows already read (with their `_file` and `_row`)."""
    prompts = prompt_column(df, data.prompt_key, what)
    out = {"prompt": prompts}
    if data.answer_key:
        answers = df.select(column(df, data.answer_key, what).alias("a"))["a"]
        where = _where(df, answers.is_null())
        if where:
            raise DatasetError(
                f"{what}: {where}: null {data.answer_key!r} (data.answer_key; set it to null for data without one)"
            )
        out["answer"] = as_text(answers)
    if data.id_key:
        ids = df.select(column(df, data.id_key, what).cast(pl.Utf8).alias("i"))["i"]
        where = _where(df, ids.is_null() | ~ids.is_first_distinct())
        if where:
            raise DatasetError(f"{what}: {where}: null or repeated id in {data.id_key!r} (data.id_key)")
    else:
        ids = pl.Series([f"{id_prefix}-{i:06d}" for i in range(df.height)], dtype=pl.Utf8)
    used = {
        data.prompt_key.split(".")[0],
        data.id_key,
    }  # the prompt and the id reach the functions as `prompt...`, `prompt_id`
    others = [c for c in df.columns if not c.startswith("_") and c not in used]
    clash = sorted(set(others) & set(RESERVED_ARGUMENTS))
    if clash:
        hint = " (or set data.id_key: prompt_id to use it as the id)" if clash[0] == "prompt_id" else ""
        raise DatasetError(
            f"{what}: column {clash[0]!r} would shadow the reward functions' argument of that name; rename it{hint}"
        )
    frame = pl.DataFrame({"prompt_id": ids, **out}).with_columns(df.select("_file", "_row"))
    if others:
        frame = frame.with_columns(df.select(pl.struct(others).alias("extra")))
    return frame


def files_fingerprint(patterns: list[str], what: str) -> str:
    """The identity of the files' contents (sha256), in order: a stage reading them is redone when one changes."""

    h = hashlib.sha256()
    for path in resolve_files(patterns, what):
        h.update(f"{path.name}:{sha256_file(path)}".encode())
    return h.hexdigest()[:20]


def formatted_prompts(
    formatter, values: list, rows: pl.DataFrame, what: str, error: type[UserError] = DatasetError
) -> list:
    """Every prompt through the formatter (tasks/data/formatting.py), tokenized in one call; a prompt it cannot format
    is named by file and row."""
    rendered = []
    for i, value in enumerate(values):
        try:
            rendered.append(formatter.text(value))
        except FormattingError as exc:
            raise error(f"{what}: {rows['_file'][i]} row {rows['_row'][i]}: {exc}") from None
    ids = formatter.token_ids([text for text, _ in rendered])
    return [FormattedPrompt(text, token_ids, messages) for (text, messages), token_ids in zip(rendered, ids)]
