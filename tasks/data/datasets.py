"""Prompt datasets: the demo's generated splits, or a user's Parquet/JSONL, validated with one-line errors."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from schemas.config import TaskConfig
from schemas.tables import PROMPT_DATASET, TableError
from tasks.data.arithmetic import ensure_dataset


class DatasetError(ValueError):
    pass


def load_prompt_dataset(path: str | Path) -> pl.DataFrame:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset not found: {path}")
    try:
        if path.suffix == ".jsonl":
            df = pl.read_ndjson(path)
        else:
            df = pl.read_parquet(path)
    except Exception as exc:  # polars raises several types for unreadable files
        raise DatasetError(f"cannot read dataset {path}: {str(exc).splitlines()[0]}") from None
    if df.height == 0:
        raise DatasetError(f"dataset {path} is empty")
    try:
        known = df.select([c for c in df.columns if c in PROMPT_DATASET.columns])  # extra columns are ignored
        df = PROMPT_DATASET.validate(known, what=f"dataset {path}")
    except TableError as exc:
        raise DatasetError(str(exc)) from None
    if df["text"].null_count() or df["answer"].null_count():
        raise DatasetError(f"dataset {path}: null text or answer")
    return df


def task_splits(task: TaskConfig) -> dict[str, Path]:
    """The train and held-out split paths for the configured task, generating them if needed."""
    return ensure_dataset(task.data_dir, task.max_operand, task.operations, task.n_eval, task.seed, task.pad_operands)
