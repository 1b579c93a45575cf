"""The reward-hacking checks: the repetition rate against a plain loop, and each flag on made-up runs."""

import random

import polars as pl
import pytest

from tasks.analysis.reward_hacking import hacking_flags, quarter_means, repetition_rate


def repetition_loop(rollouts: list[tuple[int, list[int]]]) -> dict[int, float]:
    per_iter: dict[int, list[float]] = {}
    for iteration, tokens in rollouts:
        bigrams = list(zip(tokens, tokens[1:]))
        rate = 1 - len(set(bigrams)) / len(bigrams) if bigrams else 0.0
        per_iter.setdefault(iteration, []).append(rate)
    return {it: sum(v) / len(v) for it, v in per_iter.items()}


def test_repetition_rate_by_hand():
    # "1 2 1 2 1 2": bigrams (1,2) (2,1) (1,2) (2,1) (1,2): 2 distinct of 5 → 0.6. "5 6 7": none repeated → 0.
    # "9": no bigram → 0. Mean over the three responses of iteration 1: 0.2.
    df = pl.DataFrame({"iteration": [1, 1, 1, 2], "token_ids": [[1, 2, 1, 2, 1, 2], [5, 6, 7], [9], [4, 4, 4]]})
    out = dict(repetition_rate(df).iter_rows())
    assert out[1] == pytest.approx(0.6 / 3)
    assert out[2] == pytest.approx(0.5)  # (4,4) twice: 1 distinct of 2


def test_repetition_rate_matches_a_loop():
    rng = random.Random(0)
    rows = [(rng.randint(1, 4), [rng.randint(0, 3) for _ in range(rng.randint(0, 12))]) for _ in range(300)]
    df = pl.DataFrame(
        {"iteration": [r[0] for r in rows], "token_ids": [r[1] for r in rows]},
        schema={"iteration": pl.Int32, "token_ids": pl.List(pl.Int32)},
    )
    got = dict(repetition_rate(df).iter_rows())
    want = repetition_loop(rows)
    assert got.keys() == want.keys()
    for it in want:
        assert got[it] == pytest.approx(want[it])


def run(rewards, lengths, evals, repetition):
    n = len(rewards)
    metrics = pl.DataFrame({"iteration": range(1, n + 1), "reward_mean": rewards, "response_length_mean": lengths})
    ev = pl.DataFrame({"iteration": [0, n], "accuracy": evals})
    rep = pl.DataFrame({"iteration": range(1, n + 1), "repetition_rate": repetition})
    return {f.name: f.raised for f in hacking_flags(metrics, ev, rep)}


def test_quarter_means():
    df = pl.DataFrame({"iteration": [4, 3, 2, 1, 5, 6, 7, 8], "x": [4.0, 3, 2, 1, 5, 6, 7, 8]})
    assert quarter_means(df, "x") == (1.5, 7.5)  # rows sorted by iteration first


def test_a_healthy_run_raises_nothing():
    flags = run([0.3, 0.32, 0.35, 0.4], [3.2, 3.3, 3.2, 3.4], [0.27, 0.41], [0.0, 0.0, 0.01, 0.0])
    assert flags == {"reward_vs_eval": False, "length_growth": False, "repetition": False}


def test_each_sign_raises_its_flag():
    assert run([0.3, 0.32, 0.35, 0.4], [3.0] * 4, [0.30, 0.30], [0.0] * 4)["reward_vs_eval"]
    assert run([0.3] * 4, [3.0, 4.0, 6.0, 9.0], [0.3, 0.4], [0.0] * 4)["length_growth"]
    assert not run([0.3] * 4, [1.0, 1.0, 1.0, 1.6], [0.3, 0.4], [0.0] * 4)["length_growth"]  # ×1.6 but only 0.6 tokens
    assert run([0.3] * 4, [3.0] * 4, [0.3, 0.4], [0.0, 0.1, 0.2, 0.35])["repetition"]
