"""`rlpipe replay-tools RUN --iteration K --prompt-id P --sample S [--tools FILE]`: one trajectory's tool calls, as the
turns table recorded them, run again offline against the tool code as it is now (or another file), side by side with
what the model saw. For debugging a tool: nothing is generated and nothing in the run changes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import polars as pl
import yaml
from rich.console import Console
from rich.table import Table

from schemas.config import build_config
from schemas.errors import NotFound
from storage import RunLayout, read_stage
from tasks.agents.tools import call_tool, load_tools, tool_specs


def replay_tool_calls(
    root: str, run_id: str, iteration: int, prompt_id: str, sample_idx: int, tools_file: str | None = None
) -> pl.DataFrame:
    """One row per recorded call: the turn, the tool, its arguments, what was recorded (result, error) and what the
    tool gives now (`replayed`, `replayed_error`), and whether they agree. With `tools_file`, every tool is read from
    that file (same function names) instead of the run's config."""
    layout = RunLayout(Path(root), run_id)
    if not layout.config_path.exists():
        raise NotFound(f"run {run_id!r} not found under {root}")
    agent = build_config(yaml.safe_load(layout.config_path.read_text())).agent
    if not agent.tools:
        raise NotFound(f"run {run_id!r} has no agent.tools to replay")
    turns = read_stage(layout, "turns", iteration).filter(
        (pl.col("prompt_id") == prompt_id) & (pl.col("sample_idx") == sample_idx) & (pl.col("role") == "tool")
    )
    if turns.is_empty():
        raise NotFound(f"run {run_id!r} iteration {iteration}: sample {prompt_id}/{sample_idx} made no tool call")
    specs = tool_specs(agent)
    if tools_file:
        specs = [dataclasses.replace(s, path=tools_file, module=None) for s in specs]
    tools = load_tools(specs)
    rows = []
    for row in turns.iter_rows(named=True):
        readable = bool(row["tool_name"])  # an unreadable call was never run: it is shown as recorded
        again = (
            call_tool(tools, row["tool_name"], json.loads(row["tool_arguments"]), agent.tool_timeout_s)
            if readable
            else None
        )
        rows.append(
            {
                "turn": row["turn"],
                "tool": row["tool_name"],
                "arguments": row["tool_arguments"],
                "recorded": row["text"],
                "recorded_error": row["error"],
                "replayed": again.text if again else None,
                "replayed_error": again.error if again else None,
                "same": bool(again) and again.text == row["text"],
            }
        )
    return pl.DataFrame(
        rows, schema_overrides={"recorded_error": pl.Utf8, "replayed": pl.Utf8, "replayed_error": pl.Utf8}
    )


def print_replay(frame: pl.DataFrame, console: Console) -> None:
    table = Table(title="tool calls: recorded → replayed")
    for column in ("turn", "tool", "arguments", "recorded", "replayed", "same"):
        table.add_column(column)
    for row in frame.iter_rows(named=True):
        table.add_row(
            str(row["turn"]),
            row["tool"] or "(unreadable)",
            row["arguments"],
            row["recorded"],
            row["replayed"] if row["replayed"] is not None else "-",
            "yes" if row["same"] else "no",
        )
    console.print(table)
