"""reasoning-gym's tasks mixed through data.sources (the one way in: the old `task: reasoning_gym` is one line saying
so): each generator's rows scored back by the task's own scorer, held-out questions never asked in training, a
source with too few distinct questions named in one line, and the eval's figures per source."""

import json

import polars as pl
import pytest

from schemas.config import ConfigError, DataConfig, build_config
from tasks.data.data_sources import source_rows
from tasks.data.reasoning_gym_tasks import SourceError
from tasks.rewards.builtin import BUILTIN_REWARDS


def test_the_task_reasoning_gym_is_one_line_saying_what_to_write_instead():
    with pytest.raises(
        ConfigError, match=r"the task reasoning_gym is gone: mix reasoning-gym's tasks with data.sources"
    ):
        build_config({"task": {"name": "reasoning_gym", "tasks": {"leg_counting": {}}}})


def test_mixed_generators_rows_score_1_with_their_oracle_answers_and_share_no_question():
    chain = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 3}, "n_train": 10, "n_eval": 6}
    data = DataConfig(
        sources=[
            {"name": "legs", "weight": 3, "reasoning_gym": {"task": "leg_counting", "n_train": 30, "n_eval": 6}},
            {"name": "sums", "weight": 1, "reasoning_gym": {**chain, "seed": 1, "eval_seed": 100}},
        ]
    )
    reward = BUILTIN_REWARDS.get("reasoning_gym")
    for name, rows in source_rows(data, 0):
        train, held_out = rows["train"], rows["eval"]
        assert held_out.height == 6 and train.height == {"legs": 30, "sums": 10}[name]
        entry = pl.col("extra").struct.field("entry")
        questions = [
            {json.loads(e)["question"] for e in split.select(entry).to_series()} for split in (train, held_out)
        ]
        assert not questions[0] & questions[1]
        first = train.row(0, named=True)
        assert [m["role"] for m in first["prompt"]] == ["system", "user"] and "<answer>" in first["prompt"][0][
            "content"
        ]
        for row in train.select("answer", entry.alias("entry")).iter_rows(named=True):  # the oracle scores 1
            assert reward(response=f"<answer>{row['answer']}</answer>", entry=row["entry"]) == 1.0


def test_a_source_with_too_few_distinct_questions_is_one_line_naming_it():
    tight = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    data = DataConfig(sources=[{"name": "tight", "reasoning_gym": {**tight, "n_train": 200, "n_eval": 150}}])
    with pytest.raises(
        SourceError, match=r"data.sources\[tight\]: only .* held-out questions are not asked in training"
    ):
        source_rows(data, 0)
    with pytest.raises(ValueError, match=r"held-out draws \[1030, 1230\) meet the train draws \[0, 2000\)"):
        DataConfig(
            sources=[
                {"name": "l", "reasoning_gym": {"task": "leg_counting", "n_train": 2000, "seed": 0, "eval_seed": 1030}}
            ]
        )


def test_eval_figures_per_source_by_hand():
    import polars as pl

    from tasks.algos.metrics import split_by_source
    from tasks.analysis.show import pass_at
    from tasks.stages.evaluate import source_figures, sources_of

    held_out = pl.DataFrame(
        {"prompt_id": ["a", "b", "c"], "extra": [{"source": "x"}, {"source": "y"}, {"source": "x"}]}
    )
    df = pl.DataFrame(
        {
            "prompt_id": ["a", "b", "c"],
            "greedy_correct": [True, False, False],
            "pass_at_k": [1.0, 0.5, 0.25],
            "greedy_length": [10, 20, 40],
        }
    )
    figures = source_figures(df, sources_of(held_out), k=2)
    assert figures == {
        "accuracy/x": 0.5, "pass_at_2/x": 0.625, "mean_length/x": 25.0, "prompts/x": 2,
        "accuracy/y": 0.0, "pass_at_2/y": 0.5, "mean_length/y": 20.0, "prompts/y": 1,
    }  # fmt: skip
    assert sources_of(held_out.drop("extra")) is None
    assert pass_at({"pass_at_2": 0.3, **figures}) == 0.3 and pass_at(split_by_source(figures)["y"]) == 0.5
