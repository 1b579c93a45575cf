"""GRPO advantages in Polars: hand values, the edge rules, and a reference loop on random data."""

import random
import statistics

import polars as pl
import pytest

from tasks.advantages import ADVANTAGE_ESTIMATORS, compute_advantages


def frame(groups: dict[str, list[float]]) -> pl.DataFrame:
    rows = [(p, i, r) for p, rs in groups.items() for i, r in enumerate(rs)]
    return pl.DataFrame(rows, schema={"prompt_id": pl.Utf8, "sample_idx": pl.Int32, "reward": pl.Float64}, orient="row")


def test_grpo_hand_values():
    # group a: rewards [1, 0, 0, 1] → mean 0.5, std (ddof=1) = sqrt(1/3) = 0.57735
    out = ADVANTAGE_ESTIMATORS["grpo"](frame({"a": [1, 0, 0, 1]}), 1e-6)
    expected = 0.5 / (0.5773503 + 1e-6)
    assert out["advantage"].to_list() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)
    assert expected == pytest.approx(0.8660, abs=1e-4)


def test_grpo_edge_rules_single_sample_and_all_equal_groups_get_zero():
    out = ADVANTAGE_ESTIMATORS["grpo"](frame({"single": [1.0], "same": [0.7, 0.7, 0.7]}), 1e-6)
    assert out["advantage"].to_list() == [0.0, 0.0, 0.0, 0.0]


def test_grpo_matches_reference_loop_on_random_data():
    rnd = random.Random(0)
    groups = {f"p{i}": [rnd.choice([0.0, 0.1, 1.0, 1.1]) for _ in range(rnd.randint(1, 9))] for i in range(300)}
    got = ADVANTAGE_ESTIMATORS["grpo"](frame(groups), 1e-6)
    expected = []
    for rewards in groups.values():
        if len(rewards) < 2:
            expected += [0.0] * len(rewards)
            continue
        mean, std = statistics.mean(rewards), statistics.stdev(rewards)
        expected += [(r - mean) / (std + 1e-6) for r in rewards]
    assert got["advantage"].to_list() == pytest.approx(expected, abs=1e-9)


def test_advantages_broadcast_to_every_response_token():
    scores = frame({"a": [1.0, 0.0]})
    lengths = pl.DataFrame({"prompt_id": ["a", "a"], "sample_idx": [0, 1], "length": [3, 1]},
                           schema={"prompt_id": pl.Utf8, "sample_idx": pl.Int32, "length": pl.Int32})
    out = compute_advantages(scores, lengths, "grpo", 1e-6).sort("sample_idx")
    a = 0.5 / (0.7071068 + 1e-6)
    assert out["token_advantages"].to_list()[0] == pytest.approx([a, a, a], rel=1e-5)
    assert out["token_advantages"].to_list()[1] == pytest.approx([-a], rel=1e-5)
