"""Operating a run safely, without engines: one writer per run, a changed config never overwrites finished outputs,
reads are verified against the manifests, SQL reads the run's tables and nothing else, stray folders are ignored,
bounds and unreadable configs are one line, a full disk names the path and leaves nothing half-written, `show` fits
80 columns, the time plot stacks only disjoint stages, and long steps report progress."""

import json
import os
import shutil
import subprocess
import sys
import time

import polars as pl
import pytest
from rich.console import Console
from typer.testing import CliRunner

from schemas.config import ConfigError, RunConfig, dump_config, load_config
from storage import DiskFullError, RunLayout, write_stage, written
from storage.lock import RunLocked, acquire_run_lock, release_run_lock
from tasks.stages import graph
from tests.conftest import ROOT, tiny_config


def app():
    from flows.cli import app

    return app


def cli(*args):
    result = CliRunner().invoke(app(), list(args))
    return result.exit_code, [ln for ln in result.output.splitlines() if ln.strip()]


def fake_run(tmp_path, iterations=2, run_id="r") -> tuple[RunLayout, RunConfig]:
    """A run whose complete stages carry the real config hashes of their declared sections (no engine ran)."""
    cfg = load_config(tiny_config(tmp_path))
    layout = RunLayout(tmp_path / "runs", run_id)
    layout.run_dir.mkdir(parents=True)
    layout.config_path.write_text(dump_config(cfg))
    from schemas.tables import TableSchema

    table = TableSchema("placeholder", 1, {"iteration": pl.Int32, "x": pl.Float64})
    for spec in graph.RUN_STAGES[:1] + graph.RL_ITERATION:
        for k in [0] if spec.scope == "run" else range(1, iterations + 1):
            frame = pl.DataFrame(
                {"iteration": [k] * 3, "x": [1.5, -2.0, 0.25]}, schema={"iteration": pl.Int32, "x": pl.Float64}
            )
            write_stage(
                layout,
                spec.name,
                k,
                frame,
                fp=f"{spec.name}{k}",
                inputs={},
                config_hash=cfg.section_hash(*spec.sections, keys=spec.keys),
                started=time.time(),
                table=table,
            )
        if spec.name == "train_metrics":
            for k in range(1, iterations + 1):
                layout.checkpoint_dir(k).mkdir(parents=True)
                (layout.checkpoint_dir(k) / "model.safetensors").write_bytes(b"weights")
    return layout, cfg


def test_one_writer_per_run_and_a_dead_writer_leaves_no_lock(tmp_path):
    layout = RunLayout(tmp_path / "runs", "locked")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; sys.path.insert(0, sys.argv[1]); from storage import RunLayout; from "
                "storage.lock import acquire_run_lock;"
                "acquire_run_lock(RunLayout(sys.argv[2], 'locked'), 'run'); print('held', flush=True); time.sleep(60)"
            ),
            str(ROOT),
            str(tmp_path / "runs"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=rf"run 'locked' is being written by `rlpipe run` \(pid {holder.pid} on "):
            acquire_run_lock(layout, "sft")
        code, lines = cli("run", str(tiny_config(tmp_path)), "--run-id", "locked")
        assert code == 1 and len(lines) == 1 and f"pid {holder.pid}" in lines[0]
    finally:
        holder.kill()
        holder.wait()
    acquire_run_lock(layout, "sft")  # the kernel released the dead holder's lock: no stale lock
    assert json.loads(layout.lock_path.read_text())["pid"] == os.getpid()
    release_run_lock(layout)


def test_a_changed_config_is_refused_unless_reconfigured_and_then_moves_outputs_aside(tmp_path):
    from flows.deployments import prepare_run

    layout, cfg = fake_run(tmp_path)
    config = tiny_config(tmp_path)
    before = layout.manifest_path("train_metrics", 2).read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"exists with another config \(optim.lr differ\), which would recompute its .*logprobs.*train_metrics",
    ):
        prepare_run(str(config), ["optim.lr=0.5"], "r")
    assert (
        layout.manifest_path("train_metrics", 2).read_bytes() == before
        and "lr: 0.5" not in layout.config_path.read_text()
    )
    prepare_run(str(config), ["rl.iterations=5"], "r")  # more iterations recompute nothing: allowed
    prepare_run(str(config), ["optim.lr=0.5"], "r", reconfigure=True)
    record = json.loads(layout.superseded_log.read_text())[-1]
    assert record["reconfigure"] and ["logprobs", 1] in record["stages"] and ["rollouts", 1] not in record["stages"]
    kept = layout.run_dir / record["kept_in"]
    assert (kept / "train_metrics/iter=00002/_manifest.json").read_bytes() == before  # moved, not overwritten
    assert (kept / "checkpoints/iter=00001/model.safetensors").exists() and not layout.checkpoint_dir(1).exists()
    assert layout.manifest_path("rollouts", 2).exists() and not layout.manifest_path("logprobs", 1).exists()
    release_run_lock(layout)


def test_show_and_sql_refuse_a_damaged_part_with_one_line_naming_it(tmp_path):
    layout, _ = fake_run(tmp_path)
    root = str(tmp_path / "runs")
    code, lines = cli("sql", "r", "select round(sum(x), 2) as s from scores", "--root", root)
    assert code == 0 and any("-0.5" in ln for ln in lines)  # 2 iterations × (1.5 − 2.0 + 0.25)
    assert (layout.run_dir / "_verified.json").exists()  # checked once, cached by size and mtime
    part = layout.part_path("scores", 1, 0)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    part.write_bytes(bytes(data))
    for args in (("sql", "r", "select sum(x) from scores"), ("show", "r"), ("diff", "r", "r", "--stage", "scores")):
        code, lines = cli(*args, "--root", root)
        assert code == 1 and len(lines) == 1, (args, lines)
        assert (
            f"{part} is damaged (its sha256 differs from its manifest's)" in lines[0] and "rlpipe resume r" in lines[0]
        )
    part.write_bytes(bytes(data[:-20]))  # truncated
    code, lines = cli("sql", "r", "select 1", "--root", root)
    assert code == 1 and f"{part} is damaged ({len(data) - 20} bytes, its manifest says {len(data)})" in lines[0]


@pytest.mark.parametrize(
    "query",
    [
        "select * from read_csv('/etc/passwd')",
        "select * from read_text('/etc/hostname')",
        "select * from read_blob('/etc/hostname')",
        "select * from glob('/etc/*')",
        "select * from read_parquet('https://example.com/x.parquet')",
        "select * from read_parquet('{runs}/r/config.yaml')",
    ],
)
def test_sql_reads_the_runs_tables_and_nothing_else(tmp_path, query):
    fake_run(tmp_path)
    code, lines = cli("sql", "r", query.format(runs=tmp_path / "runs"), "--root", str(tmp_path / "runs"))
    assert code == 1 and len(lines) == 1 and "file system operations are disabled by configuration" in lines[0], lines


@pytest.mark.parametrize(
    "query, needle",
    [
        ("INSTALL httpfs", "read-only"),
        ("SET enable_external_access = true", "read-only"),
        ("select 1; LOAD httpfs", "read-only"),
    ],
)
def test_sql_refuses_settings_and_extensions(tmp_path, query, needle):
    fake_run(tmp_path)
    code, lines = cli("sql", "r", query, "--root", str(tmp_path / "runs"))
    assert code == 1 and needle in lines[0]


def test_stray_folders_are_ignored_with_a_warning(tmp_path):
    layout, _ = fake_run(tmp_path)
    root = str(tmp_path / "runs")
    import shutil

    shutil.copytree(layout.stage_dir("scores", 1), layout.stage_root("scores") / "iter=00001.bak")
    (layout.stage_root("scores") / "iter=abc").mkdir()
    (layout.run_dir / "my backup" / "iter=00001").mkdir(parents=True)
    assert layout.iterations("scores") == [1, 2] and "my backup" not in layout.stages()
    for args in (("sql", "r", "select count(*) as n from scores"), ("show", "r")):
        code, lines = cli(*args, "--root", root)
        assert code == 0, lines
        warnings = [ln for ln in lines if ln.startswith("warning: ignoring")]
        assert (
            len(warnings) == 3
            and any("iter=00001.bak" in w for w in warnings)
            and any("my backup" in w for w in warnings)
        )


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lr=.inf", "optim.lr: Input should be a finite number"),
        ("reward.functions.accuracy.weight=.nan", "Input should be a finite number"),
        ("rl.iterations=1000000000000", "rl.iterations: Input should be less than or equal to 1000000"),
        ("rl.iterations=1.0e+12", "rl.iterations: Input should be less than or equal to 1000000"),
        ("rl.iterations=1e12", "rl.iterations: Input should be a valid integer"),  # YAML reads 1e12 as text
        (
            "rollout.prompts_per_round=1000000000",
            "rollout.prompts_per_round: Input should be less than or equal to 1000000",
        ),
        ("rollout.max_tokens=1000000000", "rollout.max_tokens: Input should be less than or equal to 1048576"),
    ],
)
def test_bounds_are_one_line(tmp_path, override, needle):
    code, lines = cli("run", str(tiny_config(tmp_path)), "--set", override)
    assert code == 1 and len(lines) == 1 and needle in lines[0], lines


def test_unreadable_configs_and_run_ids_are_one_line(tmp_path):
    (tmp_path / "recursive.yaml").write_text("a: &a [*a]\n")
    (tmp_path / "latin1.yaml").write_bytes("seed: 0\nnote: caf\xe9\n".encode("latin-1"))
    for config, needle in (("recursive.yaml", "a recursive YAML alias"), ("latin1.yaml", "it is not UTF-8 text")):
        code, lines = cli("run", str(tmp_path / config))
        assert code == 1 and len(lines) == 1 and needle in lines[0], lines
    code, lines = cli("run", str(tiny_config(tmp_path)), "--run-id", "good\n")
    assert code == 1 and "invalid run id 'good\\n'" in lines[0]


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB filesystem (a tmpfs, mounted as root) to fill."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs root (this machine's CI runs as root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_names_the_path_and_leaves_nothing_half_written(tiny_disk):
    layout = RunLayout(tiny_disk, "r")
    import numpy as np

    big = pl.DataFrame({"x": np.random.default_rng(0).random(400_000)})  # ~3 MB of incompressible floats
    from schemas.tables import TableSchema

    with pytest.raises(DiskFullError, match=f"no space left on device writing {layout.part_path('scores', 1, 0)}"):
        write_stage(
            layout,
            "scores",
            1,
            big,
            fp="f",
            inputs={},
            config_hash="",
            started=0.0,
            table=TableSchema("t", 1, {"x": pl.Float64}),
        )
    checkpoint, tmp = tiny_disk / "checkpoints/iter=00001", tiny_disk / "checkpoints/iter=00001.tmp"
    with pytest.raises(DiskFullError, match=f"no space left on device writing {checkpoint}"):
        with written(checkpoint, tmp):  # what a trainer's failed save looks like from the stage
            tmp.mkdir(parents=True)
            with open(tmp / "model.safetensors", "wb") as f:
                f.write(os.urandom(2 << 20))
    leftovers = [p for p in tiny_disk.rglob("*") if ".tmp" in p.name]
    assert not leftovers and not list(tiny_disk.rglob("*.parquet")) and not layout.manifest_path("scores", 1).exists()


def test_a_checkpoint_that_would_not_fit_is_refused_before_training_naming_path_and_bytes(tiny_disk):
    from storage import ensure_free

    folder = tiny_disk / "runs/r/checkpoints"  # not there yet: its filesystem is asked
    ensure_free(folder, 100_000, "the checkpoint of iteration 3")
    with pytest.raises(DiskFullError) as err:
        ensure_free(folder, 5_000_000, "the checkpoint of iteration 3")
    assert str(err.value).startswith(f"not enough free disk for the checkpoint of iteration 3 at {folder}: it needs ")
    assert "about 0.01 GB, 0.00 GB are free" in str(err.value)


def test_show_fits_80_columns(tmp_path):
    from rich.console import Console

    from tasks.analysis.show import show_run

    layout, _ = fake_run(tmp_path, iterations=30)
    pl.DataFrame(
        [
            {
                "iteration": k,
                "policy_version": k,
                "optimizer_steps": 8,
                "loss": 0.1,
                "reward_mean": 0.4,
                "score_accuracy_mean": 0.3,
                "kl_ref": 0.2,
                "entropy": 0.4,
                "clip_frac_high": 0.01,
                "response_length_mean": 3.1,
                "seconds_optimize": 1.5,
            }
            for k in range(1, 31)
        ]
    ).with_columns(pl.col("iteration", "policy_version", "optimizer_steps").cast(pl.Int32))
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    import tasks.analysis.show as show

    printed = []
    original = show.Console
    show.Console = lambda **kw: (
        Console(**{**kw, "width": 80, "record": True, "file": open(os.devnull, "w")}) if kw else Console(width=80)
    )
    try:
        real_print = Console.print
        Console.print = lambda self, *a, **k: (printed.append(self), real_print(self, *a, **k))[1]
        show_run("r", str(tmp_path / "runs"), console)
    finally:
        Console.print, show.Console = real_print, original
    text = "\n".join(c.export_text() for c in printed if c.record)
    assert text and max(len(line) for line in text.splitlines()) <= 80 and "…" not in text
    assert "1-30" in text and "train_metrics" in text


def test_show_reports_disk_use_per_part_and_per_iteration(tmp_path):
    from tasks.analysis.show import disk_table, disk_use

    layout, _ = fake_run(tmp_path, iterations=3)
    shutil.rmtree(layout.checkpoints_root, ignore_errors=True)
    for k, state in [(2, 0), (3, 5000)]:
        folder = layout.checkpoint_dir(k)
        (folder / "critic").mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
        (folder / "critic" / "model.safetensors").write_bytes(b"x" * 100)
        if state:
            for sub in (folder, folder / "critic"):
                (sub / "ds_state").mkdir()
                (sub / "ds_state" / "optim.pt").write_bytes(b"y" * state)
    (layout.run_dir / "logs").mkdir(exist_ok=True)
    (layout.run_dir / "logs" / "engine.log").write_bytes(b"z" * 77)
    use = disk_use(layout)
    assert use["checkpoints"] == {
        2: {"weights": 1100, "state": 0, "files": True},
        3: {"weights": 1100, "state": 10000, "files": True},
    }
    everything = sum(f.stat().st_size for f in layout.run_dir.rglob("*") if f.is_file())
    parts = sum(f.stat().st_size for f in layout.run_dir.rglob("iter=*/*") if "checkpoints" not in f.parts)
    assert use["total"] == everything and sum(use["tables"].values()) == parts and use["iterations"] == 3
    assert use["other"] == everything - parts - 2 * 1100 - 10000 >= 77
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    console.print(disk_table(use))
    text = console.export_text()
    assert "optimizer states (1 kept)" in text and "10.0 KB" in text and "checkpoint weights (2 kept)" in text
    # every update of this run wrote its state (no manifest says otherwise): 1100 + 10000 bytes each
    assert use["written_per_iteration"] == 11100 and "11.1 KB" in text


def test_the_time_plot_stacks_only_disjoint_stage_times():
    from tasks.analysis.report import SUB_TIMERS, stage_columns

    columns = [
        "seconds_prompts",
        "seconds_rollouts",
        "seconds_generate",
        "weight_sync_seconds",
        "seconds_logprobs",
        "seconds_logprobs_forward",
        "seconds_advantages",
        "seconds_optimize",
        "seconds_forward_backward",
        "seconds_eval",
    ]
    assert stage_columns(columns) == [
        "seconds_prompts",
        "seconds_rollouts",
        "seconds_logprobs",
        "seconds_advantages",
        "seconds_optimize",
        "seconds_eval",
    ]
    assert set(columns) - set(stage_columns(columns)) == set(SUB_TIMERS)


def test_progress_lines_say_steps_rate_and_time_left(tmp_path, capsys):
    from tasks.engines.launch import LogTail
    from tasks.engines.workers.training import Progress

    progress = Progress("sft", 100, seconds=0.0)
    progress.started -= 10.0  # ten seconds in
    progress.step(20, {"loss": 0.5})
    line = capsys.readouterr().out.strip()
    assert line.startswith("progress: sft step 20/100 (20%), 2.00 steps/s, 40s left, loss 0.5"), line
    log = tmp_path / "worker.log"
    log.write_text("before the wait\nprogress: old\n")
    tail = LogTail(log)  # what a waiting client echoes: the progress lines appended since the wait began
    for i in range(3):
        with open(log, "a") as f:
            f.write(f"noise\nprogress: step {i}\nprogress: half a li" if i == 1 else f"noise\nprogress: step {i}\n")
        tail.echo()
        if i == 1:
            with open(log, "a") as f:
                f.write("ne\n")
    tail.echo()
    assert capsys.readouterr().err.splitlines() == [
        "progress: step 0",
        "progress: step 1",
        "progress: half a line",
        "progress: step 2",
    ]


EXIT_SCRIPT = """
import atexit, sys, threading, time
from flows.cli import exit_without_final_collection

atexit.register(lambda: print("exit handler ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
sys.stdout.write("buffered, not flushed\\n")
exit_without_final_collection({code!r})
print("never reached")
"""


@pytest.mark.parametrize("code, status", [(3, 3), ("error: a message", 1)])  # 0: every command that succeeds
def test_the_command_exits_as_the_interpreter_would_less_its_final_collection(code, status):
    """The command's fast exit (no final garbage collection) still joins threads, runs the exit handlers, flushes
    what was written, and exits with the status sys.exit would give, a message printed to stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT.format(code=code)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == status
    assert proc.stdout.splitlines() == ["buffered, not flushed", "thread finished", "exit handler ran"]
    assert proc.stderr.strip() == (code if isinstance(code, str) else "")
