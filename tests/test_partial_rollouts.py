"""Partial rollouts' pure steps (tasks/stages/partial_rollouts.py), against values worked out by hand: the pool a round
plans, what it asks of the sampler, how a chunk extends a sequence, which groups leave, which carried groups are too
old. The stage itself, with vLLM and the trainer, is test_e2e.py's test_partial_rollouts_*."""

import polars as pl

from tasks.stages.partial_rollouts import CARRY_COLUMNS, advance, empty_carry, plan_round, split_ended, surplus_carry


def carry_rows(rows: list[dict]) -> pl.DataFrame:
    base = {"prompt_iteration": 1, "prompt_token_ids": [7, 8], "text": "", "finish_reason": "length", "ended": False}
    full = [{**base, **r, "sampler_logprobs": [-1.0] * len(r["token_ids"])} for r in rows]
    return pl.DataFrame(full, schema=CARRY_COLUMNS)


def prompts(ids: list[str]) -> pl.DataFrame:
    return pl.DataFrame({"prompt_id": ids, "prompt_token_ids": [[1, i] for i in range(len(ids))]})


def plan(carry, new, **kw):
    args = dict(
        iteration=3,
        version=2,
        group_size=2,
        prompts_per_round=3,
        partial_tokens=4,
        max_tokens=10,
        min_tokens=0,
        max_staleness=1,
    )
    return plan_round(carry, new, **{**args, **kw})


def test_a_round_keeps_fresh_carried_groups_drops_stale_ones_and_fills_the_pool():
    carry = carry_rows(
        [
            # group a: started at version 1 (age 1 at version 2: kept), one sample ended already
            {"prompt_id": "a", "sample_idx": 0, "token_ids": [5, 5, 5], "token_versions": [1, 1, 2], "ended": True},
            {"prompt_id": "a", "sample_idx": 1, "token_ids": [6, 6, 6, 6, 6, 6, 6], "token_versions": [1] * 7},
            # group b: a token of version 0 (age 2 > 1): dropped, both samples
            {"prompt_id": "b", "sample_idx": 0, "token_ids": [4], "token_versions": [0]},
            {"prompt_id": "b", "sample_idx": 1, "token_ids": [4, 4], "token_versions": [1, 1]},
        ]
    )
    p = plan(carry, prompts(["a", "c", "d", "e"]))
    assert p.stale_groups == 1
    # 3 groups at most: a (carried), then c and d (a is in flight already, so skipped among the new ones; e waits)
    assert p.admitted_groups == 2
    assert p.pool["prompt_id"].to_list() == ["a", "a", "c", "c", "d", "d"]
    assert p.pool["sample_idx"].to_list() == [0, 1, 0, 1, 0, 1]
    assert p.pool["prompt_iteration"].to_list() == [1, 1, 3, 3, 3, 3]
    # a's ended sample asks for nothing; its other one continues its prefix with 10 − 7 = 3 tokens (< 4); the new
    # ones get 4; each request's seed offset is its row in the pool, and its group goes along for the replicas' deal
    r = p.requests
    assert r["prompt_id"].to_list() == ["1", "2", "3", "4", "5"]
    assert r["prompt_token_ids"].to_list() == [[7, 8, 6, 6, 6, 6, 6, 6, 6], [1, 1], [1, 1], [1, 2], [1, 2]]
    assert r["max_tokens"].to_list() == [3, 4, 4, 4, 4]
    assert r["seed_offset"].to_list() == [1, 2, 3, 4, 5]
    assert r["group"].to_list() == ["a", "c", "c", "d", "d"]
    assert r["min_tokens"].to_list() == [0] * 5


def test_staleness_zero_drops_every_group_from_an_older_version_and_taken_prompts_are_not_admitted_again():
    carry = carry_rows([{"prompt_id": "a", "sample_idx": k, "token_ids": [5], "token_versions": [1]} for k in (0, 1)])
    p = plan(carry, prompts(["a", "b", "c"]), max_staleness=0, taken=pl.Series(["b"]))
    assert p.stale_groups == 1 and p.pool["prompt_id"].unique(maintain_order=True).to_list() == ["a", "c"]
    same_version = plan(carry, prompts(["x"]), max_staleness=0, version=1)  # no update between: age 0
    assert same_version.stale_groups == 0 and same_version.pool.height == 4


def test_min_tokens_counts_the_prefix():
    carry = carry_rows([{"prompt_id": "a", "sample_idx": 0, "token_ids": [5, 5], "token_versions": [2, 2]}])
    p = plan(carry, prompts([]), group_size=1, min_tokens=5, partial_tokens=2)
    assert p.requests["min_tokens"].to_list() == [2]  # min(5 − 2, the chunk of 2)
    assert p.requests["max_tokens"].to_list() == [2]


def test_a_chunk_extends_its_sequence_and_ended_groups_leave_the_pool():
    pool = carry_rows(
        [
            {"prompt_id": "a", "sample_idx": 0, "token_ids": [5], "token_versions": [1], "text": "x", "ended": True}
            | {"finish_reason": "stop"},
            {"prompt_id": "a", "sample_idx": 1, "token_ids": [6], "token_versions": [1], "text": "y"},
            {"prompt_id": "b", "sample_idx": 0, "token_ids": [], "token_versions": []},
        ]
    )
    generated = pl.DataFrame(
        {
            "prompt_id": ["1", "2"],
            "token_ids": [[9, 2], [3, 3]],
            "text": ["zz", "ww"],
            "sampler_logprobs": [[-0.5, -0.25], [-2.0, -3.0]],
            "finish_reason": ["stop", "length"],
        },
        schema_overrides={"token_ids": pl.List(pl.Int32), "sampler_logprobs": pl.List(pl.Float32)},
    )
    grown = advance(pool, generated, version=2, max_tokens=10)
    assert grown["token_ids"].to_list() == [[5], [6, 9, 2], [3, 3]]
    assert grown["token_versions"].to_list() == [[1], [1, 2, 2], [2, 2]]
    assert grown["sampler_logprobs"].to_list() == [[-1.0], [-1.0, -0.5, -0.25], [-2.0, -3.0]]
    assert grown["text"].to_list() == ["x", "yzz", "ww"]
    assert grown["ended"].to_list() == [True, True, False]  # a stop ends a sequence; a chunk's length does not
    rows, left = split_ended(grown)
    assert rows["prompt_id"].to_list() == ["a", "a"] and left["prompt_id"].to_list() == ["b"]
    assert rows["length"].to_list() == [1, 3] and rows["policy_version"].to_list() == [1, 1]
    assert rows["truncated"].to_list() == [False, False]
    at_limit = advance(grown, generated.head(0), version=3, max_tokens=2)  # b reached max_tokens: ended, truncated
    rows, left = split_ended(at_limit)
    assert left.height == 0 and rows.filter(pl.col("prompt_id") == "b")["truncated"].to_list() == [True]


def test_a_surplus_group_is_carried_ended_and_leaves_the_next_round_without_a_request():
    """rollout.carry_surplus: of the batch's groups, only the one over target_groups is carried (not the kept one, not
    the zero-variance one), every sample ended, its tokens, logprobs and versions as the rollouts hold them."""
    ended = carry_rows(
        [
            {"prompt_id": g, "sample_idx": k, "token_ids": [3 + k], "token_versions": [1], "ended": True}
            | {"finish_reason": "stop"}
            for g in ("a", "b", "c")
            for k in (0, 1)
        ]
    )
    rollouts, _ = split_ended(ended)
    batch = pl.DataFrame({"prompt_id": ["a", "b", "c"], "filter_reason": ["", "over_target", "zero_variance"]})
    carry = surplus_carry(rollouts.with_columns(pl.lit(2, pl.Int32).alias("iteration")), batch)
    assert carry.schema == pl.Schema(CARRY_COLUMNS)
    assert carry["prompt_id"].to_list() == ["b", "b"] and carry["ended"].all()
    assert carry["token_ids"].to_list() == [[3], [4]] and carry["token_versions"].to_list() == [[1], [1]]
    # the next round: b holds no sequence of the sampler's batch (3 new groups fit) and asks for nothing; it leaves
    # the pool at once, as an ended group
    p = plan(carry, prompts(["b", "x", "y", "z", "w"]), max_staleness=1)
    assert p.stale_groups == 0 and p.admitted_groups == 3
    assert p.pool["prompt_id"].unique(maintain_order=True).to_list() == ["b", "x", "y", "z"]
    assert p.requests["group"].unique(maintain_order=True).to_list() == ["x", "y", "z"]
    rows, left = split_ended(p.pool)
    assert rows["prompt_id"].to_list() == ["b", "b"] and left["prompt_id"].unique().sort().to_list() == ["x", "y", "z"]
    assert plan(carry, prompts([]), max_staleness=0).stale_groups == 1  # the staleness bound applies to it too


def test_max_staleness_two_keeps_a_group_two_updates_old_and_drops_one_three_updates_old():
    """rl.max_staleness 2 at version 3 (iteration 4): a group whose oldest token is update 1's is 2 updates old, kept;
    one whose oldest is the starting model's (version 0) is 3 old, dropped with both its samples, and counted once."""
    carry = carry_rows(
        [
            {"prompt_id": "a", "sample_idx": 0, "token_ids": [5, 5], "token_versions": [1, 2]},
            {"prompt_id": "a", "sample_idx": 1, "token_ids": [6, 6], "token_versions": [2, 3]},
            {"prompt_id": "b", "sample_idx": 0, "token_ids": [4, 4], "token_versions": [0, 1]},
            {"prompt_id": "b", "sample_idx": 1, "token_ids": [4, 4, 4], "token_versions": [1, 2, 3]},
        ]
    )
    p = plan(carry, prompts([]), iteration=4, version=3, max_staleness=2)
    assert p.stale_groups == 1 and p.pool["prompt_id"].to_list() == ["a", "a"]
    assert plan(carry, prompts([]), iteration=4, version=3, max_staleness=3).stale_groups == 0


def write_iteration_three(layout, left_over: dict[str, list[int]]) -> None:
    """What iteration 3 of a run leaves for iteration 4 (rollout.carry_surplus): its rollouts, each group of
    `left_over` (its samples' token versions) ended in round 0 and over the batch's target_groups, with one group the
    batch kept; no sequence in flight; update 3 complete, its checkpoint's files never read."""
    from storage import write_stage

    common = {"inputs": {}, "config_hash": "", "started": 0.0}
    stamp = (pl.lit(3, pl.Int32).alias("iteration"), pl.lit(0, pl.Int32).alias("round"))
    groups = {"kept": [2, 2], **left_over}
    ended = carry_rows(
        [
            {"prompt_id": g, "sample_idx": k, "token_ids": [3, 3], "token_versions": v, "ended": True}
            for g, v in groups.items()
            for k in (0, 1)
        ]
    )
    rows, _ = split_ended(ended)
    write_stage(layout, "rollouts", 3, rows.with_columns(*stamp), fp="r3", **common)
    write_stage(layout, "carry", 3, empty_carry().with_columns(*stamp), fp="c3", **common)
    batch = pl.DataFrame({"prompt_id": list(groups), "kept": [g == "kept" for g in groups]}).with_columns(
        *stamp,
        pl.lit(2, pl.Int32).alias("group_size"),
        pl.lit(0.5).alias("reward_mean"),
        pl.lit(0.5).alias("reward_std"),
        pl.when("kept").then(pl.lit("")).otherwise(pl.lit("over_target")).alias("filter_reason"),
        pl.lit(1, pl.Int32).alias("rounds_used"),
    )
    write_stage(layout, "batch", 3, batch, fp="b3", **common)
    update = pl.DataFrame({"iteration": [3], "policy_version": [3], "optimizer_steps": [1], "loss": [0.0]})
    write_stage(layout, "train_metrics", 3, update.cast({pl.Int64: pl.Int32}), fp="u3", **common)
    layout.checkpoint_dir(3).mkdir(parents=True)
    (layout.checkpoint_dir(3) / "config.json").write_text("{}")
    (layout.checkpoint_dir(3) / "model.safetensors").write_bytes(b"")


def test_a_group_past_max_staleness_two_is_dropped_and_counted_by_the_rollouts_stage(tmp_path):
    """The rollouts stage's own task on a run's tables (rollout.carry_surplus, rl.max_staleness 2), iteration 4, which
    samples with update 3's weights: of the groups iteration 3's batch left over, `aged` (its oldest token update 1's:
    2 updates old) is carried into iteration 4's rollouts; `older` (its oldest the starting model's: 3 old, in flight
    since iteration 1) is dropped, and the stage records it where the update's `stale_groups` metric reads it. No
    engine: every carried sample has ended and the round admits no new prompt."""
    from schemas.config import build_config, dump_config
    from schemas.tables import PROMPTS
    from storage import RunLayout, read_manifest, read_stage, write_stage
    from tasks.stages.common import load_run
    from tasks.stages.optimize import SPEC as OPTIMIZE
    from tasks.stages.optimize import stage_metrics
    from tasks.stages.rollouts import rollouts_task

    layout = RunLayout(tmp_path, "stale")
    layout.run_dir.mkdir(parents=True)
    cfg = {
        "storage_root": str(tmp_path),
        "rollout": {"group_size": 2, "partial_tokens": 1, "max_tokens": 8, "carry_surplus": True},
        "rl": {"max_staleness": 2, "iterations": 4},
    }
    layout.config_path.write_text(dump_config(build_config(cfg)))
    write_iteration_three(layout, {"aged": [1, 2], "older": [0, 2]})
    no_prompts = pl.DataFrame(schema=PROMPTS.columns)
    fp = write_stage(layout, "prompts", 4, no_prompts, fp="p4", inputs={}, config_hash="", started=0.0).fingerprint
    rollouts_task.fn(str(tmp_path), "stale", iteration=4, round_=0, upstream={"prompts": fp})
    sampled = read_stage(layout, "rollouts", 4)
    assert sampled["prompt_id"].to_list() == ["aged", "aged"] and sampled["prompt_iteration"].to_list() == [1, 1]
    pool = read_manifest(layout, "rollouts", 4)["extra"]["round0"]
    assert (pool["stale_groups"], pool["surplus_groups"], pool["ended_groups"]) == (1, 1, 0)
    metrics = stage_metrics(load_run(str(tmp_path), "stale", OPTIMIZE), 4)
    assert metrics["stale_groups"] == 1.0 and metrics["surplus_groups"] == 1.0
