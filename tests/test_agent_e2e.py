"""Multi-turn rollouts end to end on the tiny SFT model (vLLM, DeepSpeed, Prefect): an environment poses three sums in
a row. The turns table holds every message; a trajectory's ids are its turns' ids (token in, token out); the trainer
takes the action mask, and the held-out reward gains; SQL reads the turns; scores are recomputed from the saved turns
without generating."""

import polars as pl
import pytest

from storage import RunLayout, read_manifest
from tasks.data.formatting import load_tokenizer
from tests.conftest import ROOT, read_table, rlpipe


def test_an_environment_episode_is_rows_of_turns_and_trains(tiny_sft):
    workspace, cfg = tiny_sft
    fixtures = str(ROOT / "tests" / "agent_fixtures.py")
    overrides = [
        f"agent.environment={{path: {fixtures}, function: MoreSums}}",
        "agent.max_turns=3",
        "agent.max_total_tokens=16",
        f"reward.functions={{solved: {{path: {fixtures}}}}}",
        "eval.judge=reward",
    ]
    sets = [x for o in overrides for x in ("--set", o)]
    rlpipe("run", str(cfg), "--run-id", "agent", *sets, cwd=workspace)
    layout = RunLayout(workspace / "runs", "agent")
    rollouts, turns = read_table(layout, "rollouts", 1), read_table(layout, "turns", 1)
    tok = load_tokenizer(workspace / "models/sft")
    assert rollouts["turns"].max() == 3 and set(rollouts["finish_reason"]) <= {"stop", "length", "max_turns"}
    for row in rollouts.head(8).iter_rows(named=True):
        mine = turns.filter((pl.col("prompt_id") == row["prompt_id"]) & (pl.col("sample_idx") == row["sample_idx"]))
        # Token in, token out: the trajectory is its turns' ids in order; the mask covers the model's own.
        assert [i for ids in mine["token_ids"] for i in ids] == row["token_ids"]
        model = mine.filter(pl.col("role") == "assistant")
        assert sum(row["action_mask"]) == sum(len(ids) for ids in model["token_ids"])
        for obs in mine.filter((pl.col("role") == "user") & (pl.col("token_ids").list.len() > 0)).iter_rows(named=True):
            assert obs["token_ids"] == tok(obs["text"], add_special_tokens=False)["input_ids"]
        assert row["conversation"][-1]["role"] == "assistant" and row["text"] == row["conversation"][-1]["content"]
    scores = read_table(layout, "scores", 1).join(rollouts, on=["prompt_id", "sample_idx"])
    assert (scores["score_solved"] == scores["env_reward"].fill_null(0.0)).all()
    assert read_table(layout, "train_metrics", 2).height == 1
    # Eval plays the same episodes (greedy, and sampled for pass@k), judged with the environment's reward.
    for k in (0, 2):
        summary = read_manifest(layout, "eval", k)["extra"]
        assert summary["mean_turns"] > 1 and summary["tool_call_rate"] == 0.0, summary
        assert summary["mean_reward"] == summary["mean_env_reward"]
    start, final = (read_manifest(layout, "eval", k)["extra"]["mean_reward"] for k in (0, 2))
    assert final > start, (start, final)  # two GRPO iterations on the episodes: the held-out reward gains
    out = rlpipe(
        "sql", "agent", "select role, count(*) as n from turns group by role order by role", "--root",
        str(workspace / "runs"), cwd=workspace,
    )  # fmt: skip
    assert "assistant" in out.stdout and "user" in out.stdout
    shown = rlpipe("show", "agent", "--root", str(workspace / "runs"), cwd=workspace)
    assert "multi-turn rollouts" in shown.stdout
    rlpipe("report", "agent", "--root", str(workspace / "runs"), cwd=workspace)
    assert (layout.run_dir / "report" / "multi_turn.png").read_bytes()[:4] == b"\x89PNG"
    # Re-score from the saved turns: no generation, the same fingerprints.
    root = str(workspace / "runs")
    rlpipe(
        "rerun",
        "agent",
        "--iteration",
        "1",
        "--stage",
        "scores",
        "--fork",
        "agent-rescored",
        "--root",
        root,
        cwd=workspace,
    )
    fork = RunLayout(workspace / "runs", "agent-rescored")
    assert not (fork.run_dir / "logs" / "vllm.log").exists()
    assert read_manifest(fork, "scores", 1)["fingerprint"] == read_manifest(layout, "scores", 1)["fingerprint"]
    assert read_table(fork, "scores", 1)["reward"].to_list() == read_table(layout, "scores", 1)["reward"].to_list()


def test_arpo_rollouts_through_the_engines_keep_the_group_and_the_tree_columns(tiny_sft):
    """agent.branching with a tool, on the real engines: the sampler's head entropy comes back with every turn, each
    prompt still ends with rollout.group_size trajectories (the tiny model never calls the tool, so past the 2 initial
    ones every trajectory is a refill from the prompt, a step each), the tree columns are written, and the hard
    attribution runs over them (with nothing shared, each trajectory keeps its own advantage)."""
    workspace, cfg = tiny_sft
    fixtures = str(ROOT / "tests" / "agent_fixtures.py")
    overrides = [
        f"agent.tools={{add: {{path: {fixtures}}}}}",
        "agent.max_turns=2",
        "agent.max_total_tokens=16",
        "agent.branching={initial: 2}",
        "advantage.branch_attribution=hard",
        "rl.iterations=1",
        "rl.eval_every=1",
        "eval.max_prompts=8",
    ]
    rlpipe("run", str(cfg), "--run-id", "arpo", *(x for o in overrides for x in ("--set", o)), cwd=workspace)
    layout = RunLayout(workspace / "runs", "arpo")
    rollouts, turns = read_table(layout, "rollouts", 1), read_table(layout, "turns", 1)
    sizes = rollouts.group_by("prompt_id").agg(pl.col("sample_idx").sort())
    assert all(s == [0, 1, 2, 3] for s in sizes["sample_idx"].to_list())  # group_size 4: 2 initial, 2 refills
    assert {"parent_sample_idx", "branch_point"} <= set(rollouts.columns) and "inherited" in turns.columns
    assert rollouts["parent_sample_idx"].null_count() == rollouts.height == rollouts["tool_calls"].eq(0).sum()
    advantages = read_table(layout, "advantages", 1).join(rollouts, on=["prompt_id", "sample_idx"])
    for advantage, tokens in advantages.select("advantage", "token_advantages").iter_rows():
        assert tokens == pytest.approx([advantage] * len(tokens), abs=1e-6)
    assert read_manifest(layout, "rollouts", 1)["extra"]["round0"]["turns"] >= 3  # the refills took their own steps
