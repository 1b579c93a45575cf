"""The flat-buffer view of list columns and the GAE kernel's edge cases (the values themselves are tested
against the reference loop in test_advantages)."""

import numpy as np
import polars as pl
import pytest

from tasks.algos.advantages import AdvantageSettings, compute_advantages
from tasks.algos.token_lists import flat_lists, from_flat
from tasks.algos.token_scan import gae_flat

F32 = pl.List(pl.Float32)


def test_flat_lists_round_trip_with_null_empty_and_sliced_columns():
    column = pl.Series("v", [[1.0, 2.0], None, [], [3.0], [4.0, 5.0, 6.0]], dtype=F32)
    values, offsets = flat_lists(column)
    assert values.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert offsets.tolist() == [0, 2, 2, 2, 3, 6]
    assert from_flat("v", values, offsets).to_list() == [[1.0, 2.0], [], [], [3.0], [4.0, 5.0, 6.0]]
    assert from_flat("v", values, offsets).dtype == F32
    tail_values, tail_offsets = flat_lists(column.slice(3))  # Arrow offsets of a slice do not start at 0
    assert tail_values.tolist() == [3.0, 4.0, 5.0, 6.0] and tail_offsets.tolist() == [0, 1, 4]


def test_gae_flat_hand_values_and_whitening():
    # Two responses, γ = 1, λ = 0.5. [V = 0.5, 0.25], r = 1: A = [0.125, 0.75] (test_gae_hand_values).
    # [V = 0.0], r = 0, token reward −0.5: A = [−0.5]. Returns = A + V.
    values, offsets = np.array([0.5, 0.25, 0.0], np.float32), np.array([0, 2, 3])
    adv, ret = gae_flat(values, offsets, np.array([1.0, 0.0]), np.array([0.0, 0.0, -0.5]), 1.0, 0.5, 1e-6)
    assert ret.tolist() == pytest.approx([0.625, 1.0, -0.5])
    raw = np.array([0.125, 0.75, -0.5])
    assert adv.tolist() == pytest.approx(((raw - raw.mean()) / (raw.std(ddof=1) + 1e-6)).tolist(), rel=1e-6)


def test_gae_gives_an_empty_response_empty_lists_and_zero_advantage():
    df = pl.DataFrame(
        {"prompt_id": ["p", "p", "p"], "sample_idx": [0, 1, 2], "reward": [1.0, 0.0, 1.0], "length": [2, 0, 0]},
        schema_overrides={"sample_idx": pl.Int32, "length": pl.Int32},
    )
    df = df.with_columns(pl.Series("values", [[0.5, 0.25], [], None], dtype=F32))
    out = compute_advantages(df, "gae", AdvantageSettings(gamma=1.0, lam=0.5))
    assert out["returns"].to_list() == [pytest.approx([0.625, 1.0]), [], []]
    assert out["advantage"].to_list()[1:] == [0.0, 0.0]
    assert out["advantage"][0] == out["token_advantages"][0][0]


def test_gae_rejects_kl_lists_that_do_not_match_the_values():
    df = pl.DataFrame({"prompt_id": ["p"], "sample_idx": [0], "reward": [1.0], "length": [2]}).with_columns(
        pl.Series("values", [[0.5, 0.25]], dtype=F32),
        pl.Series("old_logprobs", [[-1.0]], dtype=F32),
        pl.Series("ref_logprobs", [[-1.0, -1.0]], dtype=F32),
    )
    with pytest.raises(ValueError, match="old_logprobs and values have different lengths"):
        compute_advantages(df, "gae", AdvantageSettings(kl_beta=0.1))
