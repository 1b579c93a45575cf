"""The run's prompt dataset (table `dataset`): the user's train and eval files mapped onto rlpipe's columns
(tasks/data/datasets.py), formatted and tokenized once (tasks/data/formatting.py), overlong prompts dropped or
refused. Pure but for reading the files: the `dataset` stage writes what this returns."""

from __future__ import annotations

import polars as pl

from schemas.config import DataConfig, PromptConfig
from schemas.tables import DATASET, LIST_I32, MESSAGES
from tasks.data.data_sources import merged_sources, source_rows
from tasks.data.datasets import DatasetError, formatted_prompts, split_rows
from tasks.data.formatting import PromptFormatter


def formatted(
    rows: pl.DataFrame, split: str, formatter: PromptFormatter, data: DataConfig, what: str
) -> tuple[pl.DataFrame, int]:
    """The split's rows as `dataset` rows, and how many overlong prompts were dropped."""
    prompts = formatted_prompts(formatter, rows["prompt"].to_list(), rows, what)
    lengths = pl.Series([len(p.token_ids) for p in prompts], dtype=pl.Int64)
    overlong = lengths > data.max_prompt_tokens
    if overlong.any() and data.overlong_prompts == "error":
        first = rows.filter(overlong).row(0, named=True)
        raise DatasetError(
            f"{what}: {first['_file']} row {first['_row']}: the prompt has {lengths.filter(overlong)[0]} tokens, "
            f"over data.max_prompt_tokens={data.max_prompt_tokens} "
            "(set data.overlong_prompts=drop to skip such prompts)"
        )
    frame = pl.DataFrame(
        {
            "split": pl.Series([split] * rows.height, dtype=pl.Utf8),
            "prompt_id": rows["prompt_id"],
            "text": pl.Series([p.text for p in prompts], dtype=pl.Utf8),
            "prompt_token_ids": pl.Series([p.token_ids for p in prompts], dtype=LIST_I32),
            "messages": pl.Series([p.messages for p in prompts], dtype=MESSAGES),
            "answer": rows["answer"] if "answer" in rows.columns else pl.Series([None] * rows.height, dtype=pl.Utf8),
        }
    )
    if "extra" in rows.columns:
        frame = frame.with_columns(rows["extra"])
    return frame.filter(~overlong), int(overlong.sum())


def build_prompt_dataset(data: DataConfig, prompt: PromptConfig, tokenizer, seed: int) -> tuple[pl.DataFrame, dict]:
    """The `dataset` table and its statistics (prompts per split, dropped overlong prompts, longest prompt)."""
    if not data.train_files and not data.sources:
        raise DatasetError(
            "data.train_files is empty: name your prompt files (Parquet or JSONL), or use a built-in task"
        )
    formatter = PromptFormatter(tokenizer, prompt)
    frames, dropped = [], {"train": 0, "eval": 0}
    for source, splits in source_rows(data, seed) if data.sources else [(None, split_rows(data, seed))]:
        for split, rows in splits.items():
            if source:
                what = f"data.sources[{source}]"
            else:
                what = f"data.{split}_files" if split == "train" or data.eval_files else "data.train_files"
            frame, overlong = formatted(rows, split, formatter, data, what)
            dropped[split] += overlong
            if rows.height and not frame.height:
                raise DatasetError(
                    f"{what}: every prompt is longer than data.max_prompt_tokens={data.max_prompt_tokens}"
                )
            frames.append(frame)
    if data.sources:
        table = merged_sources(frames)
    else:
        try:
            table = pl.concat(frames, how="vertical_relaxed")
        except pl.exceptions.PolarsError:
            raise DatasetError("data.eval_files: their columns differ from data.train_files'") from None
    stats = {
        "prompts": {s: int((table["split"] == s).sum()) for s in ("train", "eval")},
        "dropped_overlong": dropped,
        "longest_prompt_tokens": int(table["prompt_token_ids"].list.len().max()),
    }
    return DATASET.validate(table), stats
