"""`rlpipe export-data`: the pair rules on hand-made groups, the WHERE filter and the provenance on a run written by
hand, bad input as one line, and the round trip on a real run: its SFT rows train with `rlpipe sft`, its pairs with
`rlpipe dpo`, and every exported row joins back to the run's tables in SQL."""

import json
import time

import polars as pl
import pytest

from storage import RunLayout, read_manifest, write_stage
from tasks.analysis.export_data import export_data, pair_rows, read_samples
from tasks.analysis.query import QueryError, connect
from tests.conftest import rlpipe, write_sampled_round


def group_frame(rows: list[tuple[str, int, str, float | None]]) -> pl.DataFrame:
    """Samples of iteration 1 as read_samples gives them: (prompt_id, sample_idx, response, reward)."""
    n = len(rows)
    return pl.DataFrame(
        {
            "run_id": ["r"] * n,
            "iteration": [1] * n,
            "prompt_id": [p for p, *_ in rows],
            "sample_idx": [k for _, k, _, _ in rows],
            "policy_version": [0] * n,
            "config_hash": ["c"] * n,
            "reward_fingerprint": ["f"] * n,
            "prompt": [[{"role": "user", "content": p}] for p, *_ in rows],
            "response": [t for _, _, t, _ in rows],
            "reward": [r for *_, r in rows],
        },
        schema_overrides={"iteration": pl.Int32, "sample_idx": pl.Int32, "policy_version": pl.Int32},
    )


GROUPS = group_frame(
    [
        ("a", 0, "a0", 1.0),
        ("a", 1, "a1", 0.0),
        ("a", 2, "a2", 1.0),
        ("a", 3, "a3", 0.5),
        ("b", 0, "b0", 0.5),  # b: every reward equal, no pair
        ("b", 1, "b1", 0.5),
        ("c", 0, "same", 1.0),  # c: one text twice (rewards differ), and a sample without a reward
        ("c", 1, "same", 0.0),
        ("c", 2, "c2", None),
    ]
)


def pairs_of(frame: pl.DataFrame) -> list[tuple[str, int, int]]:
    return list(zip(frame["prompt_id"], frame["chosen_sample_idx"], frame["rejected_sample_idx"]))


def test_best_worst_pairs_a_groups_highest_reward_with_its_lowest_and_skips_ties():
    pairs = pair_rows(GROUPS, "best-worst")
    assert pairs_of(pairs) == [("a", 0, 1)]  # 1.0 (the lower index of two) against 0.0
    assert pairs.row(0, named=True) | {"prompt": None} == {
        "run_id": "r",
        "iteration": 1,
        "prompt_id": "a",
        "config_hash": "c",
        "prompt": None,
        "chosen": "a0",
        "rejected": "a1",
        "chosen_sample_idx": 0,
        "chosen_reward": 1.0,
        "chosen_policy_version": 0,
        "chosen_reward_fingerprint": "f",
        "rejected_sample_idx": 1,
        "rejected_reward": 0.0,
        "rejected_policy_version": 0,
        "rejected_reward_fingerprint": "f",
    }
    assert pair_rows(GROUPS, "best-worst", min_margin=1.5).is_empty()


def test_all_pairs_every_two_samples_whose_rewards_differ_by_the_margin():
    # a: 1.0, 0.0, 1.0, 0.5 → (0,1) (0,3) (2,1) (2,3) (3,1); the equal 0 and 2 never pair
    assert pairs_of(pair_rows(GROUPS, "all")) == [("a", 0, 1), ("a", 0, 3), ("a", 2, 1), ("a", 2, 3), ("a", 3, 1)]
    assert pairs_of(pair_rows(GROUPS, "all", min_margin=0.6)) == [("a", 0, 1), ("a", 2, 1)]
    assert pairs_of(pair_rows(GROUPS, "all", min_margin=0.5)) == pairs_of(pair_rows(GROUPS, "all"))


@pytest.fixture
def hand_run(tmp_path):
    """Two iterations written as the flow writes them, without an engine: a prompt per key, its samples the texts;
    a response "7" scores 1, any other 0; iteration 2's advantages only for prompt q."""
    layout = RunLayout(tmp_path / "runs", "hand")
    common = {"inputs": {}, "config_hash": "rew", "started": time.time()}
    for it in (1, 2):
        write_sampled_round(layout, it, {"p": ["7", "8", "7 "], "q": ["1", "7"]})
        rollouts = pl.read_parquet(layout.part_path("rollouts", it, 0))
        scores = rollouts.select(
            "iteration", "round", "prompt_id", "sample_idx", (pl.col("text") == "7").cast(pl.Float64).alias("reward")
        ).with_columns(pl.lit(None, pl.Utf8).alias("error"))
        write_stage(layout, "scores", it, scores, fp=f"scores-{it}", **common)
    adv = scores.filter(pl.col("prompt_id") == "q").select(
        "iteration", "prompt_id", "sample_idx", "reward", (pl.col("reward") - 0.5).alias("advantage")
    )
    adv = adv.with_columns(
        pl.col("advantage").cast(pl.Float32).repeat_by(2).alias("token_advantages"),
        pl.col("advantage").cast(pl.Float32).repeat_by(2).alias("returns"),
    )
    write_stage(layout, "advantages", 2, adv, fp="adv-2", **common)
    return layout


def test_the_where_filters_over_the_joined_columns_and_each_row_carries_its_provenance(hand_run):
    root = str(hand_run.root)
    every = read_samples("hand", root, None)
    assert every.height == 10 and every.columns[:7] == [
        "run_id",
        "iteration",
        "prompt_id",
        "sample_idx",
        "policy_version",
        "config_hash",
        "reward_fingerprint",
    ]
    assert set(every["config_hash"]) == {""}  # write_sampled_round's rollouts manifests
    assert every.filter(pl.col("iteration") == 2)["reward_fingerprint"].unique().to_list() == ["scores-2"]
    assert every["advantage"].null_count() == 8  # only iteration 2's q was trained on
    right = read_samples("hand", root, "reward > 0 AND prompt_id = 'p'")
    assert list(zip(right["iteration"], right["sample_idx"], right["response"])) == [(1, 0, "7"), (2, 0, "7")]
    # a subquery over another of the run's tables
    trained = read_samples("hand", root, "advantage IS NOT NULL")
    assert list(zip(trained["iteration"], trained["prompt_id"], trained["sample_idx"])) == [(2, "q", 0), (2, "q", 1)]
    ever = read_samples("hand", root, "prompt_id IN (SELECT prompt_id FROM advantages)")
    assert ever.height == 4 and set(ever["prompt_id"]) == {"q"}
    same = "samples.prompt_id IN (SELECT prompt_id FROM advantages a WHERE a.iteration = samples.iteration)"
    assert read_samples("hand", root, same).height == 2  # correlated: iteration 2's q alone
    assert read_samples("hand", root, "prompt[1].content = 'q' AND answer = '7'").height == 4


@pytest.mark.parametrize(
    "where, needle",
    [
        ("reward", "must be a filter"),
        ("reward > 0; DROP TABLE rollouts", "not one SQL expression"),
        ("1) UNION SELECT (1", "not one SQL expression"),
        ("count(*) > 1", "cannot contain aggregates"),
        ("nope > 1", '"nope" not found'),
        ("prompt_id IN (SELECT * FROM read_csv('/etc/passwd'))", "failed"),
    ],
)
def test_a_where_that_is_not_a_filter_of_the_samples_is_refused(hand_run, where, needle):
    with pytest.raises(QueryError, match=needle.replace("(", r"\(").replace("*", r"\*")):
        read_samples("hand", str(hand_run.root), where)


def test_shapes_and_formats_on_the_hand_run(hand_run, tmp_path):
    root = str(hand_run.root)
    out = export_data("hand", str(tmp_path / "sft.jsonl"), "sft", "reward > 0", root=root)
    assert out == {"rows": 4, "samples": 4, "shape": "sft", "format": "jsonl", "out": str(tmp_path / "sft.jsonl")}
    rows = [json.loads(line) for line in (tmp_path / "sft.jsonl").read_text().splitlines()]
    assert rows[0]["prompt"] == [{"role": "user", "content": "p"}] and rows[0]["response"] == "7"
    pairs = export_data("hand", str(tmp_path / "pairs.parquet"), "pairs", root=root)
    assert pairs["rows"] == 4  # p: 7 over 8, q: 7 over 1, in each iteration
    frame = pl.read_parquet(tmp_path / "pairs.parquet")
    assert set(zip(frame["chosen"], frame["rejected"])) == {("7", "8"), ("7", "1")}


def test_a_hugging_face_datasets_folder_when_the_package_is_installed(hand_run, tmp_path):
    datasets = pytest.importorskip("datasets")  # not one of rlpipe's dependencies: --format hf is optional
    out = export_data("hand", str(tmp_path / "pairs-hf"), "pairs", fmt="hf", root=str(hand_run.root))
    loaded = datasets.load_from_disk(str(tmp_path / "pairs-hf"))
    assert out["rows"] == loaded.num_rows == 4 and loaded[0]["prompt"] == [{"role": "user", "content": "p"}]
    assert {"chosen", "rejected", "chosen_reward_fingerprint"} <= set(loaded.column_names)


def test_bad_input_is_one_line_and_a_non_zero_exit(hand_run, tmp_path):
    root = str(hand_run.root)
    for args, needle in (
        (["nope", "x.parquet"], "run 'nope' not found"),
        (["hand", "x.parquet", "--where", "reward"], "--where must be a filter"),
        (["hand", "x.parquet", "--where", "reward > 0; DROP TABLE scores"], "not one SQL expression"),
        (["hand", "x.parquet", "--shape", "dpo"], "unknown --shape 'dpo': choose sft, pairs or raw"),
        (["hand", "x.parquet", "--shape", "pairs", "--pairs", "best"], "unknown pair rule 'best'"),
        (["hand", "x.csv"], "name a .parquet or .jsonl file"),
        (["hand", "x.parquet", "--where", "reward > 5"], "no scored sample"),
    ):
        proc = rlpipe("export-data", *args, "--root", root, cwd=tmp_path, check=False)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.stderr.strip().count("\n") == 0 and needle in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "x.parquet").exists()


@pytest.mark.e2e
def test_exported_sft_rows_and_pairs_train_with_sft_and_dpo_and_join_back_in_sql(one_iteration):
    workspace, layout = one_iteration
    root, run = str(layout.root), layout.run_id
    sft_file, pairs_file = workspace / "export" / "sft.parquet", workspace / "export" / "pairs.jsonl"
    rlpipe("export-data", run, str(sft_file), "--shape", "sft", "--where", "reward > 0 AND NOT truncated",
           "--root", root, cwd=workspace)  # fmt: skip
    rlpipe("export-data", run, str(pairs_file), "--shape", "pairs", "--pairs", "best-worst", "--root", root,
           cwd=workspace)  # fmt: skip
    sft, pairs = pl.read_parquet(sft_file), pl.read_ndjson(pairs_file)
    assert sft.height > 0 and (sft["reward"] > 0).all() and pairs.height >= 4

    # The provenance joins back: every exported row is one sample of the run, with its text, reward and version.
    con = connect([run], root)
    con.register("sft_export", sft.to_arrow())
    con.register("pairs_export", pairs.to_arrow())
    joined = con.sql(
        "SELECT count(*) FROM sft_export e JOIN rollouts r USING (run_id, iteration, prompt_id, sample_idx) "
        "JOIN scores s USING (run_id, iteration, prompt_id, sample_idx) "
        "WHERE r.text = e.response AND r.policy_version = e.policy_version AND s.reward = e.reward AND NOT r.truncated"
    ).fetchall()[0][0]
    assert joined == sft.height
    sides = con.sql(
        "SELECT count(*) FROM pairs_export e "
        "JOIN scores c ON c.iteration = e.iteration AND c.prompt_id = e.prompt_id "
        "AND c.sample_idx = e.chosen_sample_idx "
        "JOIN scores w ON w.iteration = e.iteration AND w.prompt_id = e.prompt_id "
        "AND w.sample_idx = e.rejected_sample_idx "
        "JOIN rollouts rc ON rc.iteration = e.iteration AND rc.prompt_id = e.prompt_id "
        "AND rc.sample_idx = e.chosen_sample_idx "
        "WHERE c.reward = e.chosen_reward AND w.reward = e.rejected_reward AND c.reward > w.reward "
        "AND rc.text = e.chosen"
    ).fetchall()[0][0]
    assert sides == pairs.height
    # and to the manifests: config_hash is the rollouts', reward_fingerprint the scores part's
    for it in (1, 2):
        mine = sft.filter(pl.col("iteration") == it)
        assert set(mine["config_hash"]) <= {read_manifest(layout, "rollouts", it)["config_hash"]}
        parts = {p["fingerprint"] for p in read_manifest(layout, "scores", it)["parts"]}
        assert set(mine["reward_fingerprint"]) <= parts

    # The round trip: the SFT rows as sft.files, the pairs as preference.data, a few tiny steps each.
    cfg = workspace / "config.yaml"
    rlpipe("sft", str(cfg), "--run-id", "sft-exported", "--set", f"sft.files={sft_file}", "--set", "sft.steps=3",
           "--set", "sft.batch_size=8", "--set", "sft.warmup_steps=1",
           "--set", f"model.path={workspace}/models/sft-exported", cwd=workspace)  # fmt: skip
    sft_run = RunLayout(layout.root, "sft-exported")
    assert pl.read_parquet(sft_run.stage_dir("sft_data", 0) / "*.parquet").height == sft.height
    assert pl.read_parquet(sft_run.stage_dir("sft_metrics", 0) / "*.parquet").height == 3
    assert (workspace / "models" / "sft-exported" / "model.safetensors").exists()
    rlpipe("dpo", str(cfg), "--run-id", "dpo-exported", "--set", f"preference.data={pairs_file}",
           "--set", "preference.heldout_fraction=0.25", "--set", "dpo.steps=2", "--set", "dpo.batch_size=4",
           "--set", "dpo.micro_batch_size=4", "--set", f"dpo.out_path={workspace}/models/dpo-exported",
           "--set", "eval.max_prompts=8", cwd=workspace)  # fmt: skip
    dpo_run = RunLayout(layout.root, "dpo-exported")
    rankings = pl.read_parquet(dpo_run.stage_dir("preference_rankings", 0) / "*.parquet")
    assert rankings.height == pairs.height and rankings["responses"].to_list()[0] == [
        pairs["chosen"][0],
        pairs["rejected"][0],
    ]
    assert pl.read_parquet(dpo_run.stage_dir("dpo_metrics", 1) / "*.parquet").height == 2
    assert (workspace / "models" / "dpo-exported" / "model.safetensors").exists()
