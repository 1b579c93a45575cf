"""data.sources: the per-round deal by weight, a mix's dataset rows, the held-out split of a generated source, and the
curriculum rule on hand-worked accuracy sequences (tasks/data/data_sources.py)."""

import json
from collections import Counter

import polars as pl
import pytest

from schemas.config import CurriculumConfig, DataConfig
from tasks.data.data_sources import (
    curriculum_levels,
    deal,
    merged_sources,
    next_level,
    round_deal,
    sample_from_sources,
    source_rows,
)
from tasks.data.datasets import DatasetError
from tasks.data.reasoning_gym_tasks import SourceError, level_config


@pytest.mark.parametrize(
    "n, weights, u, expected",
    [
        # cumulative shares 4, 6, 8: whole numbers, whatever u
        (8, [2, 1, 1], 0.0, [4, 2, 2]),
        (8, [2, 1, 1], 0.99, [4, 2, 2]),
        # cumulative 2.67, 5.33, 8: floor(x + u)
        (8, [1, 1, 1], 0.0, [2, 3, 3]),
        (8, [1, 1, 1], 0.5, [3, 2, 3]),
        (8, [1, 1, 1], 0.7, [3, 3, 2]),
        # a weight of 0 gets nothing
        (5, [1, 0, 1], 0.7, [3, 0, 2]),
    ],
)
def test_deal_by_hand(n, weights, u, expected):
    assert deal(n, weights, u) == expected


def test_deal_honours_the_weights_over_rounds_and_each_round_within_one():
    weights, n = [0.5, 0.3, 0.2], 8
    sources = DataConfig(
        sources=[{"name": f"s{i}", "weight": w, "train_files": "x.parquet"} for i, w in enumerate(weights)]
    ).sources
    totals = Counter()
    rounds = [(it, r) for it in range(1, 1001) for r in range(3)]
    for it, r in rounds:
        counts = round_deal(sources, n, 7, it, r)
        assert sum(counts) == n
        for i, (c, w) in enumerate(zip(counts, weights)):
            assert int(n * w) <= c <= int(n * w) + 1  # ⌊n·w⌋ or ⌈n·w⌉
            totals[i] += c
    shares = [totals[i] / (n * len(rounds)) for i in range(3)]
    assert shares == pytest.approx(weights, abs=0.01), shares
    assert round_deal(sources, n, 7, 5, 1) == round_deal(sources, n, 7, 5, 1)  # reproducible


def mix_table(tmp_path, level_column=False) -> tuple[DataConfig, pl.DataFrame]:
    rows = {"question": [f"q{i}" for i in range(12)], "answer": [str(i) for i in range(12)]}
    if level_column:
        rows["level"] = [i % 3 for i in range(12)]
    pl.DataFrame(rows).write_parquet(tmp_path / "a.parquet")
    pl.DataFrame({"question": [f"r{i}" for i in range(6)], "answer": ["0"] * 6}).write_parquet(tmp_path / "b.parquet")
    data = DataConfig(
        prompt_key="question",
        sources=[
            {
                "name": "a",
                "weight": 2,
                "train_files": str(tmp_path / "a.parquet"),
                **({"curriculum": {"levels": 3}} if level_column else {}),
            },
            {"name": "b", "weight": 1, "train_files": str(tmp_path / "b.parquet")},
        ],
    )
    return data, merged_sources([rows["train"] for _, rows in source_rows(data, 0)])


def test_sampling_from_a_mix_is_reproducible_and_walks_each_source_without_repeats(tmp_path):
    data, train = mix_table(tmp_path)
    assert train.select(pl.col("extra").struct.field("source")).to_series().to_list() == ["a"] * 12 + ["b"] * 6
    assert train["prompt_id"].to_list()[:2] == ["a-train-000000", "a-train-000001"]  # numbered under the source
    seen = []
    for r in range(2):
        picked = sample_from_sources(train, data.sources, {}, 6, 3, 1, r)
        assert picked.equals(sample_from_sources(train, data.sources, {}, 6, 3, 1, r))
        got = Counter(picked.select(pl.col("extra").struct.field("source")).to_series().to_list())
        assert [got["a"], got["b"]] == round_deal(data.sources, 6, 3, 1, r) == [4, 2]
        seen += picked["prompt_id"].to_list()
    assert len(seen) == len(set(seen))  # round 1 continues where round 0 stopped, in each source
    assert not sample_from_sources(train, data.sources, {}, 6, 3, 2, 0).equals(
        sample_from_sources(train, data.sources, {}, 6, 3, 1, 0)
    )


def test_a_curriculum_source_draws_from_its_current_level(tmp_path):
    data, train = mix_table(tmp_path, level_column=True)
    picked = sample_from_sources(train, data.sources, {"a": 2}, 6, 3, 1, 0)
    a = picked.filter(pl.col("extra").struct.field("source") == "a")
    assert a.height == 4 and set(a.select(pl.col("extra").struct.field("level")).to_series()) == {2}


def test_a_bad_source_gets_one_line(tmp_path):
    pl.DataFrame({"question": ["q"], "answer": ["1"], "level": [5]}).write_parquet(tmp_path / "a.parquet")
    bad_level = DataConfig(
        prompt_key="question",
        sources=[{"name": "a", "train_files": str(tmp_path / "a.parquet"), "curriculum": {"levels": 2}}],
    )
    with pytest.raises(DatasetError, match=r"data.sources\[a\].curriculum: a row has level 5"):
        source_rows(bad_level, 0)
    unknown = DataConfig(sources=[{"name": "g", "reasoning_gym": {"task": "no_such_task"}}])
    with pytest.raises(SourceError, match="reasoning-gym has no task 'no_such_task'"):
        source_rows(unknown, 0)
    rejected = DataConfig(sources=[{"name": "g", "reasoning_gym": {"task": "leg_counting", "config": {"legs": 3}}}])
    with pytest.raises(SourceError, match="rejects its settings"):
        source_rows(rejected, 0)
    with pytest.raises(ValueError, match="every weight is 0"):
        DataConfig(
            sources=[{"name": "a", "weight": 0, "train_files": "x"}, {"name": "b", "weight": 0, "train_files": "y"}]
        )


def test_a_generated_curriculum_source_rows_levels_and_held_out_split():
    data = DataConfig(
        sources=[
            {
                "name": "legs",
                "reasoning_gym": {"task": "leg_counting", "n_train": 20, "n_eval": 10, "system_prompt": "Answer."},
                "curriculum": {"levels": 3},
            }
        ]
    )
    [(name, rows)] = source_rows(data, 0)
    train, held_out = rows["train"], rows["eval"]
    entries = [json.loads(e) for e in train.select(pl.col("extra").struct.field("entry")).to_series()]
    levels = train.select(pl.col("extra").struct.field("level")).to_series().to_list()
    assert name == "legs" and levels == [0] * 20 + [1] * 20 + [2] * 20
    # each level's entries drawn with reasoning-gym's curriculum settings for that level
    for level in range(3):
        settings = level_config("leg_counting", {}, level)
        animals = [e["metadata"]["num_animals"] for e, lv in zip(entries, levels) if lv == level]
        assert all(settings["min_animals"] <= k <= settings["max_animals"] for k in animals)
    assert level_config("leg_counting", {}, 0) != level_config("leg_counting", {}, 2)
    # held out at the last level, no question asked in training
    assert held_out.select(pl.col("extra").struct.field("level")).to_series().to_list() == [2] * 10
    questions = {m[1]["content"] for m in train["prompt"]}
    assert not questions & {m[1]["content"] for m in held_out["prompt"]}
    assert train["prompt"][0][0]["content"] == "Answer."


RULE = CurriculumConfig(levels=3, window=2, threshold=0.7)


def test_the_curriculum_rule_on_a_hand_worked_sequence():
    # iteration:  1    2    3    4     5    6    7     8     9
    accuracy = [0.5, 0.8, 0.9, 0.75, 0.6, 0.8, 0.95, 0.99, 1.0]
    # 1-3 at level 0; after 2 and 3 (0.8, 0.9) level 1 from 4; 4-5 (0.75, 0.6) no; 5-6 (0.6, 0.8) no;
    # 6-7 (0.8, 0.95): level 2 from 8; the last level stays.
    expected = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert curriculum_levels(lambda j, level: accuracy[j - 1], 10, RULE) == expected
    # One update of lag (generation one step ahead): iteration k sees the accuracies up to k - 2.
    # Level 1 from 5 (2 and 3 seen by 5); then 5-6 at level 1 need iteration 7 scored: 0.6, 0.8 no; 6-7 (0.8, 0.95)
    # seen by iteration 9: level 2 from 9.
    assert curriculum_levels(lambda j, level: accuracy[j - 1], 10, RULE, lag=1) == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_the_rule_skips_unscored_iterations_and_restarts_its_window_at_a_new_level():
    assert next_level(0, [(0, 0.9), (0, None), (0, 0.8)], RULE) == 1  # None: no samples of the source, skipped
    assert next_level(1, [(0, 0.9), (0, 0.9), (1, 0.9)], RULE) == 1  # only one iteration at level 1 yet
    assert next_level(0, [(0, 0.9), (1, 0.9), (0, 0.9)], RULE) == 0  # a run is the trailing iterations at the level
    # the accuracy asked for is the one at each iteration's own level
    asked = []
    curriculum_levels(lambda j, level: asked.append((j, level)) or 1.0, 5, RULE)
    assert asked == [(1, 0), (2, 0), (3, 1), (4, 1)]
