"""Preference data: rankings and pairs by hand and against a loop; a user's bad file gives one clear line."""

import itertools
import json
import random

import polars as pl
import pytest

from schemas.config import PromptConfig
from tasks.data.formatting import PromptFormatter
from tasks.data.model_recipe import char_tokenizer
from tasks.data.preferences import (
    PreferenceDataError,
    assign_splits,
    load_preferences,
    pairs_from_rankings,
    rankings_from_samples,
)

FORMATTER = PromptFormatter(char_tokenizer("0123456789+=xyab"), PromptConfig())


def test_rankings_rank_correct_over_incorrect_with_ties():
    samples = pl.DataFrame(
        {
            "prompt_id": ["a"] * 4 + ["b"] * 2,
            "prompt": ["1+1="] * 4 + ["2+2="] * 2,
            "prompt_token_ids": [[1, 5, 14, 5, 15]] * 4 + [[1, 6, 14, 6, 15]] * 2,
            "response": ["2", "3", "2", "11", "5", "6"],
            "reward": [1.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        }
    )
    out = rankings_from_samples(samples)
    assert out["prompt_id"].to_list() == ["a"]  # b: every response wrong, no preference
    assert out.row(0, named=True)["responses"] == ["2", "3", "11"]  # "2" sampled twice, kept once
    assert out.row(0, named=True)["ranks"] == [1, 2, 2]  # the two wrong answers tie


def test_pairs_match_a_loop():
    rng = random.Random(0)
    rows = []
    for p in range(40):
        k = rng.randint(2, 6)
        ranks = [rng.randint(1, 3) for _ in range(k)]
        rows.append(
            {
                "prompt_id": f"p{p}",
                "prompt": f"q{p}",
                "prompt_token_ids": [1, p],
                "responses": [f"r{p}-{i}" for i in range(k)],
                "ranks": ranks,
                "split": "train",
            }
        )
    rankings = pl.DataFrame(rows, schema_overrides={"ranks": pl.List(pl.Int32), "prompt_token_ids": pl.List(pl.Int32)})
    got = pairs_from_rankings(rankings)
    want = [
        (r["prompt_id"], r["responses"][i], r["responses"][j])
        for r in rows
        for i, j in itertools.product(range(len(r["ranks"])), repeat=2)
        if r["ranks"][i] < r["ranks"][j]
    ]
    assert sorted(zip(got["prompt_id"], got["chosen"], got["rejected"])) == sorted(want)
    assert got.group_by("prompt_id").agg(pl.col("pair_idx").sort()).sort("prompt_id")["pair_idx"].to_list() == [
        list(range(n)) for n in got.group_by("prompt_id").len().sort("prompt_id")["len"]
    ]


def test_splits_are_seeded_and_hold_out_a_fraction():
    rankings = pl.DataFrame({"prompt_id": [f"p{i}" for i in range(100)]})
    a, b = assign_splits(rankings, 0.1, 7), assign_splits(rankings, 0.1, 7)
    assert a.equals(b) and (a["split"] == "heldout").sum() == 10


def test_a_pairs_file_loads_as_two_response_rankings(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "1+1=", "chosen": "2", "rejected": "3", "split": "train"},
                {"prompt": "2+2=", "chosen": "4", "rejected": "5", "split": "heldout"},
            ]
        )
    )
    out = load_preferences(path, 0.5, 0, FORMATTER)
    assert out["responses"].to_list() == [["2", "3"], ["4", "5"]] and out["ranks"].to_list() == [[1, 2], [1, 2]]
    assert out["split"].to_list() == ["train", "heldout"]
    assert (
        out["prompt"].to_list() == ["1+1=", "2+2="]
        and out["prompt_token_ids"][0].to_list() == FORMATTER("1+1=").token_ids
    )


def test_chat_prompts_go_through_the_chat_template(tmp_path):
    from tasks.data.model_recipe import bpe_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"t": "what is one plus one? two three"}))
    chat = PromptFormatter(bpe_tokenizer(300, [str(corpus)], "chatml"), PromptConfig(system_prompt="Be brief."))
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps(
            {"prompt": [{"role": "user", "content": "what is one plus one?"}], "chosen": "two", "rejected": "three"}
        )
    )
    out = load_preferences(path, 0.5, 0, chat)
    assert (
        out["prompt"][0]
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nwhat is one plus one?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = load_preferences(path, 0.5, 0, FORMATTER)  # the character tokenizer has none: one user message fills
    assert plain["prompt"][0] == FORMATTER("what is one plus one?").text  # its plain template, as a string would
    path.write_text(
        json.dumps(
            {
                "prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"}],
                "chosen": "two",
                "rejected": "three",
            }
        )
    )
    with pytest.raises(PreferenceDataError, match="needs a chat template"):
        load_preferences(path, 0.5, 0, FORMATTER)  # a conversation does need one


@pytest.mark.parametrize(
    "rows, needle",
    [
        ([{"prompt": "x", "chosen": "a"}], "missing column 'rejected'"),
        ([{"prompt": "x", "chosen": "a", "rejected": "a"}], "row 0: chosen and rejected are the same"),
        (
            [{"prompt": "x", "chosen": "a", "rejected": None}, {"prompt": "y", "chosen": "b", "rejected": "c"}],
            "row 0: null 'rejected'",
        ),
        ([{"prompt": "x", "chosen": 1, "rejected": 2}], "column 'chosen' has dtype"),
        ([{"prompt": "x", "responses": ["a", "b"], "ranks": [1]}], "row 0: responses and ranks differ in length"),
        ([{"prompt": "x", "responses": ["a", "b"], "ranks": [2, 2]}], "row 0: every response has the same rank"),
        ([{"prompt": "x", "responses": ["a"], "ranks": [1]}], "row 0: fewer than 2 responses"),
        (
            [
                {"prompt": "x", "responses": ["a", "b"], "ranks": [1, 2]},
                {"prompt": "y", "responses": ["a", "a"], "ranks": [1, 2]},
            ],
            "row 1: a response appears twice",
        ),
        ([{"prompt": "x", "responses": ["a", "b"]}], "needs columns prompt, chosen, rejected"),
        ([{"prompt": "x", "chosen": "a", "rejected": "b", "split": "test"}], "split must be 'train' or 'heldout'"),
    ],
)
def test_bad_preference_files_are_named(tmp_path, rows, needle):
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(PreferenceDataError) as err:
        load_preferences(path, 0.5, 0, FORMATTER)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_missing_empty_and_unreadable_files(tmp_path):
    with pytest.raises(PreferenceDataError, match="not found"):
        load_preferences(tmp_path / "nope.parquet", 0.1, 0, FORMATTER)
    (tmp_path / "bad.parquet").write_bytes(b"junk")
    with pytest.raises(PreferenceDataError, match="cannot read"):
        load_preferences(tmp_path / "bad.parquet", 0.1, 0, FORMATTER)
    pl.DataFrame(schema={"prompt": pl.Utf8, "chosen": pl.Utf8, "rejected": pl.Utf8}).write_parquet(
        tmp_path / "empty.parquet"
    )
    with pytest.raises(PreferenceDataError, match="is empty"):
        load_preferences(tmp_path / "empty.parquet", 0.1, 0, FORMATTER)
