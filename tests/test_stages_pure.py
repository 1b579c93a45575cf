"""Stage logic on tiny frames: rewards, dynamic filtering, pass@k, prompt sampling, metrics."""

import math

import polars as pl
import pytest

from schemas.config import RewardConfig
from tasks.algos.metrics import sampler_gap
from tasks.data.arithmetic import make_splits
from tasks.rewards.scoring import RewardError, score_frame
from tasks.stages.batch import select_groups
from tasks.stages.evaluate import pass_at_k
from tasks.stages.prompts import sample_prompts


def prompts_frame(answer, prompt_id="p0", text="6+6="):
    return pl.DataFrame({"prompt_id": [prompt_id], "text": [text], "answer": [answer]})


def rollouts(texts, reasons=None, prompt="p0"):
    n = len(texts)
    return pl.DataFrame(
        {
            "iteration": [1] * n,
            "round": [0] * n,
            "prompt_id": [prompt] * n,
            "sample_idx": list(range(n)),
            "text": texts,
            "finish_reason": reasons or ["stop"] * n,
        },
        schema_overrides={"iteration": pl.Int32, "round": pl.Int32, "sample_idx": pl.Int32},
    )


def scores(groups):
    rows = [(1, r, p, i, x) for p, (r, xs) in groups.items() for i, x in enumerate(xs)]
    return pl.DataFrame(
        rows,
        schema={
            "iteration": pl.Int32,
            "round": pl.Int32,
            "prompt_id": pl.Utf8,
            "sample_idx": pl.Int32,
            "reward": pl.Float64,
        },
        orient="row",
    )


def test_select_groups_drops_zero_variance_and_caps_at_target():
    s = scores({"a": (0, [1, 1]), "b": (0, [0, 1]), "c": (0, [0, 0]), "d": (1, [1, 0]), "e": (1, [0, 1])})
    g = select_groups(s, target_groups=2, drop_zero_variance=True)
    reasons = dict(zip(g["prompt_id"], g["filter_reason"]))
    assert reasons == {"a": "zero_variance", "b": "", "c": "zero_variance", "d": "", "e": "over_target"}
    assert g.filter("kept")["prompt_id"].to_list() == ["b", "d"]
    assert select_groups(s, 10, drop_zero_variance=False)["kept"].sum() == 5


def test_pass_at_k_hand_values():
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 8, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(8, 2, 4) == pytest.approx(1 - 15 / 70)  # 1 − C(6,4)/C(8,4)


def test_prompt_rounds_do_not_repeat_within_an_iteration_and_are_deterministic():
    train, held_out = make_splits(9, "+", 10, seed=1)
    assert set(train["prompt"]).isdisjoint(held_out["prompt"])
    train = train.with_columns(pl.lit("train").alias("split"))
    r0, r1 = sample_prompts(train, 20, 0, 3, 0), sample_prompts(train, 20, 0, 3, 1)
    assert set(r0["prompt_id"]).isdisjoint(r1["prompt_id"])
    assert r0.equals(sample_prompts(train, 20, 0, 3, 0))


def test_sampler_gap_is_mean_absolute_token_difference():
    lst = pl.List(pl.Float32)
    roll = pl.DataFrame(
        {"prompt_id": ["a", "b"], "sample_idx": [0, 0], "sampler_logprobs": [[-1.0, -2.0], [-0.5]]},
        schema_overrides={"sampler_logprobs": lst},
    )
    lp = pl.DataFrame(
        {"prompt_id": ["a", "b"], "sample_idx": [0, 0], "old_logprobs": [[-1.5, -2.0], [-0.25]]},
        schema_overrides={"old_logprobs": lst},
    )
    assert sampler_gap(roll, lp) == pytest.approx((0.5 + 0.0 + 0.25) / 3)


def test_padded_operands_sit_at_fixed_positions_and_answers_stay_canonical():
    train, held_out = make_splits(99, "+", 10, seed=1, pad=True)
    texts = train["prompt"].to_list() + held_out["prompt"].to_list()
    assert all(len(t) == 6 and t[2] == "+" for t in texts)
    row = pl.concat([train, held_out]).filter(pl.col("prompt") == "07+05=")
    assert row["answer"].to_list() == ["12"]


def test_flawed_teachers_err_only_where_their_flaw_applies():
    import random

    from tasks.data.arithmetic import flawed_answer, no_carry_sum, teacher_response

    assert no_carry_sum(37, 58) == 85 and no_carry_sum(99, 99) == 88 and no_carry_sum(12, 34) == 46
    assert flawed_answer("37+58=", "95", "forget_carry") == "85"
    assert flawed_answer("07+05=", "12", "forget_carry") == "2"  # zero-padded operands parse
    always = random.Random(0)
    assert teacher_response("12+34=", "46", "forget_carry", 1.0, always) == "46"  # no carry: nothing to forget
    assert teacher_response("37+58=", "95", "none", 1.0, always) == "95"
    rnd = random.Random(1)
    wrong = sum(teacher_response("37+58=", "95", "forget_carry", 0.3, rnd) == "85" for _ in range(2000))
    assert 500 < wrong < 700  # ≈ 30%


def test_artifact_markdown_summarises_rewards_and_shows_samples():
    from tasks.stages.artifacts import reward_summary_markdown, samples_markdown

    df = score_frame(rollouts(["12", "13", "x"]), prompts_frame("12"), RewardConfig(workers=0), 8)
    md = reward_summary_markdown(df)
    assert "| reward | 0.4000 |" in md and "| 1.1 | 1 |" in md and "errors: 0 of 3" in md
    prompts = prompts_frame("12")
    sample = samples_markdown(prompts, rollouts(["12", "13", "x"]), df, n=2)
    assert "`6+6=`" in sample and "`13`" in sample and "`x`" not in sample


def test_the_reward_model_column_adds_to_the_rule_reward_and_must_be_finite():
    """The reward-model source, its engine call handed in (a stand-in for the torch worker)."""
    from tasks.rewards.sources import Calls, RewardModel

    def calls(model_scores):
        rollouts = pl.DataFrame({"prompt_token_ids": [[1], [1]], "token_ids": [[2], [3]]})
        return Calls(
            rollouts=rollouts, prompts=pl.DataFrame(), turns=None, max_tokens=8, answer_key=None,
            step_ends=None, reward_model=lambda data: pl.Series(model_scores), process_model=None, local_judge=None,
        )  # fmt: skip

    scores = pl.DataFrame({"reward": [1.0, 0.0]})
    reward = RewardConfig(kind="model", model_path="rm", model_weight=2.0)
    out = RewardModel().add(reward, scores, calls([0.5, -2.0]), "t")
    assert out["score_model"].to_list() == [0.5, -2.0] and out["reward"].to_list() == [2.0, -4.0]
    with pytest.raises(RewardError, match="non-finite"):
        RewardModel().add(reward, scores, calls([0.5, math.nan]), "t")


def test_reward_model_rule_spearman_is_recorded_when_both_columns_exist():
    from tasks.algos.metrics import rollout_metrics

    rollouts = pl.DataFrame({"length": [2, 2, 2, 2], "truncated": [False] * 4})
    batch = pl.DataFrame({"reward_std": [0.5], "rounds_used": [1], "kept": [True]})
    scores = pl.DataFrame(
        {
            "reward": [0.1, 0.9, 0.4, 0.2],
            "error": [None] * 4,
            "score_accuracy": [0.0, 1.0, 1.0, 0.0],
            "score_model": [0.1, 0.9, 0.4, 0.2],
        },
        schema_overrides={"error": pl.Utf8},
    )
    # Ranks of the model's scores 1, 4, 3, 2 against the rule's ties 1.5, 3.5, 3.5, 1.5: ρ = 0.894 (by hand:
    # Pearson of the two rank vectors, 4/√20).
    assert rollout_metrics(rollouts, scores, batch)["reward_model_rule_spearman"] == pytest.approx(4 / 20**0.5)
    assert "reward_model_rule_spearman" not in rollout_metrics(rollouts, scores.drop("score_model"), batch)


def test_only_the_last_optimizer_states_and_weights_only_checkpoint_are_kept(tmp_path):
    from storage import RunLayout
    from tasks.engines.workers.engine_cache import write_state_id
    from tasks.stages.optimize import prune_checkpoints

    layout = RunLayout(tmp_path, "r")
    for k in range(1, 5):
        for state in (layout.checkpoint_dir(k) / "ds_state", layout.critic_dir(k) / "ds_state"):
            state.mkdir(parents=True)
            (state.parent / "model.safetensors").write_bytes(b"w")
    prune_checkpoints(layout, 4, 2)
    assert [(layout.checkpoint_dir(k) / "ds_state").exists() for k in range(1, 5)] == [False, False, True, True]
    assert [(layout.critic_dir(k) / "ds_state").exists() for k in range(1, 5)] == [False, False, True, True]
    assert all((layout.checkpoint_dir(k) / "model.safetensors").exists() for k in range(1, 5))  # weights stay
    prune_checkpoints(layout, 4, None)  # keep all: nothing else goes
    assert (layout.checkpoint_dir(3) / "ds_state").exists()
    # checkpoint.every: weights-only checkpoints 5 and 6 after full 4; once 6 is complete, 5 goes (a replay rebuilds
    # it) and the last two full checkpoints keep their state
    for k in (5, 6):
        layout.checkpoint_dir(k).mkdir(parents=True)
        write_state_id(str(layout.checkpoint_dir(k)), weights_only=True)
    prune_checkpoints(layout, 6, 2)
    assert layout.checkpoint_iterations() == [1, 2, 3, 4, 6]
    assert [(layout.checkpoint_dir(k) / "ds_state").exists() for k in (3, 4)] == [True, True]
    prune_checkpoints(layout, 5, 2)  # a later weights-only checkpoint is not this update's to remove
    assert layout.checkpoint_iterations() == [1, 2, 3, 4, 6]


def test_a_full_checkpoint_after_weights_only_ones_is_estimated_with_the_newest_state(tmp_path):
    from types import SimpleNamespace

    from storage import RunLayout
    from tasks.stages.optimize import checkpoint_bytes

    layout = RunLayout(tmp_path, "r")
    for k, state in [(5, 3000), (6, 0), (7, 0)]:
        folder = layout.checkpoint_dir(k)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w" * 1000)
        if state:
            (folder / "ds_state").mkdir()
            (folder / "ds_state" / "optim.pt").write_bytes(b"s" * state)
    start = tmp_path / "start"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"w" * 900)
    ctx = SimpleNamespace(
        layout=layout, cfg=SimpleNamespace(lora=SimpleNamespace(enabled=False), model=SimpleNamespace(path=str(start)))
    )

    def update(full: bool, weights: bool = True):
        return SimpleNamespace(save_state=full, save_weights=weights)

    policy = SimpleNamespace(path=str(layout.checkpoint_dir(7)), version=7)
    assert checkpoint_bytes(ctx, policy, update(full=False)) == 1000  # the weights alone
    assert checkpoint_bytes(ctx, policy, update(full=True)) == 1000 + 3000  # and checkpoint 5's state
    assert checkpoint_bytes(ctx, policy, update(full=False, weights=False)) == 0  # the trainer keeps the weights
    policy = SimpleNamespace(path=str(layout.checkpoint_dir(5)), version=5)
    assert checkpoint_bytes(ctx, policy, update(full=False)) == 1000  # a full checkpoint's weights, without its state
    (layout.checkpoint_dir(7) / "model.safetensors").unlink()  # one its trainer held (engines.weight_sync collective)
    policy = SimpleNamespace(path=str(layout.checkpoint_dir(7)), version=7)
    assert checkpoint_bytes(ctx, policy, update(full=True)) == 900 + 3000  # sized by the starting model's weights
