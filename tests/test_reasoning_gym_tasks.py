"""The `reasoning_gym` built-in task: rows dealt to the tasks by weight exactly, held-out questions never asked in
training, each row's entry scored back by the task's own scorer, bad sources named in one line."""

import json

import pytest

from schemas.config import ConfigError, build_config
from tasks.data.example_tasks import ensure_task_files
from tasks.data.reasoning_gym_tasks import SourceError, make_files, shares
from tasks.rewards.builtin import BUILTIN_REWARDS


def test_shares_deal_the_rows_by_weight_exactly():
    assert shares(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}  # ties: the earlier name
    assert shares(7, {"a": 2, "b": 1}) == {"a": 5, "b": 2}  # 4.67 and 2.33: the larger remainder gets the row
    assert shares(6, {"a": 0.5, "b": 0.25, "c": 0.25}) == {"a": 3, "b": 2, "c": 1}  # 3, 1.5, 1.5
    assert sum(shares(1001, {"x": 3.3, "y": 1.7, "z": 5}).values()) == 1001


def config(tmp_path, **task):
    raw = {"task": {"name": "reasoning_gym", "out_dir": str(tmp_path / "rg"), **task}}
    return build_config(raw).task


def test_the_files_mix_the_tasks_by_weight_and_share_no_question(tmp_path):
    tasks = {"leg_counting": {"weight": 3}, "chain_sum": {"weight": 1, "config": {"min_terms": 2, "max_terms": 3}}}
    task = config(tmp_path, tasks=tasks, n_train=40, n_eval=6, seed=1, eval_seed=100)
    paths = ensure_task_files(task)
    import polars as pl

    train, held_out, sft = (pl.read_parquet(paths[k]) for k in ("train", "eval", "sft"))
    assert train.group_by("source").len().sort("source").rows() == [("chain_sum", 10), ("leg_counting", 30)]
    assert held_out.group_by("source").len().sort("source").rows() == [("chain_sum", 6), ("leg_counting", 6)]
    assert not set(train["entry"].map_elements(lambda e: json.loads(e)["question"], return_dtype=pl.Utf8)) & set(
        held_out["entry"].map_elements(lambda e: json.loads(e)["question"], return_dtype=pl.Utf8)
    )
    first = train.row(0, named=True)
    assert [m["role"] for m in first["prompt"]] == ["system", "user"] and "<answer>" in first["prompt"][0]["content"]
    assert first["prompt"][1]["content"] == json.loads(first["entry"])["question"]
    reward = BUILTIN_REWARDS.get("reasoning_gym")
    for row in train.join(sft, on="prompt_id").iter_rows(named=True):  # the demonstrations score 1 on their own task
        assert reward(response=row["response"], entry=row["entry"]) == 1.0
    again = make_files(
        {"leg_counting": (3, {}), "chain_sum": (1, {"min_terms": 2, "max_terms": 3})}, 40, 6, 1, 100, None
    )
    assert again["train"].equals(train) and again["eval"].equals(held_out)  # a pure function of the settings


def test_a_bad_source_is_one_line_naming_it(tmp_path):
    with pytest.raises(SourceError, match="reasoning-gym has no task 'nope'"):
        make_files({"nope": (1, {})}, 4, 2, 1, 2, None)
    with pytest.raises(SourceError, match="reasoning-gym task 'chain_sum' rejects its settings"):
        make_files({"chain_sum": (1, {"min_terms": 5, "max_terms": 2})}, 4, 2, 1, 2, None)
    with pytest.raises(SourceError, match="only .* held-out questions are not asked in training"):
        make_files(
            {"chain_sum": (1, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})}, 200, 150, 1, 2, None
        )
    with pytest.raises(ConfigError, match="task.reasoning_gym.tasks.leg_counting.weight"):
        config(tmp_path, tasks={"leg_counting": {"weight": 0}})
    with pytest.raises(ConfigError, match=r"held-out draws \[1030, 1230\) meet the train draws \[0, 2000\)"):
        config(tmp_path, tasks={"leg_counting": {}}, seed=0, eval_seed=1030)


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
