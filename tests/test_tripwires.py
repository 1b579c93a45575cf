"""Tripwires (tasks/algos/tripwires.py): each figure by hand, the defaults silent on a healthy iteration, a firing's one
line; and a tiny run built to trip a rule, set to `stop`, exits 1 with that line (end to end)."""

import json
import math

import polars as pl
import pytest

from schemas.config import build_config
from storage import RunLayout
from tasks.algos.tripwires import (
    TRIPWIRES,
    answer_top_share,
    eval_drop_while_reward_rose,
    fired,
    iteration_figures,
    repetition_share,
    zero_variance_streak,
)
from tasks.stages.tripwires import settings
from tests.conftest import rlpipe


def metrics(**columns) -> pl.DataFrame:
    n = len(next(iter(columns.values())))
    base = {
        "iteration": list(range(1, n + 1)),
        "reward_mean": [0.5] * n,
        "truncation_rate": [0.0] * n,
        "zero_std_group_fraction": [0.25] * n,
        "sampler_logprob_gap": [0.01] * n,
        "weight_sync_logprob_gap": [float("nan")] * n,
    }
    return pl.DataFrame({**base, **columns})


def responses(texts: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"prompt_id": [f"p{i % 4}" for i in range(len(texts))], "text": texts})


def test_answer_top_share_is_the_largest_share_of_one_last_line_within_a_source():
    # 10 responses: 7 end on "The answer is Yes." (spaces and case differ), 3 on other lines → 0.7
    texts = ["x\nThe answer is Yes."] * 5 + ["  the answer is yes.  \n\n"] * 2 + ["The answer is No.", "4", "5"]
    assert answer_top_share(responses(texts)) == pytest.approx(0.7)
    # by source (prompt p{i % 4}): "a" holds responses 0 1 4 5 8 9 (4 Yes of 6), "b" 2 3 6 7 (3 Yes of 4); each is
    # under the 8 responses that count by default, and with 5, "b" is
    sources = pl.DataFrame({"prompt_id": ["p0", "p1", "p2", "p3"], "source": ["a", "a", "b", "b"]})
    assert math.isnan(answer_top_share(responses(texts), sources))
    assert answer_top_share(responses(texts), sources, least=5) == pytest.approx(4 / 6)
    assert answer_top_share(responses(texts), sources, least=4) == pytest.approx(3 / 4)


def test_repetition_share_counts_responses_holding_one_line_four_times_or_more():
    texts = ["a\na\na\na", "a\na\na\nb", "The answer is 1.\n" * 55, "x"]
    assert repetition_share(responses(texts)) == pytest.approx(2 / 4)
    assert repetition_share(responses(texts), repeats=3) == pytest.approx(3 / 4)


def test_zero_variance_streak_counts_back_from_the_last_iteration():
    assert zero_variance_streak(metrics(zero_std_group_fraction=[1.0, 0.5, 1.0, 1.0])) == 2
    assert zero_variance_streak(metrics(zero_std_group_fraction=[1.0, 1.0, 0.9])) == 0


def test_eval_drop_counts_only_while_the_reward_rose():
    evals = pl.DataFrame({"iteration": [0, 5, 10], "accuracy": [0.50, 0.55, 0.40]})
    assert eval_drop_while_reward_rose(metrics(reward_mean=[0.1, 0.3, 0.6]), evals) == pytest.approx(0.10)
    assert eval_drop_while_reward_rose(metrics(reward_mean=[0.6, 0.3, 0.1]), evals) == 0.0
    assert eval_drop_while_reward_rose(metrics(reward_mean=[0.1, 0.6]), evals.head(1)) == 0.0


def test_the_defaults_stay_silent_on_a_healthy_iteration():
    history = metrics(reward_mean=[0.2, 0.3, 0.4], truncation_rate=[0.05, 0.0, 0.1])
    evals = pl.DataFrame({"iteration": [0, 3], "accuracy": [0.3, 0.45]})
    texts = [f"Working: {i} + {i} = {2 * i}\nThe answer is {2 * i}." for i in range(16)]
    figures = iteration_figures(responses(texts), history, evals)
    assert figures["answer_top_share"] == pytest.approx(1 / 16)
    assert fired(figures, 3, {}) == []


def test_a_truncated_zero_reward_iteration_fires_its_rule_in_one_line():
    history = metrics(reward_mean=[0.0], truncation_rate=[0.97])
    figures = iteration_figures(
        responses(["1 + 1 ="] * 8), history, pl.DataFrame({"iteration": [0], "accuracy": [0.1]})
    )
    (firing,) = [f for f in fired(figures, 1, {}) if f.rule == "truncated_at_zero_reward"]
    assert firing.line() == (
        "tripwire truncated_at_zero_reward: truncated_zero_reward=0.97 at iteration 1 "
        "(bound 0.9: most responses cut off, reward 0; warn)"
    )


def test_the_config_sets_a_rules_bound_and_action_and_changes_no_fingerprint():
    cfg = build_config({"rl": {"tripwires": {"repetition": {"action": "stop"}, "logprob_gap": {"bound": 0.1}}}})
    got = settings(cfg.rl.tripwires)
    assert got == {"repetition": (TRIPWIRES.entry("repetition").bound, "stop"), "logprob_gap": (0.1, "warn")}
    assert cfg.section_hash("rl") == build_config({}).section_hash("rl")
    off = {"answer_collapse": (0.9, "off")}
    assert fired({"answer_top_share": 1.0}, 2, off) == []


def test_a_tiny_run_built_to_trip_a_stop_rule_exits_1_with_its_line(tiny_sft):
    """Every response has some answer, so a bound of 0 on answer_collapse trips at iteration 1; set to stop, the
    run ends after iteration 1's tables with the one line, recorded for `rlpipe show`."""
    workspace, cfg = tiny_sft
    sets = ["rl.iterations=2", "rl.tripwires.answer_collapse.bound=0", "rl.tripwires.answer_collapse.action=stop"]
    args = [x for s in sets for x in ("--set", s)]
    proc = rlpipe("run", str(cfg), "--run-id", "tripped", *args, cwd=workspace, check=False)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("tripwire answer_collapse:")]
    assert line and "at iteration 1 (bound 0: " in line[-1], proc.stderr[-2000:]
    layout = RunLayout(workspace / "runs", "tripped")
    assert layout.iterations("train_metrics") == [1]
    record = json.loads(layout.tripwires_path.read_text())
    assert set(record) == {"1"} and record["1"]["fired"][0].startswith("tripwire answer_collapse:")
    shown = rlpipe("show", "tripped", cwd=workspace)
    assert "tripwire answer_collapse:" in shown.stdout
