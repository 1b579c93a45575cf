"""A mix of two file sources on the tiny model, one with a curriculum over its files' `level` column: every round's
prompts dealt by weight, each iteration's level recorded, eval reported per source, and a run killed mid-curriculum
resumed to the uninterrupted run's path and tables (`make test-long`)."""

import polars as pl
import pytest

from schemas.config import load_config
from storage import RunLayout, read_manifest
from tasks.data.data_sources import curriculum_levels, round_deal
from tests.conftest import read_table, rlpipe, run_until_killed

pytestmark = [pytest.mark.e2e, pytest.mark.long]
ITERATIONS = 3


def mix(workspace) -> list[str]:
    """The arithmetic files cut in two sources (so that their ids stay apart); `add` has levels by the answer's size."""
    data = workspace / "data"
    train, held_out = pl.read_parquet(data / "train.parquet"), pl.read_parquet(data / "eval.parquet")
    half, eval_half = train.height // 2, held_out.height // 2
    level = (pl.col("answer").cast(pl.Int32) >= 20).cast(pl.Int32).alias("level")
    train.head(half).with_columns(level).write_parquet(data / "add.parquet")
    train.slice(half).write_parquet(data / "plain.parquet")
    held_out.head(eval_half).write_parquet(data / "add_eval.parquet")
    held_out.slice(eval_half).write_parquet(data / "plain_eval.parquet")
    sources = (
        f"[{{name: add, weight: 3, train_files: {data}/add.parquet, eval_files: {data}/add_eval.parquet, "
        "curriculum: {levels: 2, window: 1, threshold: 0.05}}, "
        f"{{name: plain, weight: 1, train_files: {data}/plain.parquet, eval_files: {data}/plain_eval.parquet}}]"
    )
    return [
        *("--set", "data.train_files=[]", "--set", "data.eval_files=[]", "--set", f"data.sources={sources}"),
        *("--set", f"rl.iterations={ITERATIONS}", "--set", f"rl.eval_every={ITERATIONS}"),
    ]


def levels_and_prompts(layout: RunLayout) -> tuple[list[int], dict]:
    levels = [read_manifest(layout, "prompts", k)["extra"]["levels"]["add"] for k in range(1, ITERATIONS + 1)]
    tables = {k: read_table(layout, "prompts", k) for k in range(1, ITERATIONS + 1)}
    return levels, tables


def test_a_mix_with_a_curriculum_resumed_mid_curriculum_takes_the_same_path(tiny_sft):
    workspace, cfg = tiny_sft
    args = mix(workspace)
    rlpipe("run", str(cfg), "--run-id", "mix", *args, cwd=workspace)
    run_until_killed(workspace, cfg, "mix-killed", "prompts:2", "run", *args)
    rlpipe("run", str(cfg), "--run-id", "mix-killed", *args, cwd=workspace)

    layout = RunLayout(workspace / "runs", "mix")
    levels, prompts = levels_and_prompts(layout)
    resumed_levels, resumed = levels_and_prompts(RunLayout(workspace / "runs", "mix-killed"))
    assert resumed_levels == levels and all(resumed[k].equals(prompts[k]) for k in prompts)

    # The recorded levels are the rule applied to the stored scores: each iteration's mean reward of `add`'s samples
    # on prompts at that iteration's level.
    dataset = read_table(layout, "dataset", 0).select(
        "prompt_id", pl.col("extra").struct.field("source"), pl.col("extra").struct.field("level")
    )

    def accuracy(j: int, level: int):
        scored = read_table(layout, "scores", j).join(dataset, on="prompt_id")
        mine = scored.filter((pl.col("source") == "add") & (pl.col("level") == level))
        return float(mine["reward"].mean()) if mine.height else None

    config = load_config(str(cfg), [a for a in args if a != "--set"])
    sources = config.data.sources
    assert levels == curriculum_levels(accuracy, ITERATIONS, sources[0].curriculum)
    assert levels == [0, 1, 1]  # the SFT model's mean reward (about 0.1) on the small sums passes 0.05 in iteration 1
    # every round dealt 3:1 by weight, and `add`'s prompts at its iteration's level
    for k, table in prompts.items():
        for (round_,), part in table.group_by(["round"]):
            got = part.select(pl.col("extra").struct.field("source")).to_series().value_counts()
            counts = dict(zip(got["source"], got["count"]))
            assert [counts.get("add", 0), counts.get("plain", 0)] == round_deal(sources, 16, config.seed, k, round_)
        add = table.filter(pl.col("extra").struct.field("source") == "add")
        assert set(add.select(pl.col("extra").struct.field("level")).to_series()) == {levels[k - 1]}
    assert [read_table(layout, "train_metrics", k)["curriculum_level/add"][0] for k in prompts] == levels
    # eval per source
    figures = read_manifest(layout, "eval", ITERATIONS)["extra"]
    assert {"accuracy/add", "accuracy/plain", "pass_at_2/add", "mean_length/plain"} <= set(figures)
