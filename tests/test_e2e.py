"""End to end on a tiny model with real vLLM, DeepSpeed and Prefect: SFT, 2 RL iterations, SIGKILL, resume."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from storage import RunLayout
from tests.conftest import ROOT, rlpipe, tiny_config

pytestmark = pytest.mark.e2e


def stage_digest(layout: RunLayout, iteration: int) -> dict[str, str]:
    out = {}
    for stage in ("prompts", "rollouts", "scores", "batch", "logprobs", "advantages", "train_metrics"):
        folder = layout.stage_dir(stage, iteration)
        for f in sorted(folder.iterdir()):
            out[f"{stage}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def test_rl_run_survives_sigkill_and_resumes(workspace):
    cfg = tiny_config(workspace)
    rlpipe("init-model", "--config", str(cfg), cwd=workspace)
    rlpipe("sft", str(cfg), "--run-id", "e2e", cwd=workspace)
    layout = RunLayout(workspace / "runs", "e2e")

    env = {**os.environ, "PREFECT_HOME": str(workspace / ".prefect"), "PYTHONPATH": str(ROOT)}
    # Its own process group, so the crash below takes everything the run started (Prefect's temporary API
    # server included), as a machine failure would.
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(cfg), "--run-id", "e2e"], cwd=workspace,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not layout.manifest_path("train_metrics", 1).exists():
        assert proc.poll() is None, "run ended before it could be interrupted"
        assert time.time() < deadline
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = stage_digest(layout, 1)
    assert not layout.manifest_path("train_metrics", 2).exists()

    rlpipe("run", str(cfg), "--run-id", "e2e", cwd=workspace)
    assert stage_digest(layout, 1) == done_before  # completed stages were skipped, files untouched
    summary = json.loads(layout.summary_path.read_text())
    assert summary["iterations"] == 2 and summary["eval_prompts"] == 32
    assert summary["eval_accuracy_sft"] is not None and summary["eval_accuracy_final"] is not None
    for it in (1, 2):
        rollouts = json.loads(layout.manifest_path("rollouts", it).read_text())
        assert rollouts["engines"]["vllm"] == "0.32.0"
        metrics = json.loads(layout.manifest_path("train_metrics", it).read_text())
        assert metrics["engines"]["deepspeed"] == "0.19.8" and metrics["engines"]["zero_stage"] == 1
    sql = rlpipe("sql", "e2e", "select iteration, avg(reward) from scores group by 1 order by 1",
                 "--root", str(workspace / "runs"), cwd=workspace)
    rows = [line for line in sql.stdout.splitlines() if line.strip().startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["1", "2"]
    refused = rlpipe("sql", "e2e", "copy scores to 'x.csv'", "--root", str(workspace / "runs"), cwd=workspace, check=False)
    assert refused.returncode == 1 and "read-only" in refused.stderr


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory):
    """One tiny SFT model shared by the preset runs below."""
    workspace = tmp_path_factory.mktemp("presets")
    cfg = tiny_config(workspace)
    rlpipe("init-model", "--config", str(cfg), cwd=workspace)
    rlpipe("sft", str(cfg), "--run-id", "sft", cwd=workspace)
    return workspace, cfg


def read_table(layout: RunLayout, stage: str, iteration: int):
    import polars as pl

    return pl.read_parquet(layout.stage_dir(stage, iteration) / "*.parquet")


# ppo and dcpo are the presets with state beyond the policy: a critic trained by its own DeepSpeed engine, and
# the per-prompt reward history. (Every preset is run on the demo config for the closing note.)
@pytest.mark.parametrize("algo", ["ppo", "dcpo"])
def test_stateful_presets_run_two_iterations(tiny_sft, algo):
    workspace, cfg = tiny_sft
    rlpipe("run", str(cfg), "--algo", algo, "--run-id", f"algo-{algo}", cwd=workspace)
    layout = RunLayout(workspace / "runs", f"algo-{algo}")
    metrics = [read_table(layout, "train_metrics", it).row(0, named=True) for it in (1, 2)]
    for m in metrics:
        for key in ("clip_frac_low", "clip_frac_high", "nonzero_advantage_fraction", "zero_std_group_fraction", "kl_ref",
                    "entropy", "ppo_kl", "response_length_mean", "truncation_rate"):
            assert m[key] == m[key], key  # present and not NaN
    if algo == "ppo":
        assert (layout.checkpoint_dir(1) / "critic" / "model.safetensors").exists()
        values = read_table(layout, "logprobs", 2)["values"]
        assert values.null_count() == 0 and values.list.len().sum() > 0
        assert all("value_loss" in m and "explained_variance" in m for m in metrics)
    else:
        stats = [read_table(layout, "prompt_stats", it) for it in (1, 2)]
        assert stats[0]["n"].max() == 1 and stats[1].height >= stats[0].height  # snapshots only grow
        out = rlpipe("compare-advantages", f"algo-{algo}", "--iteration", "2", "--root", str(workspace / "runs"), cwd=workspace)
        for name in ("grpo", "drgrpo", "lite_ppo", "rloo", "dcpo"):
            assert name in out.stdout
        check_fork_and_diff(workspace, layout)


def check_fork_and_diff(workspace, layout: RunLayout):
    """Re-derive iteration 1's advantages with another estimator in a fork: nothing is generated, the
    origin is untouched, the fork shares the upstream files, and diff shows the changed samples."""
    root = str(workspace / "runs")
    before = {s: layout.manifest_path(s, 1).read_bytes() for s in ("rollouts", "scores", "advantages")}
    rlpipe("rerun", layout.run_id, "--iteration", "1", "--stage", "advantages", "--set", "advantage.estimator=drgrpo",
           "--fork", "forked", "--root", root, cwd=workspace)
    fork = RunLayout(workspace / "runs", "forked")
    assert {s: layout.manifest_path(s, 1).read_bytes() for s in before} == before
    assert fork.manifest_path("advantages", 1).exists() and not fork.manifest_path("advantages", 2).exists()
    shared = layout.part_path("rollouts", 1, 0).stat()
    assert fork.part_path("rollouts", 1, 0).stat().st_ino == shared.st_ino  # a hard link, not a copy
    assert not (fork.run_dir / "logs" / "vllm.log").exists()  # no engine was started
    out = rlpipe("diff", layout.run_id, "forked", "--stage", "advantages", "--iteration", "1", "--root", root, cwd=workspace)
    assert "advantage_a" in out.stdout and "differing samples" in out.stdout
