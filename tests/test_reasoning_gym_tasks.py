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
            "answer": ["Yes", "", "No"],  # y's one prompt has no answer: no label, no prior
        }
    )
    figures = source_figures(df, sources_of(held_out), k=2)
    assert figures == {
        "accuracy/x": 0.5, "pass_at_2/x": 0.625, "mean_length/x": 25.0, "prompts/x": 2, "label_prior/x": 0.5,
        "accuracy/y": 0.0, "pass_at_2/y": 0.5, "mean_length/y": 20.0, "prompts/y": 1,
    }  # fmt: skip
    assert sources_of(held_out.drop("extra")) is None
    assert pass_at({"pass_at_2": 0.3, **figures}) == 0.3 and pass_at(split_by_source(figures)["y"]) == 0.5


def test_the_label_prior_is_the_share_of_the_most_common_held_out_answer():
    from tasks.algos.metrics import label_prior

    # the docs' syllogism set: 50 "Yes" and 14 "No" among 64 held-out answers
    assert label_prior(pl.Series(["Yes"] * 50 + ["No"] * 14)) == 50 / 64 == 0.78125
    # empty and null answers are no label but count in the total: always answering "1" is right on 2 of 6
    assert label_prior(pl.Series(["1", "2", "1", "", None, "3"])) == 2 / 6
    assert label_prior(pl.Series(["", None], dtype=pl.Utf8)) is None


def test_balanced_held_out_labels_give_each_answer_an_equal_share_in_draw_order():
    from tasks.data.reasoning_gym_tasks import balanced

    draws = [{"question": str(i), "answer": a} for i, a in enumerate("YYYNYYYYNYYNYY")]
    # n_eval 4: labels N, Y (among the first 8); 2 each, in the order drawn: Y0 Y1 N3 N8
    picked = balanced(draws, 4, "s", 14)
    assert [e["question"] for e in picked] == ["0", "1", "3", "8"]
    # n_eval 5 does not divide by 2: the first label in sorted order (N) gets one more, and N is short of it
    with pytest.raises(SourceError, match=r"s: 4 of n_eval=5 in 14 draws; short of 1 answering 'N'"):
        balanced(draws[:10], 5, "s", 14)
    with pytest.raises(SourceError, match=r"s: 6 distinct answers among the first 6 held-out entries"):
        balanced([{"question": str(i), "answer": i} for i in range(20)], 3, "s", 20)


def test_balance_eval_labels_on_syllogism_and_unset_leaves_the_held_out_rows_as_they_were():
    def source(task="syllogism", **extra):
        g = {"task": task, "n_train": 200, "n_eval": 64, "eval_seed": 1_000_000_000, **extra}
        return DataConfig(sources=[{"name": "syl", "reasoning_gym": g}])

    plain, unset, even = (
        source_rows(source(**kw), 0)[0][1] for kw in ({}, {"balance_eval_labels": False}, {"balance_eval_labels": True})
    )
    assert plain["eval"].equals(unset["eval"])
    assert plain["eval"]["answer"].value_counts(sort=True).rows() == [("Yes", 50), ("No", 14)]  # the docs' mix3 set
    assert sorted(even["eval"]["answer"].value_counts().rows()) == [("No", 32), ("Yes", 32)]
    entry = pl.col("extra").struct.field("entry")
    train_q, held_q = (
        {json.loads(e)["question"] for e in split.select(entry).to_series()} for split in (even["train"], even["eval"])
    )
    assert len(held_q) == 64 and not train_q & held_q
    # the held-out draws' range grows to 16 × n_eval: a train range it would meet is refused
    with pytest.raises(ValueError, match=r"held-out draws \[1000, 2024\) meet the train draws \[1500, 1700\)"):
        source(seed=1500, eval_seed=1000, balance_eval_labels=True)
    with pytest.raises(
        SourceError, match=r"data.sources\[syl\].reasoning_gym.balance_eval_labels: 57 distinct answers"
    ):
        source_rows(source("lcm", config={"max_value": 20}, balance_eval_labels=True), 0)


def test_show_and_the_report_put_the_label_prior_beside_each_accuracy(tmp_path):
    import time

    from rich.console import Console

    from storage import RunLayout, write_stage
    from tasks.analysis.report import source_accuracy
    from tasks.analysis.show import eval_table

    layout = RunLayout(tmp_path, "r")
    frame = pl.DataFrame(
        {"iteration": [0], "prompt_id": ["a"], "answer": ["Yes"], "greedy_text": ["Yes"], "greedy_correct": [True],
         "greedy_length": [3], "greedy_reward": [1.0], "n_samples": [1], "n_correct": [1], "pass_at_k": [1.0],
         "sampled_reward_mean": [1.0]},
        schema_overrides={c: pl.Int32 for c in ("iteration", "greedy_length", "n_samples", "n_correct")},
    )  # fmt: skip
    figures = {"accuracy": 0.5, "pass_at_2": 0.6, "prompts": 64, "label_prior": 0.5}
    figures |= {"accuracy/syllogism": 0.78125, "prompts/syllogism": 64, "label_prior/syllogism": 0.78125}
    write_stage(layout, "eval", 0, frame, fp="e", inputs={}, config_hash="", started=time.time(), extra=figures)
    console = Console(width=200, record=True, file=open("/dev/null", "w"))
    console.print(eval_table(layout))
    rows = [line for line in console.export_text().splitlines() if "syllogism" in line or line.startswith("│ ")]
    cells = [[c.strip() for c in row.split("│")[1:-1]] for row in rows]
    assert cells == [["0", "0.5000", "0.5000", "0.6000", "nan", "nan", "64", "0"],
                     ["0 syllogism", "0.7812", "0.7812", "nan", "", "nan", "64", ""]]  # fmt: skip
    assert source_accuracy(layout) == {
        "eval greedy accuracy, syllogism": ([0], [0.78125]),
        "label prior, syllogism": ([0], [0.78125]),
    }
