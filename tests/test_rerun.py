"""Rerun bookkeeping on a small fabricated run: what is stale, how it is kept aside, what a fork shares."""

import json
import time

import polars as pl
import pytest

from flows.rerun import affected, check_sampler_logprobs, fork, supersede
from schemas.config import ConfigError, build_config
from schemas.errors import NotFound
from storage import RunLayout, write_stage
from tasks.analysis.run_diff import diff_frames
from tasks.stages.graph import RL_ITERATION

STAGES = tuple(s.name for s in RL_ITERATION if s.name != "prompt_stats")  # prompt_stats exists only under dcpo


def fake_run(tmp_path, iterations=3) -> RunLayout:
    """Manifest-complete stage folders (tiny placeholder tables) plus checkpoints and a summary."""
    layout = RunLayout(tmp_path / "runs", "r")
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text("seed: 0\n")
    frame = pl.DataFrame({"x": [1]})
    from schemas.tables import TableSchema

    table = TableSchema("placeholder", 1, {"x": pl.Int64})
    for k in range(1, iterations + 1):
        for s in STAGES:
            write_stage(layout, s, k, frame, fp=f"{s}{k}", inputs={}, config_hash="", started=time.time(), table=table)
        (layout.checkpoint_dir(k)).mkdir(parents=True)
        (layout.checkpoint_dir(k) / "model.safetensors").write_bytes(b"w")
    layout.summary_path.write_text("{}")
    return layout


def rel(layout, paths):
    return sorted(str(p.relative_to(layout.run_dir)) for p in paths)


def test_rerun_of_advantages_makes_later_stages_and_iterations_stale(tmp_path):
    layout = fake_run(tmp_path)
    stale = rel(layout, affected(layout, "advantages", 2))
    assert "advantages/iter=00002" in stale and "train_metrics/iter=00002" in stale and "eval/iter=00002" in stale
    assert "checkpoints/iter=00002" in stale and "checkpoints/iter=00003" in stale and "rollouts/iter=00003" in stale
    assert "logprobs/iter=00002" not in stale and "scores/iter=00002" not in stale
    assert not any(p.endswith("iter=00001") for p in stale) and "summary.json" in stale


def test_supersede_moves_aside_and_records(tmp_path):
    layout = fake_run(tmp_path)
    record = supersede(layout, "scores", 3, ["reward.weights.format=0.5"])
    assert not layout.manifest_path("scores", 3).exists() and layout.manifest_path("rollouts", 3).exists()
    kept = layout.run_dir / record["kept_in"]
    assert (kept / "scores/iter=00003/_manifest.json").exists() and (
        kept / "checkpoints/iter=00003/model.safetensors"
    ).exists()
    log = json.loads((layout.run_dir / "superseded.json").read_text())
    assert log[0]["stage"] == "scores" and "scores/iter=00003" in log[0]["moved"]
    from tasks.analysis.show import superseded_stages

    assert ("scores", 3) in superseded_stages(layout) and ("rollouts", 3) not in superseded_stages(layout)


def test_fork_hard_links_only_what_stays_valid(tmp_path):
    src = fake_run(tmp_path)
    dst = RunLayout(tmp_path / "runs", "f")
    n = fork(src, dst, "advantages", 2)
    assert dst.manifest_path("logprobs", 2).exists() and not dst.manifest_path("advantages", 2).exists()
    assert not dst.manifest_path("rollouts", 3).exists() and (dst.checkpoint_dir(1) / "model.safetensors").exists()
    assert not dst.checkpoint_dir(2).exists()
    assert dst.part_path("rollouts", 1, 0).stat().st_ino == src.part_path("rollouts", 1, 0).stat().st_ino
    assert n == len([f for f in dst.run_dir.rglob("*") if f.is_file()])


def test_diff_frames_reports_changed_and_missing_samples():
    keys = ["prompt_id", "sample_idx"]
    a = pl.DataFrame(
        {
            "prompt_id": ["p", "p", "q"],
            "sample_idx": [0, 1, 0],
            "advantage": [1.0, -1.0, 0.0],
            "tokens": [[1.0], [2.0], [3.0]],
        }
    )
    b = pl.DataFrame(
        {
            "prompt_id": ["p", "p", "r"],
            "sample_idx": [0, 1, 0],
            "advantage": [1.0, -0.5, 0.0],
            "tokens": [[1.0], [2.5], [3.0]],
        }
    )
    rows, counts = diff_frames(a, b, keys)
    assert counts == {"only_in_a": 1, "only_in_b": 1, "advantage": 1, "tokens": 1}
    assert rows.select("sample_idx", "advantage_a", "advantage_b").rows() == [(1, -1.0, -0.5)]


def test_through_spans_the_rerunnable_stages_in_the_flows_order():
    import pytest

    from flows.rerun import stages_through
    from schemas.config import ConfigError

    assert stages_through("logprobs", None) == ["logprobs"]
    assert stages_through("logprobs", "optimize") == ["logprobs", "advantages", "train_metrics"]
    assert stages_through("scores", "advantages") == ["scores", "batch", "logprobs", "advantages"]
    with pytest.raises(ConfigError, match="--through scores comes before --stage logprobs"):
        stages_through("logprobs", "scores")
    with pytest.raises(ConfigError, match=r"cannot rerun stage 'eval' \(--through\)"):
        stages_through("logprobs", "eval")


def test_sampler_logprobs_at_another_temperature_are_refused_as_pi_old(tmp_path):
    """The rollouts' manifests record the temperature of their sampler logprobs; a rerun that would read them as π_old
    (or for a rollout correction) under another temperature is refused, naming the iteration. With partial rollouts
    the carried prefixes' iterations, up to rl.max_staleness before, count too; without, only the iteration's own,
    and not when the rerun samples them again."""
    layout = fake_run(tmp_path, iterations=3)
    for k, temperature in ((1, 0.7), (2, 0.5), (3, 0.5)):
        path = layout.manifest_path("rollouts", k)
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps({**manifest, "extra": {"sampler_logprobs_temperature": temperature}}))
    at = dict(rollout={"temperature": 0.5}, loss={"old_logprobs": "sampler"}, kl={"beta": 0.0, "placement": "none"})
    cfg = build_config(at)
    check_sampler_logprobs(cfg, layout, 3, regenerated=False)
    check_sampler_logprobs(cfg, layout, 2, regenerated=False)
    with pytest.raises(ConfigError, match="rollouts of iteration 1 hold sampler logprobs at temperature 0.7"):
        check_sampler_logprobs(cfg, layout, 1, regenerated=False)
    check_sampler_logprobs(cfg, layout, 1, regenerated=True)  # a rerun from the rollouts samples them again
    partial = build_config({**at, "rollout": {"temperature": 0.5, "partial_tokens": 4}, "rl": {"max_staleness": 1}})
    check_sampler_logprobs(partial, layout, 3, regenerated=False)  # iterations 2 and 3: both at 0.5
    for regenerated in (False, True):  # a carried prefix may come from iteration 1
        with pytest.raises(ConfigError, match="iteration 1 hold"):
            check_sampler_logprobs(partial, layout, 2, regenerated=regenerated)
    trainer = build_config({"rollout": {"temperature": 0.5}})  # π_old from the trainer, no correction: nothing read
    check_sampler_logprobs(trainer, layout, 1, regenerated=False)


def preference_run(tmp_path, run_id: str, stages: dict[str, int]) -> RunLayout:
    """A run-scope flow's run (its config real, no engine ran): `stages` (table → iteration) as placeholders, except
    the pairs and reference logprobs the DPO eval reads, a checkpoint 1 and a summary."""
    from schemas.config import dump_config, load_config
    from tests.conftest import tiny_config

    layout = RunLayout(tmp_path / "runs", run_id)
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text(dump_config(load_config(tiny_config(tmp_path))))
    keys = {"prompt_id": ["a", "a", "b"], "pair_idx": pl.Series([0, 1, 0], dtype=pl.Int32)}
    ids = pl.Series([[1]] * 3, dtype=pl.List(pl.Int32))
    real = {
        "preference_pairs": pl.DataFrame(
            {**keys, "prompt": "p", "prompt_token_ids": ids, "chosen": "c", "rejected": "r", "split": "heldout"}
        ),
        "ref_logprobs": pl.DataFrame({**keys, "chosen_logp": [-1.0, -2.0, -1.0], "rejected_logp": [-1.5, -1.0, -3.0]}),
    }
    for name, k in stages.items():
        if name in real:
            write_stage(layout, name, k, real[name], fp=f"fp-{name}{k}", inputs={}, config_hash="", started=0.0)
        else:
            write_placeholder(layout, name, k)
    layout.checkpoint_dir(1).mkdir(parents=True)
    (layout.checkpoint_dir(1) / "model.safetensors").write_bytes(b"w")
    layout.summary_path.write_text("{}")
    return layout


def write_placeholder(layout, name: str, k: int) -> None:
    from schemas.tables import TableSchema

    table = TableSchema("placeholder", 1, {"x": pl.Int64})
    write_stage(layout, name, k, pl.DataFrame({"x": [1]}), fp=f"fp-{name}{k}", inputs={}, config_hash="", started=0.0,
                table=table)  # fmt: skip


def test_a_dpo_runs_eval_stage_is_rerun_from_its_cached_tables_with_the_fingerprint_the_flow_gave_it(
    tmp_path, monkeypatch
):
    """A run-scope stage reruns at iteration 0 through the graph: it and what reads it in the run's graph are
    recomputed, the upstream handed from the manifests as the flow handed it (the same fingerprint); a rerun of the
    training moves its checkpoint and the trained policy's eval aside, and `resume` runs the DPO flow."""
    from flows.rerun import rerun, run_flow
    from storage import read_manifest
    from tasks.stages import dpo, graph

    stages = {"dataset": 0, "eval": 0, "preference_rankings": 0, "preference_pairs": 0, "ref_logprobs": 0}
    layout = preference_run(tmp_path, "dpo", {**stages, "dpo_metrics": 1})
    stages["dpo_metrics"] = 1
    write_placeholder(layout, "eval", 1)  # the trained policy's eval
    scored = []

    def policy_logprobs(ctx, model_path, pairs, name):  # the trained policy's, without a scoring worker
        scored.append(model_path)
        return pairs.select("prompt_id", "pair_idx", chosen_logp=pl.lit(-1.0), rejected_logp=pl.lit(-2.0))

    monkeypatch.setattr(dpo, "sequence_logprobs", policy_logprobs)
    monkeypatch.setattr("tasks.stages.preflight.check_model", lambda cfg, flow: None)
    root = str(layout.root)
    fps = {name: [f"fp-{name}{k}"] for name, k in stages.items()}
    first = dpo.dpo_eval_task.fn(**graph.task_arguments(dpo.EVAL_SPEC, root, "dpo", 0, 0, fps, set()))
    assert first.fingerprint == read_manifest(layout, "dpo_eval", 1)["fingerprint"]
    assert run_flow(layout) == "dpo"

    result = rerun("dpo", 0, "dpo_eval", [], None, root)
    again = read_manifest(layout, "dpo_eval", 1)
    assert result["stage"] == "dpo_eval" and result["superseded"] == 2  # dpo_eval and the summary
    assert again["fingerprint"] == first.fingerprint
    assert again["inputs"] == {"pairs": "fp-preference_pairs0", "ref": "fp-ref_logprobs0", "dpo": "fp-dpo_metrics1"}
    assert scored == [str(layout.checkpoint_dir(1))] * 2 and layout.manifest_path("eval", 1).exists()

    stale = rel(layout, affected(layout, "dpo_metrics", 0))
    assert stale == ["checkpoints/iter=00001", "dpo_eval/iter=00001", "dpo_metrics/iter=00001", "eval/iter=00001"]
    assert rel(layout, affected(layout, "ref_logprobs", 0))[-1] == "ref_logprobs/iter=00000"
    with pytest.raises(ConfigError, match="computed once per run: rerun it with --iteration 0"):
        rerun("dpo", 1, "dpo_eval", [], None, root)
    with pytest.raises(ConfigError, match="--through spans an RL iteration's stages"):
        rerun("dpo", 0, "ref_logprobs", [], None, root, through="dpo_eval")
    with pytest.raises(NotFound, match="not a run of the flow that computes rm_eval \\(dpo\\)"):
        rerun("dpo", 0, "rm_eval", [], None, root)


def test_a_reward_model_runs_pairs_rerun_leaves_its_trained_model_which_reads_the_rankings(tmp_path):
    """Stale is what reads the stage in the run's own graph: the reward model trains on the rankings, not the pairs."""
    rm = {"preference_rankings": 0, "preference_pairs": 0, "rm_metrics": 1, "rm_eval": 1}
    layout = preference_run(tmp_path, "rm", rm)
    assert rel(layout, affected(layout, "preference_pairs", 0)) == [
        "preference_pairs/iter=00000",
        "rm_eval/iter=00001",
        "summary.json",
    ]
    assert "checkpoints/iter=00001" in rel(layout, affected(layout, "preference_rankings", 0))
