"""SFT demonstrations from the user's files (sft section): a prompt column (a string or chat messages) and a
response column, or one column of whole conversations whose last message is the assistant's response. Prompts go
through the same formatting as rollouts; the response gets EOS, and only its tokens are trained on."""

from __future__ import annotations

import polars as pl

from schemas.config import PromptConfig, SFTConfig
from schemas.tables import LIST_I32, SFT_DATA
from tasks.data.datasets import DatasetError, column, formatted_prompts, prompt_column, read_files
from tasks.data.formatting import PromptFormatter


def prompts_and_responses(sft: SFTConfig, rows: pl.DataFrame) -> tuple[list, list[str]]:
    what = "sft.files"
    if sft.messages_key:
        conversations = prompt_column(rows, sft.messages_key, what)
        if conversations.dtype == pl.Utf8:
            raise DatasetError(
                f"{what}: column {sft.messages_key!r} (sft.messages_key) holds strings, not conversations"
            )
        last_role = conversations.list.last().struct.field("role")
        bad = rows.filter((last_role != "assistant") | (conversations.list.len() < 2)).head(1)
        if bad.height:
            raise DatasetError(
                f"{what}: {bad['_file'][0]} row {bad['_row'][0]}: a conversation must end with an assistant "
                "message after at least one other"
            )
        convs = conversations.to_list()
        return [c[:-1] for c in convs], [c[-1]["content"] for c in convs]
    prompts = prompt_column(rows, sft.prompt_key, what).to_list()
    responses = rows.select(column(rows, sft.response_key, what).alias("r"))["r"]
    if responses.dtype != pl.Utf8:
        raise DatasetError(
            f"{what}: column {sft.response_key!r} (sft.response_key) has type {responses.dtype}, expected strings"
        )
    bad = rows.filter(responses.is_null()).head(1)
    if bad.height:
        raise DatasetError(f"{what}: {bad['_file'][0]} row {bad['_row'][0]}: null {sft.response_key!r}")
    return prompts, responses.to_list()


def build_sft_examples(
    sft: SFTConfig, prompt: PromptConfig, tokenizer, max_prompt_tokens: int
) -> tuple[pl.DataFrame, dict]:
    """The `sft_data` table (prompts over max_prompt_tokens dropped and counted) and its statistics."""
    if not sft.files:
        raise DatasetError(
            "sft.files is empty: name your demonstration files (Parquet or JSONL), or use a built-in task"
        )
    rows = read_files(sft.files, "sft.files")
    prompts, responses = prompts_and_responses(sft, rows)
    formatter = PromptFormatter(tokenizer, prompt)
    formatted = formatted_prompts(formatter, prompts, rows, "sft.files")
    frame = pl.DataFrame(
        {
            "prompt_id": [f"sft-{i:06d}" for i in range(rows.height)],
            "text": [f.text for f in formatted],
            "response": responses,
            "prompt_token_ids": pl.Series([f.token_ids for f in formatted], dtype=LIST_I32),
            "response_token_ids": pl.Series([formatter.response_ids(r) for r in responses], dtype=LIST_I32),
        }
    )
    kept = frame.filter(pl.col("prompt_token_ids").list.len() <= max_prompt_tokens)
    if not kept.height:
        raise DatasetError(f"sft.files: every prompt is longer than data.max_prompt_tokens={max_prompt_tokens}")
    return SFT_DATA.validate(kept), {"examples": kept.height, "dropped_overlong": frame.height - kept.height}
